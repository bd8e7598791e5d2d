"""TPU targets without a TPU: compile, size and plan a step for a pod slice from any machine.

Google's ``libtpu`` (the ``tpu`` extra: ``pip install 'jax[tpu]'``, which ``./dev setup``
installs) holds the TPU compiler. JAX can describe a TPU topology this machine does not
have and compile for it; nothing runs::

    devs = rt.tpu_devices("v5e:4x4")                       # 16 compile-only devices
    step = rt.replicate(train_step, num_replicas=8, logical_devices=2, devices=devs)
    compiled = step.lower(params_spec, rt.PerReplica([batch_spec] * 8)).compile()
    print(compiled.memory_fit())     # per-chip memory against the chip's HBM
    print(compiled.roofline())       # compute / HBM / ICI time estimate per step

Arguments are ``jax.ShapeDtypeStruct`` (or arrays: only their shapes and dtypes count),
``PerReplica`` of them for per-replica inputs. Calling such a step raises
:class:`CompileOnlyError`.

:data:`CHIPS` holds what the estimates use per TPU generation (HBM, peak bf16 FLOP/s, HBM
and ICI bandwidth), each figure from Google Cloud's public TPU documentation.

The roofline (:func:`roofline`) is an *estimate*, not a measurement::

    compute_s = flops / peak_bf16_flops            flops: the TPU compiler's cost analysis,
                                                   per device
    hbm_s     = bytes_accessed / hbm_bandwidth     bytes accessed, per device
    ici_s     = sum over collectives c of wire_bytes(c) / ici_bandwidth
    estimate  = max(compute_s, hbm_s, ici_s)       perfect overlap; the largest term bounds

with ``wire_bytes`` the bytes one device sends in a ring algorithm over a group of ``n``
devices: all-reduce ``2(n-1)/n·B``, all-gather and all-to-all ``(n-1)/n·B`` (``B``: the
result per device), reduce-scatter ``(n-1)·B`` (``B``: the scattered result), and
collective-permute ``B``. The ICI bandwidth is the chip's bidirectional figure, shared by
the devices of a chip (v4's two TensorCores are two devices). It ignores latency, f32
matmuls running below the bf16 peak, DCN between slices and imperfect overlap: read it
as a lower bound on the step time and a way to compare plans, not as a prediction.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["TpuChip", "CHIPS", "CompileOnlyError", "DoesNotFitError", "tpu_devices",
           "chip_of", "MemoryFit", "memory_fit", "Roofline", "roofline", "wire_bytes"]

GiB = 1 << 30


class CompileOnlyError(RuntimeError):
    """A step lowered for devices this machine does not have (``rt.tpu_devices``) was
    called: such a step can be lowered, compiled and inspected, not run."""


@dataclass(frozen=True)
class TpuChip:
    """What the estimates use for one TPU generation, per chip.

    name: the topology prefix (``"v5e"``); device_kind: what JAX's devices report
    (``"TPU v5 lite"``); hbm_bytes: HBM capacity; peak_flops: peak dense bf16 FLOP/s;
    hbm_bandwidth: bytes/s; ici_bandwidth: bidirectional inter-chip interconnect bytes/s;
    source: where the figures come from."""

    name: str
    device_kind: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    source: str


#: TPU generations by topology prefix. Sources: Google Cloud's TPU pages, as read in 2026.
CHIPS: dict[str, TpuChip] = {
    # https://cloud.google.com/tpu/docs/v4 : 275 TFLOP/s bf16, 32 GiB HBM2 at 1200 GB/s;
    # ICI: 6 links of 50 GB/s (Jouppi et al., "TPU v4", ISCA 2023) = 300 GB/s per chip.
    "v4": TpuChip("v4", "TPU v4", 32 * GiB, 275e12, 1200e9, 300e9,
                  "cloud.google.com/tpu/docs/v4; ISCA 2023 TPU v4 paper (ICI)"),
    # https://cloud.google.com/tpu/docs/v5e : 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s,
    # bidirectional ICI bandwidth per chip 400 GB/s (4 ports).
    "v5e": TpuChip("v5e", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 400e9,
                   "cloud.google.com/tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v5p : 459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s,
    # bidirectional ICI bandwidth per chip 1200 GB/s.
    "v5p": TpuChip("v5p", "TPU v5", 95 * GiB, 459e12, 2765e9, 1200e9,
                   "cloud.google.com/tpu/docs/v5p"),
    # https://cloud.google.com/tpu/docs/v6e : 918 TFLOP/s bf16, 32 GB HBM at 1640 GB/s,
    # bidirectional ICI bandwidth per chip 800 GB/s.
    "v6e": TpuChip("v6e", "TPU v6 lite", 32 * GiB, 918e12, 1640e9, 800e9,
                   "cloud.google.com/tpu/docs/v6e"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "trillium": "v6e", "v5": "v5p"}
_TOPOLOGY = re.compile(r"^(?P<gen>[A-Za-z0-9]+):(?P<shape>\d+(?:x\d+)*)$")


def _prepare_environment() -> None:
    """libtpu asks the cloud metadata server which TPU it runs on unless told not to, and
    warns about hosts it cannot find: neither applies to a topology compiled offline."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # several processes (pytest workers, a sweep) may compile at once: nothing runs on a TPU
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _parse_topology(topology: str) -> tuple[TpuChip, tuple[int, ...]]:
    m = _TOPOLOGY.match(topology.strip())
    gen = m.group("gen").lower() if m else ""
    gen = _ALIASES.get(gen, gen)
    if not m or gen not in CHIPS:
        raise ValueError(
            f"tpu_devices: {topology!r} is not a TPU topology; write GENERATION:SHAPE with "
            f"GENERATION one of {', '.join(CHIPS)} and SHAPE the chips per torus axis, e.g. "
            f"'v5e:4x4' (16 chips) or 'v5p:4x4x4' (64 chips)"
            + (" (a name like v5e-16 is an accelerator type, counted in chips or cores: give "
               "its topology's shape instead)" if re.match(r"^\w+-\d+$", topology.strip())
               else ""))
    shape = tuple(int(s) for s in m.group("shape").split("x"))
    if any(s < 1 for s in shape):
        raise ValueError(f"tpu_devices: {topology!r} has an axis of size 0")
    return CHIPS[gen], shape


