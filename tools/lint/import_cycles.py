#!/usr/bin/env python3
"""Import circles between the modules of each crate.

A module is one source file (`foo.rs` or `foo/mod.rs` is module `foo`).
Module A names module B when A's code (tests left out) has a path through
B: `crate::b::..`, `super::b::..`, or `self::b::..` / `b::..` for a child
`b` of A's own module. A circle is a set of modules each reaching the
others; a parent that only declares its children and re-exports their
items (`mod b; pub use b::X;`) does not name them for this check, since
that is how a Rust folder is laid out rather than a dependency.

    python3 tools/lint/import_cycles.py [crates/...]   # exit 1 on a circle
"""

import os
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\b(crate|super|self)::\{([^}]*)\}", re.S)


def strip(src):
    # Comments, strings and #[cfg(test)] modules do not count.
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    src = re.sub(r'"(?:\\.|[^"\\])*"', '""', src)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", src):
        if m.start() < i:
            continue
        out.append(src[i:m.start()])
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
        i = j
    out.append(src[i:])
    return "".join(out)


def modules(src_dir):
    mods = {}
    for root, _, files in os.walk(src_dir):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src_dir)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"], ["main"]):
                rel = []
            mods[tuple(rel)] = os.path.join(root, f)
    return mods


def resolve(mods, base, segs):
    """The deepest module that `base` + `segs` passes through."""
    path = list(base)
    for s in segs:
        if s == "super":
            path = path[:-1]
        else:
            path.append(s)
    best = None
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in mods:
            best = tuple(path[:n])
            break
    return best


def edges(mods):
    out = {m: set() for m in mods}
    for m, f in mods.items():
        src = strip(open(f, encoding="utf-8").read())
        # `mod child;` and re-exports of children are layout, not use.
        body = re.sub(r"^\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*;", "", src, flags=re.M)
        body = re.sub(r"^\s*pub(\([^)]*\))?\s+use\s+(self::)?\w+(::\w+)*(::\{[^}]*\})?(::\*)?\s*;", "", body, flags=re.M)
        refs = []
        # Inline `mod x { .. }` blocks: `super::` inside one is relative to it.
        inline = []
        for im in re.finditer(r"\bmod\s+(\w+)\s*\{", body):
            depth, j = 1, im.end()
            while j < len(body) and depth:
                depth += {"{": 1, "}": -1}.get(body[j], 0)
                j += 1
            inline.append((im.start(), j, im.group(1)))

        def scope(pos):
            return [name for a, b, name in inline if a <= pos < b]

        for g in GROUP.finditer(body):
            for part in g.group(2).split(","):
                part = part.strip()
                if part:
                    refs.append((g.group(1), part.split("::"), scope(g.start())))
        for p in PATH.finditer(body):
            refs.append((p.group(1), p.group(2).split("::")[1:], scope(p.start())))
        children = {k[-1] for k in mods if len(k) == len(m) + 1 and k[:-1] == m}
        for c in children:
            for _ in re.finditer(rf"(?<![:\w]){c}::", body):
                refs.append(("self", [c, "_"], []))
        for head, segs, inner in refs:
            segs = [s.strip() for s in segs if s.strip()]
            here = m + tuple(inner)
            if head == "crate":
                base = ()
            elif head == "super":
                base, segs = here, ["super"] + segs
            else:
                base = here
            t = resolve(mods, base, segs)
            if t is not None and t != m and not (m[: len(t)] == t):
                out[m].add(t)
            # A child naming an item its parent defines is a real use.
            if t is not None and t != m and m[: len(t)] == t and head in ("super", "crate"):
                out[m].add(t)
    return out


def sccs(graph):
    index, low, stack, on, res, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                res.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return res


def main():
    roots = sys.argv[1:] or sorted(
        os.path.join("crates", c) for c in os.listdir("crates") if os.path.isdir(os.path.join("crates", c, "src"))
    )
    found = 0
    for crate in roots:
        mods = modules(os.path.join(crate, "src"))
        g = edges(mods)
        for comp in sccs(g):
            found += 1
            names = sorted("::".join(c) or "(root)" for c in comp)
            print(f"{crate}: circle between {', '.join(names)}")
            for a in comp:
                for b in sorted(g[a]):
                    if b in comp:
                        print(f"    {'::'.join(a) or '(root)'} -> {'::'.join(b) or '(root)'}")
    print(f"{found} import circles in {len(roots)} crates")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
