"""Ahead-of-time stages, named as in ``jax.stages``: ``Lowered`` and ``Compiled``."""
from __future__ import annotations

import dataclasses
from typing import Any, TYPE_CHECKING

from compiler import hlo_report, sharding_view
from compiler.hlo_report import Collective
from runtime import tpu as _tpu
from runtime.tpu import MemoryFit, Roofline
from ir.graph import Graph
from ir.printer import printed_names

if TYPE_CHECKING:
    from runtime.program import Program as _Program


def chip_matches(chip: _tpu.TpuChip, device: object) -> bool:
    return getattr(device, "device_kind", None) == chip.device_kind


class Lowered:
    """A step traced, run through the passes and lowered to StableHLO, not yet compiled.

    ``ir(after=None)`` is the IR after a pass (default: the last); ``pass_names`` lists the
    stages (``import`` first); ``as_text()`` is the StableHLO module."""

    def __init__(self, program: _Program):
        self._program = program

    @property
    def pass_names(self) -> list[str]:
        """The stages the step went through, in order: ``import`` (its trace), then each
        pass of the pipeline."""
        return [name for name, _ in self._program.stage_times()]

    def ir(self, after: str | None = None) -> Graph:
        """The IR after the pass named ``after`` (``"import"`` for the traced step;
        ``_`` and ``-`` alike), or after the last pass by default. ``KeyError`` naming the
        passes for an unknown name."""
        recs = self._program.records
        if after is None:
            return recs[-1].graph
        key = after.replace("_", "-")
        for r in recs:
            if r.name == key:
                if r.graph is None:
                    raise KeyError(f"the IR after {after!r} was not kept for a step compiled by "
                                   f"calling it; step.lower(*args).ir(after={after!r}) keeps "
                                   f"every pass's IR")
                return r.graph
        raise KeyError(f"no pass named {after!r}; passes: {', '.join(self.pass_names)}")

    def sharding_view(self, value: str, after: str | None = None) -> str:
        """An ASCII device grid of how ``value`` (its printed name, e.g. ``"%5"``) is laid
        out over the replica's logical devices, after a pass (default: the last)."""
        graph = self.ir(after)
        names = printed_names(graph)  # (each copy of a shared region under its names)
        if value not in names:
            raise KeyError(f"no value named {value!r} in the IR after "
                           f"{after or self.pass_names[-1]!r}")
        v = names[value]
        if v.type.sharding is None:
            raise ValueError(f"{value} has no sharding yet: run the 'sharding' pass first")
        k = self._program.owner.logical_devices
        return f"{value}: {v.type}\n" + sharding_view.render(tuple(v.type.shape), v.type.sharding, k)

    def pass_times(self) -> dict[str, float]:
        """Seconds spent in each stage: ``import`` (the trace of the step), each pass, and
        when known the lowering's two parts (the IR evaluated under ``jax.jit``, then
        JAX's lowering to StableHLO)."""
        out = dict(self._program.stage_times())
        out.update(getattr(self._program, "lower_times", {}))
        return out

    def import_times(self) -> dict[str, float]:
        """The ``import`` stage split: JAX's trace of the step (``"trace"``) and the
        jaxpr's import into the IR (``"import"``), when known."""
        return dict(getattr(self._program, "import_split", {}))

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """The lowered module as text, as ``jax.stages.Lowered.as_text`` gives it
        (``dialect``: ``"stablehlo"`` or ``"hlo"``; ``debug_info``: with locations)."""
        return self._program.jax_lowered.as_text(dialect, debug_info=debug_info)

    def compile(self) -> Compiled:
        """XLA's compile of the lowered module (for the target's devices, compile-only
        ones included): the :class:`Compiled` step."""
        return Compiled(self._program.compile())


