"""The package layout stays acyclic: no module of compress/ or stages/ imports (at any depth, inside functions
too) a module that imports it back. Uses the same analysis as benchmarks/code_shape.py."""

import ast
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", os.path.join(ROOT, "benchmarks", "code_shape.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    shape = _code_shape()
    known = {"p.a", "p.b", "p.c"}
    a = ast.parse("from p.b import f\n")
    b = ast.parse("def g():\n    from p.a import h\n")
    graph = {"p.a": shape.imports(a, "p.a", known), "p.b": shape.imports(b, "p.b", known), "p.c": set()}
    assert shape.cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycles_among_the_projects_modules():
    shape = _code_shape()
    sources = shape.sources()
    names = {path: shape.module_name(path) for path in sources}
    known = set(names.values())
    graph = {names[p]: shape.imports(ast.parse(text), names[p], known) for p, text in sources.items()}
    assert shape.cycles(graph) == []