def tpu_devices(topology: str) -> list:
    """The devices of a TPU topology this machine need not have, e.g. ``"v5e:4x4"`` or
    ``"v5p:4x4x4"`` (generation: one of :data:`CHIPS`; shape: chips per torus axis).

    Each device is compile-only: ``rt.replicate(..., devices=...)`` with them lowers and
    compiles with the real TPU compiler (``libtpu``), and calling the step raises
    :class:`CompileOnlyError`. Needs the ``tpu`` extra; ``ImportError`` names it when
    ``libtpu`` is missing, ``ValueError`` for a topology libtpu does not know."""
    chip, shape = _parse_topology(topology)
    _prepare_environment()
    try:
        import libtpu  # noqa: F401  (the TPU compiler's package)
    except ImportError as e:
        raise ImportError(
            f"tpu_devices({topology!r}) needs Google's libtpu, the TPU compiler: install the "
            f"project's 'tpu' extra (pip install -e '.[tpu]', which ./dev setup does) or "
            f"pip install 'jax[tpu]==<your jax version>'") from e
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.name}-{math.prod(shape)}")
    from jax.experimental import topologies
    name = f"{chip.name}:{'x'.join(str(s) for s in shape)}"
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - XlaRuntimeError: libtpu's own message
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"tpu_devices: libtpu refuses the topology {name!r}: {msg}") from e
    return list(desc.devices)


def chip_of(device: Any) -> TpuChip | None:
    """The :data:`CHIPS` entry of a TPU device (by its ``device_kind``), else ``None``."""
    kind = getattr(device, "device_kind", "")
    for chip in CHIPS.values():
        if chip.device_kind == kind:
            return chip
    return None


def _devices_per_chip(devices: Iterable) -> int:
    """Devices (TensorCores JAX shows as devices) per chip: v4 topologies show two."""
    return 1 + max((int(getattr(d, "core_on_chip", 0) or 0) for d in devices), default=0)


