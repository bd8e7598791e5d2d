"""The pass manager: runs named passes in order, verifies (after each pass, or once at the
end), times each, and dumps ``NN-<pass>.txt`` per pass when asked.

A pass is an object with a ``name`` and ``apply(graph) -> graph`` (see ``compiler.passes``).
Pipelines can be given as strings: ``"replication,cross-replica-sum,dce"``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from compiler.errors import PassError
from ir.errors import IRError
from ir.graph import Graph
from ir.verifier import verify

DUMP_ENV = "RT_DUMP_DIR"
#: what ``PassManager(verify=...)`` and ``RunOptions(verify=...)`` accept
VERIFY_MODES = (True, False, "each", "end")


class Pass(Protocol):
    """What the pass manager needs of a pass."""

    name: str

    def apply(self, graph: Graph) -> Graph: ...


@dataclass(frozen=True)
class PassRecord:
    """One pipeline stage: the pass name, its wall time, and the graph after it (``None``
    when the pass manager was told not to keep intermediate graphs)."""

    name: str
    seconds: float
    graph: Graph | None


@dataclass
class PassManager:
    """Runs ``passes`` in order on a graph.

    verify: ``True`` or ``"each"``: run the verifier on the imported graph and after every
    pass (tests keep it so). ``"end"``: once, on the pipeline's result; if that fails, the
    pipeline runs again from the imported graph verifying after every pass, so the error
    names the first pass that broke the graph just as ``"each"`` does (passes are pure
    functions of their graph). ``False``: never.
    dump_dir: write ``NN-<pass>.txt`` after each pass; defaults to ``$RT_DUMP_DIR``.
    keep: keep the graph after every pass in ``records`` (for ``Lowered.ir(after=...)``);
    when ``False`` only the last one is kept, so the others are freed as soon as the next
    pass has run (a step compiled on first call needs only the last: this keeps the
    process's long-lived objects, and so the garbage collector's full passes, down);
    ``"ends"``: the imported graph and the last, from which :func:`rerun` makes the
    others again when they are asked for (passes are pure functions of their graph).
    """

    passes: Sequence[Pass]
    verify: bool | str = True
    dump_dir: str | None = None
    records: list[PassRecord] = field(default_factory=list)
    keep: bool | str = True

    def __post_init__(self) -> None:
        if self.dump_dir is None:
            self.dump_dir = os.environ.get(DUMP_ENV) or None
        if self.verify not in VERIFY_MODES:
            raise PassError(f"PassManager: verify must be one of "
                            f"{', '.join(map(repr, VERIFY_MODES))}, got {self.verify!r}")

    def run(self, graph: Graph, import_seconds: float = 0.0) -> Graph:
        """Run the pipeline; ``records`` holds ``import`` plus one entry per pass."""
        if self.verify != "end":
            return self._run(graph, import_seconds, self.verify is True or self.verify == "each")
        try:
            result = self._run(graph, import_seconds, False)
            verify(result, where="after the pipeline", seen={})
            return result
        except Exception as e:  # noqa: BLE001  (a pass may also trip on a graph broken earlier)
            # find the pass that broke it: run again verifying after every pass, which
            # raises the error "each" would have raised (the same one, when a pass raised)
            self._run(graph, import_seconds, True)
            if not isinstance(e, IRError):
                raise
            ran = ", ".join(r.name for r in self.records)
            raise PassError(f"verifier failed after the pipeline (passes that ran: {ran}), "
                            f"though not after any one pass run again: {e}") from e

    def _run(self, graph: Graph, import_seconds: float, each: bool) -> Graph:
        self.records = [PassRecord("import", import_seconds, graph)]
        self._verified: dict[int, Any] = {}  # ops and regions verified once, by identity
        if each:
            self._verify(graph, "import")
        self._dump(0, "import", import_seconds, graph)
        for i, p in enumerate(self.passes, start=1):
            t0 = time.perf_counter()
            try:
                graph = p.apply(graph)
            except IRError as e:
                ran = ", ".join(r.name for r in self.records)
                msg = f"pass {p.name!r} failed (passes that ran before: {ran}): {e}"
                # errors about the user's input keep their type (ShardingError is a ValueError)
                raise (type(e)(msg) if isinstance(e, ValueError) else PassError(msg)) from e
            dt = time.perf_counter() - t0
            if each:
                self._verify(graph, p.name)
            if self.keep is not True and (self.keep is False or i > 1):
                last = self.records[-1]  # (``"ends"`` keeps the imported graph)
                self.records[-1] = PassRecord(last.name, last.seconds, None)
            self.records.append(PassRecord(p.name, dt, graph))
            self._dump(i, p.name, dt, graph)
        return graph

    def _verify(self, graph: Graph, name: str) -> None:
        try:
            verify(graph, where=f"after pass {name!r}", seen=self._verified)
        except IRError as e:
            ran = ", ".join(r.name for r in self.records)
            raise PassError(f"verifier failed after pass {name!r} (passes that ran: {ran}): {e}") from e

    def _dump(self, index: int, name: str, seconds: float, graph: Graph) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        path = os.path.join(self.dump_dir, f"{index:02d}-{name}.txt")
        with open(path, "w") as f:
            f.write(f"// pass: {name}  time: {seconds * 1e3:.3f} ms\n{graph}\n")


def rerun(passes: Sequence[Pass], records: Sequence[PassRecord]) -> list[PassRecord]:
    """``records`` of a run that kept only its ends (``keep="ends"``) with every graph:
    the passes run again from the imported graph (without the verifier: the first run
    verified it); the times are the first run's, the last graph its own object."""
    if all(r.graph is not None for r in records):
        return list(records)
    pm = PassManager(passes, verify=False, dump_dir="", keep=True)
    pm.run(records[0].graph)
    graphs = [r.graph for r in pm.records[:-1]] + [records[-1].graph]
    return [PassRecord(r.name, r.seconds, g) for r, g in zip(records, graphs)]


def parse_pipeline(text: str, **options) -> list[Pass]:
    """Build passes from ``"replication,cross-replica-sum,dce"``; ``options`` are given to
    every pass that has a field of that name (e.g. ``num_replicas``, ``loss_reduction``)."""
    from compiler.passes import PASSES
    out: list[Pass] = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        key = raw.replace("_", "-")
        if key not in PASSES:
            raise PassError(f"unknown pass {raw!r}; known passes: {', '.join(sorted(PASSES))}")
        cls = PASSES[key]
        fields = getattr(cls, "__dataclass_fields__", {})
        out.append(cls(**{k: v for k, v in options.items() if k in fields}))
    return out
