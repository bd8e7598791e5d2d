"""Read what XLA did: the collectives in partitioned, optimized HLO text.

The input is the text of ``jax.jit(f).lower(...).compile().as_text()`` (what
``compiled.as_text()`` returns in this project too). :func:`collectives` lists every
cross-device collective in it, with its size per device, its device groups expanded to
explicit ids, and the user's source line when the HLO metadata carries one::

    report = collectives(compiled.as_text())
    print(summarize(report))

The parser is a set of regexes over instruction lines, written for the forms that XLA
prints (seen with jax 0.10.2's XLA, and older ones):

- instruction names with or without a leading ``%``;
- ``replica_groups`` as explicit lists ``{{0,1},{2,3}}``, as iota lists
  ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, or as mesh axes
  ``mesh['x'=2,'y'=4], device_ids=([2,4]T(1,0)) {'y'}`` (sub-axes ``'y':(1)2`` too);
- source locations either inline (``source_file="..." source_line=14``) or, as jax 0.10
  prints them, through ``stack_frame_id=N`` and the module's ``FileNames`` /
  ``FileLocations`` / ``StackFrames`` tables;
- async pairs (``all-reduce-start`` / ``all-reduce-done`` ...) counted once, under the
  base kind, with the result type of the ``-done`` (the ``-start`` result also holds
  the operand buffers).

Nothing here imports JAX: the module reads text only.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable

from ir.errors import IRError

__all__ = ["Collective", "HloReportError", "KINDS", "collectives", "summarize", "to_json",
           "parse_replica_groups", "shape_bytes", "while_bodies"]

#: The collective kinds reported, by their HLO opcode.
KINDS: tuple[str, ...] = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                          "collective-permute", "ragged-all-to-all")

# Bytes per element of XLA's primitive types. 4-bit types count half a byte and the
# total is rounded up; tokens carry no data.
_DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
    "token": 0,
}


class HloReportError(IRError, ValueError):
    """HLO text could not be read; the message quotes the instruction."""


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective instruction of the compiled program.

    kind: the base opcode, one of :data:`KINDS` (an async ``-start``/``-done`` pair is
    one ``Collective`` with ``is_async=True``).
    name: the HLO instruction name without ``%`` (the ``-start`` one for async pairs).
    shape: the HLO result type text without layouts, e.g. ``f32[8,16]`` or
    ``(f32[2,16], f32[2,16])``.
    bytes: result bytes per device, summed over tuple elements.
    replica_groups: the device groups, explicit; ``()`` where HLO gives ``{}`` (meaning
    every participant) or none; ``()`` for collective-permute, which uses ``pairs``.
    pairs: collective-permute's ``source_target_pairs``; ``()`` for other kinds.
    op_name, source_file, source_line: from the instruction's metadata, else ``None``.
    computation: the HLO computation holding the instruction.
    trips: how many times it runs per call of the program: 1 outside loops, the known trip
    counts of the ``while`` loops around it multiplied, ``None`` when one is not known.
    """

    kind: str
    name: str
    shape: str
    bytes: int
    replica_groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    op_name: str | None
    source_file: str | None
    source_line: int | None
    computation: str
    is_async: bool = False
    trips: int | None = 1

    @property
    def step_bytes(self) -> int | None:
        """Bytes per device per call of the program (:attr:`bytes` times :attr:`trips`),
        ``None`` when a loop's trip count is not known."""
        return None if self.trips is None else self.bytes * self.trips

    @property
    def group_size(self) -> int:
        """Devices per group (0 where the groups are not listed)."""
        return len(self.replica_groups[0]) if self.replica_groups else 0

    @property
    def ir_sources(self) -> tuple[tuple[str, str, int], ...]:
        """(IR op, file, line) of the IR ops this collective came from, read from the
        ``op[file:line]`` name scopes ``compiler.lower`` puts on every op (several when
        XLA merged collectives); ``()`` for HLO not lowered from our IR."""
        if not self.op_name:
            return ()
        seen: dict[tuple[str, str, int], None] = {}
        for op, file, line in _IR_SCOPE_RE.findall(self.op_name):
            seen[(op, file, int(line))] = None
        return tuple(seen)

    @property
    def source(self) -> str:
        """``file:line`` of the user's code that caused it (IR scopes first, then HLO
        stack frames), ``-`` when unknown."""
        if self.ir_sources:
            return ", ".join(f"{f}:{ln}" for _, f, ln in self.ir_sources)
        if self.source_file:
            return f"{os.path.basename(self.source_file)}:{self.source_line}"
        return "-"


