"""Types of IR values: tensor shapes (with symbolic dims), dtypes, replica variance, shardings.

Every type here is a frozen, slotted, hashable dataclass that validates itself in
``__post_init__`` so a malformed type can never be built, and so types can serve as
cache keys and CSE keys for free.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ir.errors import IRTypeError

_new, _set = object.__new__, object.__setattr__

# XLA's short dtype names, used in the text form (``f32[8,4]``).
_SHORT = {
    "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
    "int8": "s8", "int16": "s16", "int32": "s32", "int64": "s64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "bool": "pred", "complex64": "c64", "complex128": "c128",
    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int4": "s4", "uint4": "u4",
}
_LONG = {v: k for k, v in _SHORT.items()}


_KNOWN_DTYPES = set(_SHORT)


def _known_dtype(name: str) -> bool:
    """Is ``name`` a dtype numpy, ml_dtypes or JAX knows (``float8_e4m3b11fnuz``,
    ``key<fry>``, ``float0``)? Known names are remembered."""
    if not name or not isinstance(name, str):
        return False
    ok = name.startswith("key<") and name.endswith(">") or name == "float0"
    if not ok:
        import numpy as np
        try:
            np.dtype(name)
            ok = True
        except TypeError:
            import ml_dtypes
            ok = isinstance(getattr(ml_dtypes, name, None), type)
    if ok:
        _KNOWN_DTYPES.add(name)
    return ok


def short_dtype(name: str) -> str:
    """XLA's short spelling of a numpy/JAX dtype name (``float32`` -> ``f32``)."""
    return _SHORT.get(name, name)


def long_dtype(short: str) -> str:
    """Inverse of :func:`short_dtype`."""
    return _LONG.get(short, short)


@dataclass(frozen=True, slots=True)
class SymDim:
    """A symbolic dimension such as the batch ``b``, with an optional upper bound.

    ``expr`` is JAX's text of a dim computed from symbols (``min(b, 10)``) whose ``name``
    had to be made an identifier (``min_b_10_``); it is for messages only (not compared,
    not printed)."""

    name: str
    bound: int | None = None
    expr: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise IRTypeError(f"symbolic dimension name {self.name!r} is not an identifier")
        if self.bound is not None and self.bound < 0:
            raise IRTypeError(f"symbolic dimension {self.name} has negative bound {self.bound}")

    def __str__(self) -> str:
        return self.name if self.bound is None else f"{self.name}<={self.bound}"


Dim = int | SymDim


class Replica(enum.Enum):
    """Whether a value differs between replicas (``varying``) or is identical on all (``mirrored``)."""

    VARYING = "varying"
    MIRRORED = "mirrored"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Sharding:
    """A sharding over a replica's K logical devices, printed in XLA's HLO notation.

    kind: ``"replicated"`` | ``"maximal"`` (all on ``device``) | ``"tiled"`` (split by
    ``tile_dims`` over ``devices`` in tile order; with ``last_tile_dim_replicate`` the last
    tile dim replicates instead of splitting).
    """

    kind: str
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    device: int | None = None
    last_tile_dim_replicate: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("replicated", "maximal", "tiled"):
            raise IRTypeError(f"unknown sharding kind {self.kind!r}")
        if self.kind == "maximal" and (self.device is None or self.device < 0):
            raise IRTypeError(f"maximal sharding needs a device id >= 0, got {self.device}")
        if self.kind == "tiled":
            n = 1
            for d in self.tile_dims:
                if d <= 0:
                    raise IRTypeError(f"tile dims must be positive, got {self.tile_dims}")
                n *= d
            if n != len(self.devices):
                raise IRTypeError(
                    f"tiled sharding: product of tile dims {self.tile_dims} is {n} but "
                    f"{len(self.devices)} devices are listed")

    @staticmethod
    def replicated() -> Sharding:
        """The replicated sharding: one object (shardings are immutable)."""
        return _REPLICATED

    @staticmethod
    def maximal(device: int) -> Sharding:
        return Sharding("maximal", device=device)

    def __str__(self) -> str:
        if self.kind == "replicated":
            return "{replicated}"
        if self.kind == "maximal":
            return f"{{maximal device={self.device}}}"
        dims = ",".join(map(str, self.tile_dims))
        devs = ",".join(map(str, self.devices))
        suffix = " last_tile_dim_replicate" if self.last_tile_dim_replicate else ""
        return f"{{devices=[{dims}]{devs}{suffix}}}"


_REPLICATED = Sharding("replicated")


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of an IR value: shape, dtype name, replica variance and sharding.

    ``replica`` is ``None`` until the ``replication`` pass decides it; ``sharding`` is
    ``None`` until the ``sharding`` pass assigns one.
    """

    shape: tuple[Dim, ...]
    dtype: str
    replica: Replica | None = None
    sharding: Sharding | None = None
    weak_type: bool = field(default=False, compare=True)
    #: the types :meth:`_derived` made from this one with no sharding or the replicated
    #: one, by replica: one object each (passes retype every value)
    _variants: dict | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple):
            object.__setattr__(self, "shape", tuple(self.shape))
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, (int, SymDim)):
                raise IRTypeError(f"shape entry {d!r} is neither an int nor a SymDim")
            if isinstance(d, int) and d < 0:
                raise IRTypeError(f"shape {self.shape} has a negative dimension")
        if self.dtype not in _KNOWN_DTYPES and not _known_dtype(self.dtype):
            raise IRTypeError(f"unknown dtype {short_dtype(self.dtype)!r}; known: "
                              f"{', '.join(sorted(_LONG))}, key<impl>, ...")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def with_replica(self, replica: Replica | None) -> TensorType:
        if replica is not None and not isinstance(replica, Replica):
            raise IRTypeError(f"replica must be a Replica or None, got {replica!r}")
        return self._derived(replica, self.sharding)

    def with_sharding(self, sharding: Sharding | None) -> TensorType:
        if sharding is not None and not isinstance(sharding, Sharding):
            raise IRTypeError(f"sharding must be a Sharding or None, got {sharding!r}")
        return self._derived(self.replica, sharding)

    def _derived(self, replica: Replica | None, sharding: Sharding | None) -> TensorType:
        """This type with another replica variance or sharding, without re-checking the
        shape and dtype ``__post_init__`` checked (passes retype every value). With no
        sharding or :meth:`Sharding.replicated`, the same object each time (kept on this
        type: at most six), so the types of a graph are a few objects however many
        values it has; other shardings are made per value, and a long-lived type (the
        import's, shared by every program) must not keep one entry per such object."""
        if sharding is None or sharding is _REPLICATED:
            variants = self._variants
            if variants is None:
                variants = {}
                _set(self, "_variants", variants)
            key = (id(replica), sharding is None)  # replicas: enum members, never freed
            t = variants.get(key)
            if t is None:
                t = variants[key] = self._make(replica, sharding)
            return t
        return self._make(replica, sharding)

    def _make(self, replica: Replica | None, sharding: Sharding | None) -> TensorType:
        t = _new(TensorType)
        _set(t, "shape", self.shape)
        _set(t, "dtype", self.dtype)
        _set(t, "replica", replica)
        _set(t, "sharding", sharding)
        _set(t, "weak_type", self.weak_type)
        _set(t, "_variants", None)
        return t

    def same_shape_dtype(self, other: TensorType) -> bool:
        return self.shape == other.shape and self.dtype == other.dtype

    def __str__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        s = f"{short_dtype(self.dtype)}[{dims}]"
        if self.weak_type:
            s += "~"
        if self.replica is not None:
            s += f" {self.replica}"
        if self.sharding is not None:
            s += f" {self.sharding}"
        return s
