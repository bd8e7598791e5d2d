"""Shared by the command-line tools: virtual devices before JAX starts, loading
``FILE.py:NAME``, compiling a step for N × K devices, reading IR dump folders.

Nothing here imports JAX at module level: :func:`ensure_devices` must run first, because
XLA reads ``--xla_force_host_platform_device_count`` once, when its CPU backend starts.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect as _inspect
import os
import re
import subprocess
import sys
from typing import Any

_REEXEC_ENV = "_RT_TOOLS_REEXEC"
_COUNT_RE = re.compile(r"--xla_force_host_platform_device_count=\S+")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ToolError(Exception):
    """A user error a tool reports in one line and exits 2 on."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with errors in one line (``prog: error: ... (see --help)``) and exit
    status 2, like every other user error of the tools."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_debug_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true",
                   help="on an error, print the whole traceback instead of one line")


def run_tool(prog: str, body: Any, debug: bool) -> int:
    """Run ``body()`` (returns the exit status) and report any error as one line
    ``<prog>: error: ...`` on stderr with status 2: a :class:`ToolError` as it is, any
    other exception (from the user's code or ours) with its type; ``--debug`` re-raises,
    so Python prints the traceback. ``KeyboardInterrupt`` is status 130."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - every error becomes one line
        if debug:
            raise
        if isinstance(e, ToolError):
            msg = str(e)
        else:
            first = (str(e).strip().splitlines() or [""])[0]
            msg = f"{type(e).__name__}: {first}" + (" ..." if "\n" in str(e).strip() else "")
        print(f"{prog}: error: {msg} (--debug shows the traceback)"
              if not isinstance(e, ToolError) else f"{prog}: error: {msg}", file=sys.stderr)
        return 2


def writable_dir(path: str, option: str) -> str:
    """``path`` created if missing; a :class:`ToolError` when it cannot be written."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ToolError(f"{option} {path}: cannot create it ({e.strerror})") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ToolError(f"{option} {path}: not a writable folder")
    return path


