#!/usr/bin/env bash
# Installs the pinned Synapse (a real Matrix homeserver) into a venv inside the clone, for
# tests/platforms_matrix.rs, and beside it the human's independent encrypting client for
# tests/platforms_matrix_e2ee.rs: matrix-nio with its E2E extra (the `vodozemac` Python
# bindings, wheels on PyPI, nothing compiled). Nothing is cached outside the run: pip's cache is off, the venv
# lives under target/ (or $TURNSTILE_SYNAPSE_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."

SYNAPSE_VERSION=1.163.2
NIO_VERSION=0.26.0
VODOZEMAC_PY_VERSION=0.10.0
VENV="${TURNSTILE_SYNAPSE_VENV:-$PWD/target/synapse-venv}"

install_nio() {
  if "$VENV/bin/python" -c "import sys, importlib.metadata as m, nio.crypto; sys.exit(m.version('matrix-nio') != '$NIO_VERSION' or not nio.crypto.ENCRYPTION_ENABLED)" 2>/dev/null; then
    echo "matrix-nio $NIO_VERSION (e2e) already in $VENV"
    return
  fi
  local start
  start=$(date +%s)
  PIP_NO_CACHE_DIR=1 "$VENV/bin/pip" install -q --disable-pip-version-check \
    "matrix-nio[e2e]==$NIO_VERSION" "vodozemac==$VODOZEMAC_PY_VERSION"
  "$VENV/bin/python" -c "import nio.crypto, sys; sys.exit(not nio.crypto.ENCRYPTION_ENABLED)"
  echo "matrix-nio $NIO_VERSION with E2E install took $(( $(date +%s) - start ))s"
}

if [ -x "$VENV/bin/python" ] \
  && "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('matrix-synapse') != '$SYNAPSE_VERSION')" 2>/dev/null; then
  echo "synapse $SYNAPSE_VERSION already in $VENV"
  install_nio
  exit 0
fi

if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  # Debian splits venv/ensurepip out of python3.
  apt-get update -q && apt-get install -y -q python3-venv
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP_NO_CACHE_DIR=1 "$VENV/bin/pip" install -q --disable-pip-version-check "matrix-synapse==$SYNAPSE_VERSION"
"$VENV/bin/python" -c "import synapse, importlib.metadata as m; print('synapse', m.version('matrix-synapse'), 'installed in $VENV')"
echo "synapse install took $(( $(date +%s) - start ))s"
install_nio