def ir_scope(op: str, file: str, line: int) -> str:
    """The name scope an IR op lowers under, ``op[file:line]`` (``compiler.lower``); XLA
    keeps it in ``op_name`` metadata and ``Collective.ir_sources`` reads it back with
    ``_IR_SCOPE_RE``. Not ``@``: XLA cuts ``op_name`` there."""
    return f"{op}[{os.path.basename(file)}:{line}]"


_IR_SCOPE_RE = re.compile(r"([A-Za-z_]\w*)\[([^\[\]:/]+):(\d+)\]")


# ----------------------------------------------------------------------------- lexing

_COMPUTATION_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR_HEAD_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}")
_ARRAY_RE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPERAND_NAME_RE = re.compile(r"%?(?P<name>[\w.\-]+)\s*$")
_OP_NAME_RE = re.compile(r'op_name="(?P<v>(?:[^"\\]|\\.)*)"')
_SOURCE_FILE_RE = re.compile(r'source_file="(?P<v>(?:[^"\\]|\\.)*)"')
_SOURCE_LINE_RE = re.compile(r"source_line=(?P<v>\d+)")
_STACK_FRAME_RE = re.compile(r"stack_frame_id=(?P<v>\d+)")
_TABLE_ROW_RE = re.compile(r"^\s*(?P<id>\d+)\s+(?P<rest>.*)$")
_GROUPS_EXPLICIT_RE = re.compile(r"\{(?:\s*\{[\d,\s]*\}\s*,?)*\s*\}")
_IOTA_RE = re.compile(
    r"\[(?P<dims>[\d,\s]+)\]<=\[(?P<reshape>[\d,\s]+)\](?:T\((?P<perm>[\d,\s]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?[^)]*)\))?\s*"
    r"\{(?P<group_axes>[^}]*)\}")