def xla_flags_with_devices(flags: str, n: int) -> str:
    """``flags`` with its device-count flag replaced by ``n`` (added when absent)."""
    flags = _COUNT_RE.sub("", flags or "").strip()
    return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def ensure_devices(n: int, module: str, argv: list[str], platform: str = "cpu") -> None:
    """Make sure JAX sees at least ``n`` devices on ``platform`` (virtual CPU devices).

    Before JAX is imported: set ``XLA_FLAGS`` and ``JAX_PLATFORMS`` and import it. When
    JAX was already started with too few devices (a tool called from a Python process):
    re-run ``python -m <module> <argv>`` in a subprocess with the right environment and
    exit with its status."""
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), n)
        os.environ["JAX_PLATFORMS"] = platform
    import jax
    try:
        have = len(jax.devices(platform))
    except RuntimeError:
        have = 0
    if have >= n:
        return
    if os.environ.get(_REEXEC_ENV):
        raise ToolError(f"{n} {platform} devices needed but JAX sees {have} even after "
                        f"setting XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags_with_devices(env.get("XLA_FLAGS", ""), n)
    env["JAX_PLATFORMS"] = platform
    env[_REEXEC_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
    sys.stdout.flush()
    sys.stderr.flush()
    rc = subprocess.call([sys.executable, "-m", module, *argv], env=env)
    raise SystemExit(rc)


def load_object(spec: str, what: str = "FUNCTION") -> Any:
    """The object named by ``FILE.py:NAME`` (``NAME`` may be dotted: ``FILE.py:obj.attr``).
    The file is imported as a module named after its stem, with its folder and the
    project root on ``sys.path``."""
    if ":" not in spec:
        raise ToolError(f"expected FILE.py:{what}, got {spec!r}")
    path, name = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ToolError(f"{path}: no such file (from {spec!r})")
    path = os.path.abspath(path)
    for p in (_ROOT, os.path.dirname(path)):
        if p not in sys.path:
            sys.path.insert(0, p)
    stem = os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(stem)
    if mod is None or os.path.abspath(getattr(mod, "__file__", "") or "") != path:
        s = importlib.util.spec_from_file_location(stem, path)
        mod = importlib.util.module_from_spec(s)
        sys.modules[stem] = mod
        s.loader.exec_module(mod)
    obj: Any = mod
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ToolError(f"{path} has no {what.lower()} {name!r}")
        obj = getattr(obj, part)
    return obj


def call_make_args(make_args: Any, num_replicas: int, logical_devices: int) -> tuple:
    """``make_args()`` with the keywords it accepts among ``num_replicas`` and
    ``logical_devices``; a non-tuple result is one argument. A ``make_args`` that cannot be
    called so, or that gives per-replica values for another replica count, is a
    :class:`ToolError`."""
    if not callable(make_args):
        raise ToolError(f"--args: {make_args!r} is a {type(make_args).__name__}, not a function")
    try:
        params = _inspect.signature(make_args).parameters
    except (TypeError, ValueError):
        params = {}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in (("num_replicas", num_replicas), ("logical_devices", logical_devices))
          if var_kw or k in params}
    required = [n for n, p in params.items() if p.default is p.empty and n not in kw
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ToolError(f"--args: {getattr(make_args, '__name__', make_args)}() requires "
                        f"{', '.join(required)}; it is called with no arguments, or with "
                        f"num_replicas= and logical_devices= when it accepts them")
    args = make_args(**kw)
    args = args if isinstance(args, tuple) else (args,)
    from runtime.per_replica import PerReplica
    import jax
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            args, is_leaf=lambda x: isinstance(x, PerReplica))[0]:
        if isinstance(leaf, PerReplica) and len(leaf) != num_replicas:
            raise ToolError(f"--args: {getattr(make_args, '__name__', 'make_args')}() gave "
                            f"args{jax.tree_util.keystr(path)} as a PerReplica of {len(leaf)} "
                            f"values but --replicas is {num_replicas} (use its num_replicas "
                            f"argument)")
    return args


def add_compile_options(p: argparse.ArgumentParser) -> None:
    """The options every command that compiles ``FILE.py:FUNCTION`` takes."""
    p.add_argument("--args", metavar="FILE.py:MAKE_ARGS",
                   help="a function returning the step's positional arguments as pytrees of "
                        "jax.ShapeDtypeStruct (rt.PerReplica of them for per-replica inputs); "
                        "it is given num_replicas= and logical_devices= when it accepts them")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="number of replicas N (default: 1; with --target tpu:..., every device "
                        "of the topology over K)")
    p.add_argument("--logical-devices", type=int, default=1, metavar="K",
                   help="logical devices per replica K (default: 1); the tool compiles for "
                        "N*K virtual CPU devices however many the machine has")
    p.add_argument("--target", dest="compile_target", default="cpu", metavar="TARGET",
                   help="what to compile for: cpu (default: N*K virtual CPU devices) or "
                        "tpu:GENERATION:TOPOLOGY, e.g. tpu:v5e:4x4 or tpu:v5p:4x4x4, with the "
                        "real TPU compiler (libtpu, the 'tpu' extra) and no TPU: report.json "
                        "then holds the memory fit against the chip's HBM and a roofline "
                        "estimate")
    p.add_argument("--dynamic", metavar="BUCKETING", default=None, choices=("pow2", "auto"),
                   help="dynamic shapes: axis 0 of every per-replica input is dynamic, and the "
                        "step is compiled for the bucket its size falls in (pow2 or auto); "
                        "report.json then gives the padding overhead")
    p.add_argument("-p", "--pipeline", default=None, metavar="PIPELINE",
                   help="comma-separated passes (default: the runtime's, "
                        "replication,hoist-collectives,cross-replica-sum,sharding,dce)")
    p.add_argument("--loss-reduction", choices=("mean", "sum"), default="mean",
                   help="how gradients of mirrored inputs are reduced (default: mean)")
    p.add_argument("--platform", default="cpu",
                   help="JAX platform to compile for (default: cpu, where N*K virtual "
                        "devices are made)")


