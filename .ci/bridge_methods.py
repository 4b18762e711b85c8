#!/usr/bin/env python3
"""Counts the fns inside `impl Bridge {` blocks across src/, per file (issue 29 item 3: at
most 40). Both builds' files are counted: `cluster/bridge/off.rs` is the no-op twin, so a
cluster build has the total less off.rs's. Usage: bridge_methods.py [SRC_DIR]"""
import os, re, sys
root = sys.argv[1] if len(sys.argv) > 1 else 'src'
def code(l):
    l = re.sub(r'"(\\.|[^"\\])*"', '""', l); l = re.sub(r"'(\\.|[^'\\])'", "''", l)
    return l.split('//')[0]
total = 0; per = {}
for d, _, names in os.walk(root):
    for n in names:
        if not n.endswith('.rs'): continue
        p = os.path.join(d, n); lines = open(p).read().split('\n')
        i = 0
        while i < len(lines):
            if re.match(r'^impl\s+(super::)*Bridge\s*\{', lines[i]):
                depth = 0; j = i
                while True:
                    s = code(lines[j])
                    if depth == 1 and re.match(r'^\s*(pub(\([^)]*\))?\s+)?fn\s', s):
                        per[p] = per.get(p, 0) + 1; total += 1
                    depth += s.count('{') - s.count('}')
                    if depth == 0 and j > i: break
                    j += 1
                i = j
            i += 1
for p, c in sorted(per.items(), key=lambda x: -x[1]): print(f'{c:4} {p}')
print('total', total, 'files', len(per))
