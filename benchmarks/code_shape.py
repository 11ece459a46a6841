"""The shape of the code, for the structure issue's before/after: modules per package, the longest functions,
the parameters of the training loop's entry points, and import cycles among the project's own modules
(imports inside functions count: they are dependencies too).

    python benchmarks/code_shape.py            # this checkout
    python benchmarks/code_shape.py --at REV   # another commit (read with git show, nothing checked out)
"""

import argparse
import ast
import os
import subprocess
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("compress", "stages")


def sources(rev=None):
    """{module path: text} of every .py file under the packages (at `rev`, or in the working tree)."""
    if rev:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PACKAGES], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
        return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout for n in names if n.endswith(".py")}
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    found[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
    return found


def module_name(path):
    name = path[:-3].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imports(tree, name, known):
    """Project modules imported anywhere in the module (resolved to the longest known module name)."""
    found = set()
    package = name if name in known and any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--at", help="a git revision")
    args = p.parse_args()
    files = sources(args.at)
    known = {module_name(p) for p in files}
    per_package = Counter(os.path.dirname(p) for p in files)
    graph, functions, lines = defaultdict(set), [], 0
    for path, text in files.items():
        tree = ast.parse(text)
        lines += text.count("\n")
        graph[module_name(path)] = imports(tree, module_name(path), known)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}", params))
    print(f"revision: {args.at or 'working tree'}; {len(files)} modules, {lines} lines")
    print("modules per package: " + ", ".join(f"{k} {v}" for k, v in sorted(per_package.items())))
    print("longest functions: " + ", ".join(f"{name} {n} lines" for n, name, _ in sorted(functions)[-5:][::-1]))
    loop = [(name, params) for _, name, params in functions if name.endswith((":fit", ":train_one_epoch"))]
    print("parameters: " + ", ".join(f"{name} {params}" for name, params in loop))
    found = cycles(graph)
    print(f"import cycles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))


if __name__ == "__main__":
    main()