_MESH_AXIS_RE = re.compile(r"""['"]?(?P<name>[^'"=,\s]+)['"]?\s*=\s*(?P<size>\d+)""")
_GROUP_AXIS_RE = re.compile(
    r"""['"]?(?P<name>[^'":,\s]+)['"]?(?::\((?P<pre>\d+)\)(?P<size>\d+))?""")


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes ``text[start]`` (one of ``( [ {``)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    in_string = False
    i = start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise HloReportError(f"unbalanced {text[start]!r} in HLO text: {text[start:start + 80]!r}")


@dataclass(frozen=True, slots=True)
class _Instr:
    name: str
    shape: str        # result type text, layouts removed
    opcode: str
    operands: str
    attrs: str
    line: str


def _parse_instruction(line: str) -> _Instr | None:
    """Split one HLO instruction line; ``None`` for lines that are not instructions."""
    head = _INSTR_HEAD_RE.match(line)
    if head is None:
        return None
    pos = head.end()
    # The result type: a tuple ``(...)`` (nested, with layouts) or one array type
    # ``f32[8,16]{1,0}`` whose layout braces may hold tiling such as ``{1,0:T(8,128)}``.
    if pos < len(line) and line[pos] == "(":
        end = _matching(line, pos)
    else:
        m = re.match(r"[a-z][a-z0-9]*\[[^\]]*\]", line[pos:])
        if m is None:
            return None
        end = pos + m.end()
        if end < len(line) and line[end] == "{":
            end = _matching(line, end)
    shape_text = line[pos:end]
    op = _OPCODE_RE.match(line, end)
    if op is None:
        return None
    open_paren = op.end() - 1
    close = _matching(line, open_paren)
    return _Instr(
        name=head.group("name"),
        shape=_strip_layouts(shape_text),
        opcode=op.group("op"),
        operands=line[open_paren + 1:close - 1],
        attrs=line[close:],
        line=line,
    )


def _strip_layouts(shape_text: str) -> str:
    """``(f32[2,16]{1,0}, /*index=5*/s32[]{:T(128)})`` -> ``(f32[2,16], s32[])``."""
    text = re.sub(r"/\*.*?\*/", "", shape_text)
    prev = None
    while prev != text:  # innermost braces first, in case a layout ever nests them
        prev, text = text, _LAYOUT_RE.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO type text: element count × element size, summed over a tuple.

    ``shape_bytes("f32[8,16]") == 512``; ``shape_bytes("(bf16[4], s32[])") == 12``.
    A bounded dynamic dim ``<=8`` counts as its bound.
    """
    total = 0.0
    for m in _ARRAY_RE.finditer(_strip_layouts(shape)):
        dtype = m.group("dtype")
        if dtype not in _DTYPE_BYTES:
            raise HloReportError(f"unknown HLO element type {dtype!r} in {shape!r}")
        count = 1
        for d in filter(None, (s.strip() for s in m.group("dims").split(","))):
            count *= int(d.lstrip("<=").lstrip("?") or 0)
        total += count * _DTYPE_BYTES[dtype]
    return math.ceil(total)


# ------------------------------------------------------------------ replica groups

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.replace(" ", "").split(",") if t)


def _iota(dims: tuple[int, ...], reshape: tuple[int, ...], perm: tuple[int, ...] | None
          ) -> list[int]:
    """XLA's iota tile assignment, flattened: iota(prod(reshape)) reshaped to
    ``reshape``, transposed by ``perm``, read in row-major order (then viewed as
    ``dims``, which does not change the order)."""
    n = math.prod(reshape)
    if math.prod(dims) != n:
        raise HloReportError(f"iota list {list(dims)}<={list(reshape)}: sizes differ")
    perm = perm if perm is not None else tuple(range(len(reshape)))
    return _transpose(list(range(n)), reshape, perm)


def _transpose(flat: list[int], dims: tuple[int, ...], perm: tuple[int, ...]) -> list[int]:
    """Row-major ``flat`` viewed as ``dims``, transposed by ``perm``, flattened again."""
    if sorted(perm) != list(range(len(dims))):
        raise HloReportError(f"bad transpose permutation {perm} for dims {dims}")
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    out_dims = [dims[p] for p in perm]
    out: list[int] = []
    for linear in range(len(flat)):
        src, rem = 0, linear
        for axis in range(len(out_dims) - 1, -1, -1):
            idx = rem % out_dims[axis]
            rem //= out_dims[axis]
            src += idx * strides[perm[axis]]
        out.append(flat[src])
    return out


def _chunk(flat: list[int], size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(flat[i:i + size]) for i in range(0, len(flat), size))


def _mesh_groups(m: re.Match[str]) -> tuple[tuple[int, ...], ...]:
    """Expand ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` to explicit groups.

    Follows XLA's MeshAxesReplicaGroupList: split each mesh axis that a sub-axis
    ``name:(pre)size`` refers to into (pre, size, rest) pieces, move the grouped pieces
    last (in the listed order), and cut the device array into groups.
    """
    axes = [(a.group("name"), int(a.group("size")))
            for a in _MESH_AXIS_RE.finditer(m.group("axes"))]
    sizes = tuple(s for _, s in axes)
    n = math.prod(sizes)
    ids_text = (m.group("ids") or "").strip()
    if not ids_text:
        devices = list(range(n))
    elif (it := re.fullmatch(r"\[(?P<r>[\d,\s]+)\](?:T\((?P<p>[\d,\s]+)\))?", ids_text)):
        perm = _ints(it.group("p")) if it.group("p") else None
        devices = _iota(sizes, _ints(it.group("r")), perm)
    else:
        devices = list(_ints(ids_text.strip("[]")))
    if len(devices) != n:
        raise HloReportError(f"mesh {m.group(0)!r} lists {len(devices)} devices, expected {n}")
    index = {name: i for i, (name, _) in enumerate(axes)}
    refs: list[tuple[int, int, int]] = []  # (mesh axis, pre_size, size)
    for g in _GROUP_AXIS_RE.finditer(m.group("group_axes")):
        if g.group("name") not in index:
            raise HloReportError(f"replica groups name unknown mesh axis {g.group('name')!r} "
                                 f"in {m.group(0)!r}")
        ax = index[g.group("name")]
        if g.group("pre"):
            refs.append((ax, int(g.group("pre")), int(g.group("size"))))
        else:
            refs.append((ax, 1, sizes[ax]))
    # Split each referenced axis at its sub-axis boundaries. ``pre_size`` is the product
    # of the *major* pieces before a sub-axis (Shardy's ``"x":(pre)size``), so pieces in
    # ascending boundary order are major-first, as a row-major reshape wants.
    dims: list[int] = []
    dim_of: dict[tuple[int, int], int] = {}  # (mesh axis, pre_size) -> reshaped dim
    for ax, full in enumerate(sizes):
        if full == 1:
            dim_of[(ax, 1)] = len(dims)
            dims.append(1)
            continue
        cuts = sorted({1, full} | {p for a, p, _ in refs if a == ax}
                      | {p * s for a, p, s in refs if a == ax})
        for lo, hi in zip(cuts, cuts[1:]):
            dim_of[(ax, lo)] = len(dims)
            dims.append(hi // lo)
    grouped = [dim_of[(a, p)] for a, p, _ in refs]
    perm = tuple([d for d in range(len(dims)) if d not in grouped] + grouped)
    group_size = math.prod(dims[d] for d in grouped) if grouped else 1
    return _chunk(_transpose(devices, tuple(dims), perm), group_size)


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Parse the value of a ``replica_groups=`` attribute to explicit groups.

    Accepts ``{{0,1},{2,3}}``, ``{}`` (returns ``()``: every participant),
    ``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)`` and
    ``mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}``.
    """
    text = text.strip()
    if m := _MESH_RE.match(text):
        return _mesh_groups(m)
    if m := _IOTA_RE.match(text):
        dims = _ints(m.group("dims"))
        if len(dims) != 2:
            raise HloReportError(f"iota replica groups {text!r} should have 2 dims")
        flat = _iota(dims, _ints(m.group("reshape")),
                     _ints(m.group("perm")) if m.group("perm") else None)
        return _chunk(flat, dims[1])
    if text.startswith("{"):
        body = text[1:_matching(text, 0) - 1]
        return tuple(_ints(g) for g in re.findall(r"\{([^{}]*)\}", body))
    raise HloReportError(f"unrecognised replica_groups form {text!r}")


def _replica_groups_attr(attrs: str) -> str | None:
    """The text of the ``replica_groups=`` value in an attribute list, or ``None``."""
    m = re.search(r"\breplica_groups=", attrs)
    if m is None:
        return None
    rest = attrs[m.end():]
    if mm := _MESH_RE.match(rest):
        return mm.group(0)
    if mm := _IOTA_RE.match(rest):
        return mm.group(0)
    if rest.startswith("{"):
        return rest[:_matching(rest, 0)]
    raise HloReportError(f"unrecognised replica_groups form in {attrs[:120]!r}")


def _pairs_attr(attrs: str) -> tuple[tuple[int, int], ...]:
    m = re.search(r"\bsource_target_pairs=", attrs)
    if m is None:
        return ()
    rest = attrs[m.end():]
    body = rest[1:_matching(rest, 0) - 1]
    out = []
    for g in re.findall(r"\{([^{}]*)\}", body):
        s, t = _ints(g)
        out.append((s, t))
    return tuple(out)


# ----------------------------------------------------------------- source locations

@dataclass(frozen=True, slots=True)
class _Frames:
    """The module's stack-frame tables (jax >= 0.7 prints these instead of inline
    ``source_file``/``source_line``)."""

    files: dict[int, str]
    locations: dict[int, tuple[int, int]]   # location id -> (file id, line)
    frames: dict[int, int]                  # frame id -> location id

    def resolve(self, frame_id: int) -> tuple[str | None, int | None]:
        loc = self.locations.get(self.frames.get(frame_id, -1))
        if loc is None:
            return None, None
        return self.files.get(loc[0]), loc[1]


def _parse_frames(lines: list[str]) -> _Frames:
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    frames: dict[int, int] = {}
    section = None
    for line in lines:
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = stripped
            continue
        if not stripped:
            continue
        row = _TABLE_ROW_RE.match(line) if section else None
        if row is None:
            section = None
            continue
        rid, rest = int(row.group("id")), row.group("rest")
        if section == "FileNames":
            files[rid] = rest.strip().strip('"')
        elif section == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            ln = re.search(r"\bline=(\d+)", rest)
            if f and ln:
                locations[rid] = (int(f.group(1)), int(ln.group(1)))
        elif section == "StackFrames":
            loc = re.search(r"file_location_id=(\d+)", rest)
            if loc:
                frames[rid] = int(loc.group(1))
    return _Frames(files, locations, frames)


def _metadata(attrs: str, frames: _Frames) -> tuple[str | None, str | None, int | None]:
    m = re.search(r"\bmetadata=\{", attrs)
    if m is None:
        return None, None, None
    start = m.end() - 1
    meta = attrs[start:_matching(attrs, start)]
    op_name = _unescape(g.group("v")) if (g := _OP_NAME_RE.search(meta)) else None
    source_file = _unescape(g.group("v")) if (g := _SOURCE_FILE_RE.search(meta)) else None
    source_line = int(g.group("v")) if (g := _SOURCE_LINE_RE.search(meta)) else None
    if source_file is None and (g := _STACK_FRAME_RE.search(meta)):
        source_file, line = frames.resolve(int(g.group("v")))
        source_line = source_line if source_line is not None else line
    return op_name, source_file, source_line


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", r"\1", s)


# ------------------------------------------------------------------------ public API

def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in HLO module text, in the order the text lists them.

    ``hlo_text`` is ``compiled.as_text()`` (one or several modules). Async
    ``-start``/``-done`` pairs count once, under the base kind, with the ``-done``
    result type; a ``-start`` whose ``-done`` is missing keeps its own result type.
    Raises :class:`HloReportError` on a collective line it cannot read.
    """
    lines = hlo_text.splitlines()
    frames = _parse_frames(lines)
    out: list[Collective] = []
    starts: dict[tuple[str, str], int] = {}  # (computation, start name) -> index in out
    computation = ""
    for line in lines:
        if (c := _COMPUTATION_RE.match(line)) and "=" not in line.split("(")[0]:
            computation = c.group("name")
            continue
        instr = _parse_instruction(line)
        if instr is None:
            continue
        op = instr.opcode
        if op.endswith("-done") and op[:-len("-done")] in KINDS:
            operand = _OPERAND_NAME_RE.search(instr.operands.split(",")[0].strip().split(" ")[-1])
            key = (computation, operand.group("name")) if operand else None
            if key in starts:
                i = starts.pop(key)
                out[i] = replace(out[i], shape=instr.shape, bytes=shape_bytes(instr.shape))
            continue
        is_start = op.endswith("-start") and op[:-len("-start")] in KINDS
        kind = op[:-len("-start")] if is_start else op
        if kind not in KINDS:
            continue
        try:
            rg_text = _replica_groups_attr(instr.attrs)
            groups = parse_replica_groups(rg_text) if rg_text is not None else ()
            pairs = _pairs_attr(instr.attrs) if kind == "collective-permute" else ()
            op_name, source_file, source_line = _metadata(instr.attrs, frames)
            nbytes = shape_bytes(instr.shape)
        except HloReportError as e:
            raise HloReportError(f"{e} (instruction {instr.name} in {computation or '?'})") from e
        out.append(Collective(
            kind=kind, name=instr.name, shape=instr.shape, bytes=nbytes,
            replica_groups=groups, pairs=pairs, op_name=op_name,
            source_file=source_file, source_line=source_line,
            computation=computation, is_async=is_start))
        if is_start:
            starts[(computation, instr.name)] = len(out) - 1
    trips = _trips(lines)
    return [c if trips.get(c.computation, 1) == 1 else replace(c, trips=trips[c.computation])
            for c in out]


_WHILE_RE = re.compile(r"\bwhile\(.*?\bbody=%?(?P<body>[\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


#: attributes naming the computations an instruction calls once per run of it
_CALLED_RE = re.compile(r"\b(?:to_apply|true_computation|false_computation|calls)=%?"
                        r"(?P<name>[\w.\-]+)")
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")


def _trips(lines: list[str]) -> dict[str, int | None]:
    """Per computation run in a ``while`` loop: how many times it runs per call (the
    known trip counts of the loops around it multiplied; ``None`` when one is unknown).
    A loop's body runs its trip count per run of the computation holding the loop; a
    ``conditional``'s branches and a ``call``'s computation at most once per run of
    theirs (a collective in a ``cond`` branch inside a ``scan`` ran in every iteration,
    and was counted once; found by a probe)."""
    # computation -> (computation holding the instruction that runs it, runs per run)
    own: dict[str, tuple[str, int | None]] = {}
    computation = ""
    for line in lines:
        if (c := _COMPUTATION_RE.match(line)) and "=" not in line.split("(")[0]:
            computation = c.group("name")
            continue
        if (w := _WHILE_RE.search(line)) and " while(" in line:
            n = _TRIP_RE.search(line)
            own[w.group("body")] = (computation, int(n.group("n")) if n else None)
            continue
        for m in _CALLED_RE.finditer(line):
            own.setdefault(m.group("name"), (computation, 1))
        if (b := _BRANCHES_RE.search(line)):
            for name in b.group("names").split(","):
                own.setdefault(name.strip().lstrip("%"), (computation, 1))

    def total(name: str, depth: int = 0) -> int | None:
        parent, n = own[name]
        outer = total(parent, depth + 1) if parent in own and depth < 64 else 1
        return None if n is None or outer is None else n * outer
    return {name: total(name) for name in own}


_WHILE_BODY_RE = re.compile(r"\bwhile\(.*?\bbody=%?(?P<name>[\w.\-]+)")


def while_bodies(hlo_text: str) -> frozenset[str]:
    """The names of the computations that are a ``while`` loop's body in HLO module text:
    a collective whose :attr:`Collective.computation` is one of them runs once per
    iteration (e.g. a gradient all-reduce left in every step of a backward loop)."""
    return frozenset(m.group("name") for m in _WHILE_BODY_RE.finditer(hlo_text))


def _groups_text(c: Collective, limit: int = 48) -> str:
    if c.kind == "collective-permute":
        text = ",".join(f"{s}->{t}" for s, t in c.pairs)
    elif not c.replica_groups:
        text = "{} (all)"
    else:
        text = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in c.replica_groups) + "}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def summarize(report: Iterable[Collective]) -> str:
    """An aligned text table of collectives: kind, bytes, groups, source, op_name.

    ``source`` is the file's base name and line (``model.py:14``), ``-`` when unknown;
    async collectives are marked ``(async)``; a last line gives the count and total bytes.
    """
    rows = [("kind", "bytes", "groups", "source", "op_name")]
    total, unknown = 0, 0
    items = list(report)
    for c in items:
        total += c.step_bytes or 0
        unknown += c.trips is None
        src = c.source
        runs = "" if c.trips == 1 else (" x ?" if c.trips is None else f" x {c.trips}")
        rows.append((c.kind + (" (async)" if c.is_async else ""), f"{c.bytes}{runs}",
                     _groups_text(c), src, c.op_name or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].rjust(widths[1]),
                 r[2].ljust(widths[2]), r[3].ljust(widths[3]), r[4]]
        lines.append("  ".join(cells).rstrip())
    loops = f" ({unknown} in loops of unknown trip count left out)" if unknown else ""
    lines.append(f"{len(items)} collective(s), {total} bytes per device per call{loops}"
                 + ("; x N: in a loop that runs N times" if any(c.trips != 1 for c in items)
                    else ""))
    return "\n".join(lines)


def to_json(report: Iterable[Collective]) -> list[dict[str, Any]]:
    """Collectives as JSON-ready dicts (tuples become lists), one per collective."""
    return [
        {
            "kind": c.kind, "name": c.name, "shape": c.shape, "bytes": c.bytes,
            "trips": c.trips, "step_bytes": c.step_bytes,
            "replica_groups": [list(g) for g in c.replica_groups],
            "pairs": [list(p) for p in c.pairs],
            "op_name": c.op_name, "source_file": c.source_file,
            "source_line": c.source_line, "computation": c.computation,
            "is_async": c.is_async, "source": c.source,
            "ir_ops": [{"op": op, "file": f, "line": ln} for op, f, ln in c.ir_sources],
        }
        for c in report
    ]
