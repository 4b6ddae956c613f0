#!/usr/bin/env python3
"""Fails when a crate's top-level modules import each other in a cycle.

For each crate (kernels, engine, server, loadtest), every `crate::X` path in code (comments
and doc comments excluded) of a file under `src/Y/` or `src/Y.rs` is an edge Y -> X between
top-level modules. A strongly connected component of more than one module is a cycle: the
layers of a crate must form a DAG (issue 30), so a reader can understand a module from the ones
below it. Prints each cycle with the lines that make it; exit status 1 if there is any.
"""
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CRATES = ["kernels", "engine", "server", "loadtest"]
PATH = re.compile(r"\bcrate::([a-z_][a-z_0-9]*)")


def edges(crate):
    """(from, to) -> [file:line] for every crate:: path in code."""
    src = os.path.join(ROOT, crate, "src")
    found = collections.defaultdict(list)
    for root, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            top = rel.split(os.sep)[0].removesuffix(".rs")
            if top in ("lib", "main"):
                continue
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    code = line.split("//", 1)[0]
                    for m in PATH.finditer(code):
                        if m.group(1) != top:
                            found[(top, m.group(1))].append(f"{crate}/src/{rel}:{n}")
    return found


def cycles(found):
    """Strongly connected components of more than one node (Tarjan)."""
    graph = collections.defaultdict(set)
    for a, b in found:
        graph[a].add(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(list(graph)):
        if v not in index:
            visit(v)
    return out


def main():
    bad = False
    for crate in CRATES:
        found = edges(crate)
        for comp in cycles(found):
            bad = True
            print(f"{crate}: modules {', '.join(comp)} import each other:")
            for (a, b), where in sorted(found.items()):
                if a in comp and b in comp:
                    print(f"  {a} -> {b}: {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}")
    if bad:
        sys.exit(1)
    print("no import cycles between top-level modules in " + ", ".join(CRATES))


if __name__ == "__main__":
    main()
