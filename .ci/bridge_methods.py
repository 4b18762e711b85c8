#!/usr/bin/env python3
"""Counts the fns inside `impl Bridge {` blocks of the bridge's state machine
(`server::bridge::Bridge`: the files under server/bridge/ and the cluster's side mounted into
it, cluster/bridge/), per file, and fails above LIMIT (issue 29 item 3: one `impl Bridge`,
the rooms owning their behaviour). The platforms' own `Bridge` types are other types and are
not counted. Both builds' files are counted: `cluster/bridge/off.rs` is the no-op twin, so a
cluster build has the total less off.rs's.
Usage: bridge_methods.py [SRC_DIR] [LIMIT]   (exits 1 past LIMIT, 40 unless given)"""
import os, re, sys

LIMIT = 40
BRIDGE_DIRS = (os.path.join('server', 'bridge'), os.path.join('cluster', 'bridge'))


def code(l):
    l = re.sub(r'"(\\.|[^"\\])*"', '""', l); l = re.sub(r"'(\\.|[^'\\])'", "''", l)
    return l.split('//')[0]


def count(root):
    """{path: methods} of the bridge's `impl Bridge` blocks under root."""
    per = {}
    for sub in BRIDGE_DIRS:
        for d, _, names in os.walk(os.path.join(root, sub)):
            for n in names:
                if not n.endswith('.rs'): continue
                p = os.path.join(d, n); lines = open(p, encoding='utf-8').read().split('\n')
                i = 0
                while i < len(lines):
                    if re.match(r'^impl\s+(super::)*Bridge\s*\{', lines[i]):
                        depth = 0; j = i
                        while True:
                            s = code(lines[j])
                            if depth == 1 and re.match(r'^\s*(pub(\([^)]*\))?\s+)?fn\s', s):
                                per[p] = per.get(p, 0) + 1
                            depth += s.count('{') - s.count('}')
                            if depth == 0 and j > i: break
                            j += 1
                        i = j
                    i += 1
    return per


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else 'src'
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else LIMIT
    per = count(root)
    for p, c in sorted(per.items(), key=lambda x: -x[1]): print(f'{c:4} {p}')
    total = sum(per.values())
    print('total', total, 'files', len(per), 'limit', limit)
    if total > limit:
        print(f'bridge_methods: {total} methods in `impl Bridge` (limit {limit}): give the '
              'behaviour to the room that owns the state, returning a decision', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
