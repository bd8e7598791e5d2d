"""The runtime's modules import each other without cycles (issue 15: the call path lives in
``runtime/program.py``, which ``replicate``, the dynamic path, the persistent cache and the
stages use, so those four no longer import each other in a loop). Every import counts,
function-local ones included; only ``if TYPE_CHECKING:`` blocks (never run) are left out."""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

RUNTIME = pathlib.Path(__file__).resolve().parent.parent / "runtime"


def _imports(tree: ast.AST) -> set[str]:
    """The ``runtime`` modules a module's code imports, outside ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "runtime":
                found.update(a.name for a in node.names)
            elif node.module.startswith("runtime."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("runtime."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for f in RUNTIME.glob("*.py"):
        g.add_node(f.stem)
        g.add_edges_from((f.stem, m) for m in _imports(ast.parse(f.read_text())) if m != f.stem)
    return g


def test_runtime_modules_import_each_other_without_cycles():
    g = _graph()
    assert {"replicate", "dynamic", "persistent", "stages", "program"} <= set(g)
    assert g.has_edge("replicate", "program") and g.has_edge("dynamic", "program")
    assert list(nx.simple_cycles(g)) == []


def test_the_check_sees_a_cycle():
    g = _graph()
    g.add_edge("program", "replicate")  # what the call path used to look like
    assert list(nx.simple_cycles(g))
