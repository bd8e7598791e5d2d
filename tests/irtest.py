"""Shared helpers for the IR tests: every printed graph must round-trip and verify, and
golden texts are compared through :func:`check_golden`."""
from __future__ import annotations

import os
from pathlib import Path

from ir import _jax_compat as jc
from ir.graph import Graph
from ir.parser import parse
from ir.printer import print_graph
from ir.verifier import verify


def check_roundtrip(graph: Graph) -> str:
    """Assert that ``graph`` verifies and that its text form parses back to the same
    text (``print(parse(text)) == text``); return the text."""
    verify(graph)
    text = print_graph(graph)
    again = parse(text)
    text2 = print_graph(again)
    assert text2 == text, _diff(text, text2)
    verify(again)
    # printing is deterministic: names come from definition order, not counters
    assert print_graph(graph) == text
    return text


def _diff(a: str, b: str, name_a: str = "printed", name_b: str = "reparsed") -> str:
    import difflib
    return f"{name_a} and {name_b} differ:\n" + "\n".join(
        difflib.unified_diff(a.split("\n"), b.split("\n"), name_a, name_b, lineterm=""))


GOLDEN = Path(__file__).parent / "golden"
#: the JAX (major, minor) whose goldens sit at the top of ``tests/golden/``
BASE_JAX = (0, 10)


def golden_path(name: str) -> Path:
    """The expected text of golden ``name`` for the installed JAX.

    Goldens of our passes run on inputs we own (``*.in.txt``) are the same on every JAX.
    A golden of a program JAX traced holds JAX's own derivative rules and attribute
    spellings (jax 0.11 differentiates ``tanh`` with ``one_minus_square`` and gives
    ``reduce_max`` an ``out_sharding``), so another JAX may keep its own copy in
    ``tests/golden/jax-MAJOR.MINOR/NAME``, used when present."""
    version = jc.JAX_VERSION[:2]
    if version != BASE_JAX:
        own = GOLDEN / f"jax-{version[0]}.{version[1]}" / name
        if own.exists():
            return own
    return GOLDEN / name


def check_golden(name: str, text: str) -> str:
    """Assert ``text`` equals the golden ``name`` (:func:`golden_path`); return ``text``.

    ``UPDATE_GOLDEN=1`` rewrites it: on the base JAX the file at the top of
    ``tests/golden/``; on another JAX its ``jax-MAJOR.MINOR/`` copy, written only where the
    text differs from the base file (and removed where it no longer does)."""
    base = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        version = jc.JAX_VERSION[:2]
        if version == BASE_JAX:
            base.write_text(text)
        else:
            own = GOLDEN / f"jax-{version[0]}.{version[1]}" / name
            if base.exists() and base.read_text() == text:
                own.unlink(missing_ok=True)
            else:
                own.parent.mkdir(exist_ok=True)
                own.write_text(text)
    path = golden_path(name)
    assert path.exists(), f"missing golden file {path}: run with UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert text == expected, (f"{name}: output differs from {path} (UPDATE_GOLDEN=1 "
                              f"rewrites it)\n" + _diff(expected, text, "expected", "got"))
    return text