def _human_bytes(n: float) -> str:
    """``1005 KiB``, ``3.5 MiB``: three significant digits, never in exponent form."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


# -- memory ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryFit:
    """A compiled step's memory per device against the device's HBM.

    peak_bytes: the compiler's ``peak_memory_in_bytes`` (from buffer liveness) where its
    ``memory_analysis()`` gives one (the TPU compiler does), else arguments + outputs +
    temporaries + generated code − aliased (outputs that reuse donated arguments);
    ``fits`` when ``peak_bytes <= capacity_bytes``; ``margin_bytes`` = capacity − peak
    (negative: short by that much). From a failed compile (the TPU compiler refuses a
    program that does not fit) only ``peak_bytes`` and the capacity are known and the
    parts are ``None``."""

    capacity_bytes: int
    peak_bytes: int
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    alias_bytes: int | None = None
    generated_code_bytes: int | None = None
    device: str = ""
    #: the peak is at least ``peak_bytes`` (a failed compile reported only a part of it)
    lower_bound: bool = False

    @property
    def fits(self) -> bool:
        """Does the peak per device fit the device's HBM?"""
        return self.peak_bytes <= self.capacity_bytes

    @property
    def margin_bytes(self) -> int:
        """HBM left over at the peak (negative: by how much it does not fit)."""
        return self.capacity_bytes - self.peak_bytes

    def to_json(self) -> dict[str, Any]:
        """The fields and the verdict as a JSON-ready dict (the tools' reports)."""
        return {"device": self.device, "capacity_bytes": self.capacity_bytes,
                "peak_bytes": self.peak_bytes, "fits": self.fits,
                "margin_bytes": self.margin_bytes, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "temp_bytes": self.temp_bytes,
                "alias_bytes": self.alias_bytes,
                "generated_code_bytes": self.generated_code_bytes,
                "lower_bound": self.lower_bound}

    def __str__(self) -> str:
        cap, peak = _human_bytes(self.capacity_bytes), _human_bytes(self.peak_bytes)
        share = 100.0 * self.peak_bytes / self.capacity_bytes if self.capacity_bytes else 0.0
        head = (f"fits: peak {peak} of {cap} per device ({share:.1f}%), "
                f"{_human_bytes(self.margin_bytes)} free" if self.fits else
                f"does not fit: peak {'at least ' if self.lower_bound else ''}{peak} exceeds "
                f"the {cap} per device by {'at least ' if self.lower_bound else ''}"
                f"{_human_bytes(-self.margin_bytes)}")
        if self.device:
            head += f" [{self.device}]"
        parts = [(label, getattr(self, k + "_bytes")) for k, label in
                 (("argument", "arguments"), ("output", "outputs"), ("temp", "temporaries"),
                  ("alias", "aliased (-)"), ("generated_code", "generated code"))]
        if all(v is None for _, v in parts):
            return head
        return head + "\n" + "\n".join(f"  {label:16s}{_human_bytes(v):>12s}"
                                       for label, v in parts if v is not None)


class DoesNotFitError(RuntimeError):
    """The TPU compiler refused a program that does not fit its device's HBM;
    ``.fit`` holds the numbers (a :class:`MemoryFit` with ``fits == False``)."""

    def __init__(self, message: str, fit: MemoryFit):
        super().__init__(message)
        self.fit = fit


# The TPU compiler's out-of-memory messages (libtpu 0.0.4x, and older ones)
_OOM_TEMPS = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available "
                        r"HBM \(([\d.]+)([KMGT]?)\)")
_OOM_USED = re.compile(r"[Uu]sed\s+([\d.]+)([KMGT]?)\s+of\s+([\d.]+)([KMGT]?)\s+hbm")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def fit_from_compile_error(message: str, device: Any) -> MemoryFit | None:
    """The numbers of the TPU compiler's out-of-memory error, else ``None``: ``the total
    memory required for HLO temporaries (18.65G) exceeds available HBM (15.75G)`` (the
    temporaries alone: a lower bound on the peak, ``lower_bound=True``) or ``Used 20.5G of
    15.75G hbm``. The capacity is the compiler's (the HBM it can use)."""
    size = lambda num, unit: int(float(num) * _UNITS[unit])  # noqa: E731
    kind = getattr(device, "device_kind", "")
    m = _OOM_TEMPS.search(message)
    if m:
        temps = size(m.group(1), m.group(2))
        return MemoryFit(capacity_bytes=size(m.group(3), m.group(4)), peak_bytes=temps,
                         temp_bytes=temps, device=kind, lower_bound=True)
    m = _OOM_USED.search(message)
    if m:
        return MemoryFit(capacity_bytes=size(m.group(3), m.group(4)),
                         peak_bytes=size(m.group(1), m.group(2)), device=kind)
    return None