class Compiled:
    """A compiled step: call it like the step; read the partitioned, optimized HLO with
    ``as_text()``, XLA's estimates with ``cost_analysis()`` and ``memory_analysis()``."""

    def __init__(self, program: _Program):
        self._program = program

    @property
    def pass_names(self) -> list[str]:
        """The stages the step went through, in order: ``import`` (its trace), then each
        pass of the pipeline."""
        return [name for name, _ in self._program.stage_times()]

    def ir(self, after: str | None = None) -> Graph:
        """The IR after a pass, as :meth:`Lowered.ir` gives it."""
        return Lowered(self._program).ir(after)

    def as_text(self) -> str:
        """The optimized HLO XLA compiled, partitioned per device (what
        ``collectives()`` and ``hlo_report`` read)."""
        return self._program.jax_compiled.as_text()

    def cost_analysis(self) -> Any:
        """XLA's cost estimates of the executable (flops, bytes accessed, ...), as
        ``jax.stages.Compiled.cost_analysis`` gives them."""
        return self._program.jax_compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        """XLA's memory sizes of the executable per device (arguments, outputs,
        temporaries, code), as ``jax.stages.Compiled.memory_analysis`` gives them."""
        return self._program.jax_compiled.memory_analysis()

    @property
    def target(self) -> str:
        """What the step compiled for: e.g. ``"TPU v5 lite x16 (compile-only)"`` or
        ``"cpu x8"``."""
        lay = self._program.owner.layout
        d = lay.devices_nk.flat[0]
        kind = getattr(d, "device_kind", d.platform) if d.platform == "tpu" else d.platform
        return f"{kind} x{lay.devices_nk.size}" + (" (compile-only)" if lay.compile_only else "")

    def memory_fit(self, capacity_bytes: int | None = None) -> MemoryFit:
        """Memory per device (arguments, outputs, temporaries, the peak) against the
        device's HBM (from ``rt.tpu.CHIPS``; ``capacity_bytes`` for other devices): fits, or
        by how much it does not. ``ValueError`` when the capacity is unknown."""
        lay = self._program.owner.layout
        d = lay.devices_nk.flat[0]
        if capacity_bytes is None:
            capacity_bytes = _tpu.device_capacity(d, lay.devices_nk.flat)
        if capacity_bytes is None:
            raise ValueError(f"memory_fit: no known memory capacity for {d.platform} devices "
                             f"({getattr(d, 'device_kind', '?')}); pass capacity_bytes=")
        return _tpu.memory_fit(self.memory_analysis(), capacity_bytes,
                               getattr(d, "device_kind", d.platform))

    def roofline(self, chip: _tpu.TpuChip | str | None = None) -> Roofline:
        """An estimate of the step time on one device from the compiler's cost analysis and
        the collectives of the partitioned HLO: compute, HBM and ICI times and which one
        bounds the step (``rt.tpu`` documents the formula). ``chip``: a ``TpuChip`` or a
        generation name (default: the target's)."""
        lay = self._program.owner.layout
        d = lay.devices_nk.flat[0]
        if isinstance(chip, str):
            if chip not in _tpu.CHIPS:
                raise ValueError(f"roofline: unknown chip {chip!r}; known: {', '.join(_tpu.CHIPS)}")
            chip = _tpu.CHIPS[chip]
        chip = chip or _tpu.chip_of(d)
        if chip is None:
            raise ValueError(f"roofline: {d.platform} devices have no chip figures; pass "
                             f"chip= (one of {', '.join(_tpu.CHIPS)}) to estimate for a TPU")
        cost = self.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
        mesh = self._program.owner.mesh
        return _tpu.roofline(cost, self._collectives_per_step(), chip, tuple(mesh.devices.shape),
                             tuple(mesh.axis_names),
                             _tpu._devices_per_chip(lay.devices_nk.flat) if chip_matches(chip, d)
                             else 1)

    def collectives(self) -> list[Collective]:
        """Every collective in the partitioned HLO (all-reduce, all-gather, reduce-scatter,
        all-to-all, collective-permute) with its bytes per device, device groups, and
        ``ir_sources``: the IR op and the user's source line that caused it."""
        return hlo_report.collectives(self.as_text())

    def collectives_table(self) -> str:
        """``collectives()`` as an aligned text table; with ``steps_per_call`` k > 1, also
        the bytes of one step (the table's total is per call: k steps)."""
        text = hlo_report.summarize(self.collectives())
        k = self._program.owner.steps_per_call
        if k > 1:
            per_step = sum(c.step_bytes or 0 for c in self._collectives_per_step())
            text += f"\n{k} steps per call: {per_step} bytes per device per step"
        return text

    def _collectives_per_step(self) -> list[Collective]:
        """``collectives()`` with those of the ``steps_per_call`` loop counted once (their
        trips divided by its k), as XLA's cost analysis counts the flops of a loop's body
        once: the roofline's compute and collective times are then both one step's
        (before: one step's flops with k steps' collective bytes; found by a probe)."""
        k = self._program.owner.steps_per_call
        out = self.collectives()
        if k == 1:
            return out
        return [dataclasses.replace(c, trips=c.trips // k)
                if c.trips is not None and c.trips >= k and c.trips % k == 0 else c for c in out]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._program.owner._run(self._program, args, kwargs)
