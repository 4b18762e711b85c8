#!/usr/bin/env bash
# Installs the pinned Synapse (a real Matrix homeserver) into a venv inside the clone, for
# tests/platforms_matrix.rs. Nothing is cached outside the run: pip's cache is off, the venv
# lives under target/ (or $TURNSTILE_SYNAPSE_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."

SYNAPSE_VERSION=1.163.2
VENV="${TURNSTILE_SYNAPSE_VENV:-$PWD/target/synapse-venv}"

if [ -x "$VENV/bin/python" ] \
  && "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('matrix-synapse') != '$SYNAPSE_VERSION')" 2>/dev/null; then
  echo "synapse $SYNAPSE_VERSION already in $VENV"
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