def device_capacity(device: Any, devices: Iterable | None = None) -> int | None:
    """HBM bytes of one device of a TPU chip (the chip's HBM over its devices)."""
    chip = chip_of(device)
    if chip is None:
        return None
    per_chip = _devices_per_chip(list(devices)) if devices is not None else 1
    return chip.hbm_bytes // per_chip


def memory_fit(stats: Any, capacity_bytes: int, device: str = "") -> MemoryFit:
    """A :class:`MemoryFit` from ``memory_analysis()`` stats and a capacity per device."""
    get = lambda k: int(getattr(stats, k, 0) or 0)  # noqa: E731
    arg, out, tmp = get("argument_size_in_bytes"), get("output_size_in_bytes"), \
        get("temp_size_in_bytes")
    alias, code = get("alias_size_in_bytes"), get("generated_code_size_in_bytes")
    # the compiler's own peak (buffer liveness) where it gives one, else the parts' sum;
    # XLA:CPU's peak leaves the temporaries out (arguments + outputs only: a 1 MiB
    # argument live with a 1 MiB temporary "fitted" in 1.5 MiB; found by a probe)
    parts = arg + out + tmp + code - alias
    peak = get("peak_memory_in_bytes") or parts
    if device.lower().startswith("cpu"):
        peak = max(peak, parts)
    return MemoryFit(capacity_bytes=int(capacity_bytes), peak_bytes=peak,
                     argument_bytes=arg, output_bytes=out, temp_bytes=tmp, alias_bytes=alias,
                     generated_code_bytes=code, device=device)


# -- roofline -------------------------------------------------------------------------------
def wire_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one device sends for a collective of ``nbytes`` (its result per device) over
    a group of ``group_size`` devices, in a ring algorithm (see the module docstring)."""
    n = max(1, group_size)
    if n == 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
        # (a ragged all-to-all's result is its output buffer: the most it can receive)
        return (n - 1) / n * nbytes
    if kind == "reduce-scatter":
        return float((n - 1) * nbytes)
    if kind == "collective-permute":
        return float(nbytes)
    raise ValueError(f"wire_bytes: unknown collective kind {kind!r}")


def mesh_axes_of_group(group: Iterable[int], mesh_shape: tuple[int, ...],
                       axis_names: tuple[str, ...]) -> str:
    """The mesh axes a device group spans (its members' coordinates differ along them),
    joined by ``+``; device ids are positions in the mesh's flattened device order."""
    coords = [np.unravel_index(int(d), mesh_shape) for d in group]
    axes = [axis_names[a] for a in range(len(mesh_shape))
            if len({c[a] for c in coords}) > 1]
    return "+".join(axes) if axes else "-"


@dataclass(frozen=True)
class Roofline:
    """A per-step time estimate for one device (see the module docstring for the formula).

    compute_s, hbm_s, ici_s: the three times; bound: which of ``"compute"``, ``"hbm"``,
    ``"ici"`` is largest; estimate_s: that largest time. collective_bytes: bytes per
    device in all collectives (result sizes); ici_by_axis: ``{mesh axes: (wire bytes,
    seconds)}``. xla_optimal_s: the TPU compiler's own ``optimal_seconds`` estimate where
    its cost analysis gives one."""

    chip: str
    flops: float
    bytes_accessed: float
    compute_s: float
    hbm_s: float
    ici_s: float
    collective_bytes: int
    ici_by_axis: dict[str, tuple[float, float]] = field(default_factory=dict)
    xla_optimal_s: float | None = None
    #: collectives in loops whose trip count the HLO does not give (counted once each)
    loops_unknown: int = 0

    @property
    def estimate_s(self) -> float:
        """The step's time estimate: its slowest bound (compute, HBM or ICI), seconds."""
        return max(self.compute_s, self.hbm_s, self.ici_s)

    @property
    def bound(self) -> str:
        """What bounds the estimate: ``"compute"``, ``"hbm"`` or ``"ici"``."""
        return max((self.compute_s, "compute"), (self.hbm_s, "hbm"), (self.ici_s, "ici"))[1]

    def to_json(self) -> dict[str, Any]:
        """The estimate and its parts as a JSON-ready dict (the tools' reports)."""
        return {"chip": self.chip, "flops": self.flops, "bytes_accessed": self.bytes_accessed,
                "compute_s": self.compute_s, "hbm_s": self.hbm_s, "ici_s": self.ici_s,
                "estimate_s": self.estimate_s, "bound": self.bound,
                "collective_bytes": self.collective_bytes,
                "ici_by_axis": {k: {"wire_bytes": b, "seconds": s}
                                for k, (b, s) in self.ici_by_axis.items()},
                "xla_optimal_s": self.xla_optimal_s, "loops_unknown": self.loops_unknown,
                "formula": "estimate = max(flops/peak_flops, bytes_accessed/hbm_bandwidth, "
                           "sum(wire_bytes)/ici_bandwidth)"}

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.4g} ms"  # noqa: E731
        lines = [f"roofline estimate on {self.chip}: {ms(self.estimate_s)} per step, "
                 f"{self.bound}-bound (an estimate: max of the three, perfect overlap)",
                 f"  compute {ms(self.compute_s):>12s}  ({self.flops:.4g} flops per device)",
                 f"  hbm     {ms(self.hbm_s):>12s}  ({_human_bytes(self.bytes_accessed)} accessed)",
                 f"  ici     {ms(self.ici_s):>12s}  ({_human_bytes(self.collective_bytes)} "
                 f"in collectives)"]
        for axes, (b, s) in sorted(self.ici_by_axis.items()):
            lines.append(f"    over {axes:18s} {_human_bytes(b):>12s} on the wire  {ms(s)}")
        if self.xla_optimal_s is not None:
            lines.append(f"  (the TPU compiler's own estimate: {ms(self.xla_optimal_s)})")
        if self.loops_unknown:
            lines.append(f"  ({self.loops_unknown} collective(s) in loops whose trip count the "
                         f"compiled HLO does not give: counted once per step, a lower bound)")
        return "\n".join(lines)