_TPU_TARGET = re.compile(r"^tpu:([A-Za-z0-9]+:\d+(?:x\d+)*)$")


def tpu_topology(ns: argparse.Namespace) -> str | None:
    """``"v5e:4x4"`` for ``--target tpu:v5e:4x4``, ``None`` for ``--target cpu``."""
    m = _TPU_TARGET.match(ns.compile_target)
    return m.group(1) if m else None


def check_compile_options(ns: argparse.Namespace) -> None:
    if ns.compile_target != "cpu" and tpu_topology(ns) is None:
        raise ToolError(f"--target {ns.compile_target}: expected cpu or tpu:GENERATION:TOPOLOGY "
                        f"(e.g. tpu:v5e:4x4, tpu:v5p:4x4x4)")
    if ns.replicas is None and tpu_topology(ns) is None:
        ns.replicas = 1
    if (ns.replicas is not None and ns.replicas < 1) or ns.logical_devices < 1:
        raise ToolError(f"--replicas and --logical-devices must be positive, got "
                        f"{ns.replicas} and {ns.logical_devices}")
    if not ns.args:
        raise ToolError("--args FILE.py:MAKE_ARGS is required to compile FILE.py:FUNCTION")


def ensure_target(ns: argparse.Namespace, module: str, argv: list[str]) -> None:
    """Set up what ``--target`` needs before JAX starts: N*K virtual CPU devices, or for a
    TPU topology an environment in which libtpu asks no metadata server (the TPU devices
    are compile-only and need no count)."""
    if tpu_topology(ns) is None:
        ensure_devices(ns.replicas * ns.logical_devices, module, argv, ns.platform)
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def target_devices(ns: argparse.Namespace) -> list:
    """The devices ``--target`` names, ``ns.replicas`` resolved (a TPU topology's default:
    all its devices over K); a :class:`ToolError` when N*K exceeds them."""
    import jax
    topo = tpu_topology(ns)
    if topo is None:
        devices = jax.devices(ns.platform)
    else:
        from runtime.tpu import tpu_devices
        devices = tpu_devices(topo)
        if ns.replicas is None:
            if len(devices) % ns.logical_devices:
                raise ToolError(f"--logical-devices {ns.logical_devices} does not divide the "
                                f"{len(devices)} devices of {topo}")
            ns.replicas = len(devices) // ns.logical_devices
    need = ns.replicas * ns.logical_devices
    if need > len(devices):
        raise ToolError(f"--replicas {ns.replicas} x --logical-devices {ns.logical_devices} "
                        f"need {need} devices but {ns.compile_target} has {len(devices)}")
    return list(devices[:need])


def lower_step(ns: argparse.Namespace, target: str) -> tuple[Any, Any, list[str]]:
    """Load ``target`` and ``ns.args``, lower it for ``ns.replicas`` × ``ns.logical_devices``;
    return ``(step, lowered, input_paths)``. Devices must be set up already."""
    import jax

    import runtime as rt
    from runtime.per_replica import PerReplica

    fn = load_object(target, "FUNCTION")
    if isinstance(fn, rt.Replicated):
        fn = fn.fn
    if not callable(fn):
        raise ToolError(f"{target} is a {type(fn).__name__} ({repr(fn)[:40]}), not a function")
    make_args = load_object(ns.args, "MAKE_ARGS")
    devices = target_devices(ns)
    args = call_make_args(make_args, ns.replicas, ns.logical_devices)
    opts = {} if ns.pipeline is None else {"pipeline": ns.pipeline}
    if getattr(ns, "dynamic", None):
        # The dynamic path plans buckets from real sizes: give it zero arrays of the
        # requested shapes (those shapes are the real sizes).
        import numpy as np
        from runtime.dynamic import make_bucketer

        opts.update(dynamic_shapes=True, bucketing=ns.dynamic)
        def zeros(tree: Any) -> Any:
            return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype)
                                if isinstance(a, jax.ShapeDtypeStruct) else a, tree)
        args = jax.tree.map(lambda a: PerReplica([zeros(v) for v in a.values])
                            if isinstance(a, PerReplica) else zeros(a), args,
                            is_leaf=lambda a: isinstance(a, PerReplica))
        # (the runtime's bucketer: rounded to a multiple of the logical devices)
        ns.padding_overhead = _padding_overhead(
            args, make_bucketer(ns.dynamic, ns.logical_devices), ns.dynamic)
    step = rt.replicate(fn, num_replicas=ns.replicas, logical_devices=ns.logical_devices,
                        devices=devices, loss_reduction=ns.loss_reduction,
                        options=rt.RunOptions(**opts))
    is_pr = lambda x: isinstance(x, PerReplica)  # noqa: E731
    paths = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(args, is_leaf=is_pr)[0]:
        base = "args" + jax.tree_util.keystr(path)
        if is_pr(leaf):
            paths += [f"{base}.per_replica{jax.tree_util.keystr(p)}"
                      for p, _ in jax.tree_util.tree_flatten_with_path(leaf.values[0])[0]]
        else:
            paths.append(base)
    return step, step.lower(*args), paths


