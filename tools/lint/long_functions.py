#!/usr/bin/env python3
"""Functions longer than a limit (150 lines by default), from `fn` to the
closing brace, in the given folders (default: the engine crate and the
model's architectures, which the house keeps readable that way).

    python3 tools/lint/long_functions.py [--max N] [DIR ...]   # exit 1 if any
"""

import os
import re
import sys

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)")


def clean(line):
    line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(?:\\.|[^'\\])'", "''", line)
    return re.sub(r"//.*", "", line)


def long_functions(path, limit):
    lines = open(path, encoding="utf-8").read().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        depth, opened = 0, False
        for j in range(i, len(lines)):
            text = clean(lines[j])
            if not opened and ";" in text and "{" not in text:
                break  # a declaration without a body
            for ch in text:
                if ch == "{":
                    depth += 1
                    opened = True
                elif ch == "}":
                    depth -= 1
            if opened and depth == 0:
                n = j - i + 1
                if n > limit:
                    found.append((path, i + 1, m.group(7), n))
                break
    return found


def main():
    args = sys.argv[1:]
    limit = 150
    if args[:1] == ["--max"]:
        limit, args = int(args[1]), args[2:]
    dirs = args or ["crates/kvant-engine/src", "crates/kvant-model/src/arch"]
    found = []
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in sorted(files):
                if f.endswith(".rs"):
                    found += long_functions(os.path.join(root, f), limit)
    for path, line, name, n in sorted(found, key=lambda x: -x[3]):
        print(f"{path}:{line}: fn {name} is {n} lines")
    print(f"{len(found)} functions over {limit} lines in {', '.join(dirs)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