def roofline(cost: dict[str, Any], collectives: Iterable[Any], chip: TpuChip,
             mesh_shape: tuple[int, ...], axis_names: tuple[str, ...],
             devices_per_chip: int = 1) -> Roofline:
    """A :class:`Roofline` from a compiled program's cost analysis (per device), its
    collectives (:func:`compiler.hlo_report.collectives`) and the chip's figures."""
    flops = float(cost.get("flops", 0.0) or 0.0)
    accessed = float(cost.get("bytes accessed", 0.0) or 0.0)
    share = max(1, devices_per_chip)
    peak, hbm_bw, ici_bw = chip.peak_flops / share, chip.hbm_bandwidth / share, \
        chip.ici_bandwidth / share
    total_devices = int(np.prod(mesh_shape))
    by_axis: dict[str, list[float]] = {}
    coll_bytes = 0
    unknown = 0
    for c in collectives:
        runs = getattr(c, "trips", 1)
        unknown += runs is None
        runs = runs or 1  # (a loop's unknown trip count: once, said in the text)
        coll_bytes += int(c.bytes) * runs
        if c.kind == "collective-permute":
            group = [d for pair in c.pairs[:1] for d in pair] if c.pairs else []
            n = 2
        else:
            group = list(c.replica_groups[0]) if c.replica_groups else list(range(total_devices))
            n = len(group)
        axes = mesh_axes_of_group(group, mesh_shape, axis_names) if group else "-"
        b = wire_bytes(c.kind, int(c.bytes), n) * runs
        acc = by_axis.setdefault(axes, [0.0, 0.0])
        acc[0] += b
        acc[1] += b / ici_bw
    opt = cost.get("optimal_seconds")
    return Roofline(chip=chip.name, flops=flops, bytes_accessed=accessed,
                    compute_s=flops / peak, hbm_s=accessed / hbm_bw,
                    ici_s=sum(v[1] for v in by_axis.values()), collective_bytes=coll_bytes,
                    ici_by_axis={k: (v[0], v[1]) for k, v in by_axis.items()},
                    xla_optimal_s=float(opt) if opt is not None and opt > 0 else None,
                    loops_unknown=unknown)