def output_paths(program: Any) -> list[str]:
    import jax
    td = program.out_treedef
    tree = jax.tree_util.tree_unflatten(td, list(range(td.num_leaves)))
    return ["out" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


_PASS_FILE_RE = re.compile(r"^(\d+)-(.+)\.txt$")


def read_ir_dir(folder: str) -> list[tuple[str, float, str]]:
    """``(pass, seconds, IR text)`` per ``NN-<pass>.txt`` in ``folder`` or ``folder/ir``,
    in order."""
    d = os.path.join(folder, "ir") if os.path.isdir(os.path.join(folder, "ir")) else folder
    if not os.path.isdir(d):
        raise ToolError(f"{folder}: not a folder")
    files = sorted((int(m.group(1)), m.group(2), f) for f in os.listdir(d)
                   if (m := _PASS_FILE_RE.match(f)))
    if not files:
        raise ToolError(f"{d}: no NN-<pass>.txt files (expected an inspect output folder or "
                        "an IR dump folder)")
    out = []
    for _, name, f in files:
        with open(os.path.join(d, f)) as fh:
            text = fh.read()
        seconds = 0.0
        body = []
        for line in text.splitlines():
            if line.startswith("//"):
                m = re.search(r"time:\s*([\d.]+)\s*ms", line)
                if m:
                    seconds = float(m.group(1)) / 1e3
                continue
            body.append(line)
        out.append((name, seconds, "\n".join(body).strip("\n")))
    return out


def pick_pass(names: list[str], after: str | None) -> int:
    """Index of the pass named ``after`` (``_`` and ``-`` alike, or its NN number);
    the last when ``after`` is None."""
    if after is None:
        return len(names) - 1
    key = after.replace("_", "-")
    if key in names:
        return names.index(key)
    if key.isdigit() and int(key) < len(names):
        return int(key)
    raise ToolError(f"no pass {after!r}; passes: {', '.join(names)}")


def _padding_overhead(args: tuple, bucket_of: Any, bucketing: str) -> dict:
    """Each replica's real rows on axis 0 (the first leaf of every per-replica input; one
    symbol ``b`` is shared by all of them), the bucket the step compiles for (that of the
    largest replica's rows), and the share of padded rows."""
    import jax

    from runtime.per_replica import PerReplica

    prs = [x for x in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, PerReplica))
           if isinstance(x, PerReplica)]
    if not prs:
        return {"bucketing": bucketing, "real_rows": [], "bucket": None, "padded_fraction": 0.0}
    rows = [int(jax.tree.leaves(value)[0].shape[0]) for value in prs[0].values]
    bucket = bucket_of(max(rows), None)
    return {"bucketing": bucketing, "real_rows": rows, "bucket": bucket,
            "padded_fraction": 1 - sum(rows) / (bucket * len(rows))}
