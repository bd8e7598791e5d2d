"""The persistent cache: compiled steps survive a process restart.

Enabled by ``RunOptions(cache_dir=DIR)`` or ``$RT_CACHE_DIR``. Two layers, both under DIR:

- ``DIR/xla/``: JAX's own persistent compilation cache (``jax_compilation_cache_dir``,
  with ``jax_persistent_cache_min_compile_time_secs=0`` and
  ``jax_persistent_cache_min_entry_size_bytes=0`` so small programs are cached too). It is
  process-wide: the first step with a cache dir sets it. It serves the XLA compile when
  our own record is missing (e.g. after the function's source text changed but the
  program did not).
- ``DIR/rt/<sha256>.rec``: our record of one program, keyed by :func:`digest` over the
  named :func:`key_entries` and, last, ``program``: the fingerprint of the step as traced
  for this call (:func:`program_fingerprint`: its IR and the bytes of every constant). It
  holds the serialized executable (``jax.experimental.serialize_executable``), the IR text
  after every pass, the StableHLO text, and what the runtime needs to call the program
  (input layout, output pytree, which outputs vary per replica). A hit skips the passes,
  lowering and XLA; the step is still traced (JAX's own persistent cache keys by the
  lowered program for the same reason): a key taken before tracing cannot see a value the
  step closes over, and a changed learning rate inside ``optax.sgd(lr)``, or a changed
  array the step reads, ran the old program (``tests/test_persistent_cache.py``).
  Beside it, ``<sha256>.json`` keeps the key entries in clear, and
  ``DIR/rt/last_miss.json`` says which entries differed on the last miss
  (``python -m tools.cache explain DIR``, ``step.cache_explain()``). When the XLA
  compile itself was served by JAX's cache, the record keeps no executable (an
  executable reloaded by JAX cannot be serialized again on CPU): later processes then
  trace, run the passes and lower again, and take the executable from JAX's cache.
  Both kinds of hit count in ``cache_info().disk_hits``.

File format of a record: the line ``RTCACHE1``, then the sha256 (hex) of the payload and
a newline, then the payload (a pickle). A record that is truncated, corrupt, from another
format or that fails to load gives a ``RuntimeWarning`` and a recompile (the bad file is
replaced), never a crash.

The key (``key_entries``, in this order; the digest is sha256 over
``"<name>=<sha256(value)>\\n"`` lines):

======================  ====================================================================
``format``              the record format version
``fn.module``           ``fn.__module__``
``fn.qualname``         ``fn.__qualname__``
``fn.code``             sha256 over the code object: ``co_code``, ``co_consts`` (nested code
                        objects recursively), ``co_names``; closure cells and defaults of
                        simple types; and the same for global functions it calls that are
                        defined outside site-packages, and simple global constants it reads
``fn.source``           ``inspect.getsource(fn)`` when available, else ``<unavailable>``
``signature``           the input pytree structure and every leaf's shape, dtype, weak type
                        and whether it is per-replica
``jax`` / ``jaxlib``    versions
``backend``             platform and platform version of the mesh's devices
``jax_config``          JAX's trace context: every setting that changes what a trace gives
                        (``jax_enable_x64``, ``jax_default_matmul_precision``,
                        ``jax_numpy_rank_promotion``, ..., thread-local ones included)
``compiler``            XLA's flags (``$XLA_FLAGS``, ``$LIBTPU_INIT_ARGS``) and the JAX
                        settings of its compile options (``jax_optimization_level``, ...)
``mesh``                shape, axis names, device ids in mesh order
``pipeline``            the pass pipeline string
``options``             num_replicas, logical_devices, loss_reduction, verify,
                        steps_per_call, donate, step_outputs,
                        bucket_bytes, dynamic_shapes, bucketing, maximum_shapes
``program``             sha256 of the step traced for this call (:func:`program_fingerprint`):
                        every value the program depends on, closed-over objects and arrays
                        included, whatever the code entries above could see of them, and
                        the structure of its results
======================  ====================================================================

The code entries (``fn.code``, ``fn.source``) see closure values and globals of simple
types only; they stay in the key to name what changed (``last_miss.json``), and the
``program`` entry is what makes the key sound: a step that closes over an optimizer, a
model object or an array traces to another program when those change, and misses.
"""
from __future__ import annotations

import functools
import hashlib
import inspect as _inspect
import json
import logging
import os
import pickle
import re
import sysconfig
import tempfile
import threading
import time
import types
import warnings
from typing import Any, Callable

import numpy as np

from ir import _jax_compat as jc

log = logging.getLogger("runtime")

CACHE_ENV = "RT_CACHE_DIR"
FORMAT = "RTCACHE1"
_MAGIC = FORMAT.encode() + b"\n"
_jax_cache_lock = threading.Lock()
_jax_cache_dir: str | None = None
_local = threading.local()  # per thread: JAX persistent-cache hits seen (see _xla_cache_hits)
_listening = False
_JAX_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _JAX_HIT_EVENT:
        _local.hits = getattr(_local, "hits", 0) + 1


def _xla_cache_hits() -> int:
    """JAX persistent-cache hits in this thread so far (``jax.monitoring`` events)."""
    global _listening
    if not _listening:
        import jax.monitoring
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    return getattr(_local, "hits", 0)

__all__ = ["CACHE_ENV", "PersistentCache", "key_entries", "digest", "explain_text",
           "cache_dir_for", "configure_jax_cache"]


# ---------------------------------------------------------------------------- the key

_SIMPLE = (int, float, str, bool, bytes, type(None), complex)
_SKIP_PREFIXES = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                        sysconfig.get_paths()["platlib"]})


def _simple(v: Any) -> bool:
    if isinstance(v, _SIMPLE):
        return True
    if isinstance(v, (tuple, frozenset)) and len(v) < 64:
        return all(_simple(x) for x in v)
    return False


def _user_function(f: Any) -> bool:
    code = getattr(f, "__code__", None)
    return (isinstance(f, types.FunctionType) and code is not None
            and not code.co_filename.startswith(_SKIP_PREFIXES))


def _hash_code(h: Any, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _hash_code(h, c)
        else:
            h.update(repr(c).encode() if _simple(c) else type(c).__qualname__.encode())


def _all_names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _all_names(c)
    return out


def _hash_function(h: Any, fn: Any, seen: set[int], depth: int = 0) -> None:
    """Code, closure, defaults of ``fn``; simple globals and user functions it names."""
    fn = _inspect.unwrap(fn) if callable(fn) else fn
    if isinstance(fn, functools.partial):
        h.update(b"partial")
        h.update(repr([a if _simple(a) else type(a).__qualname__ for a in fn.args]).encode())
        return _hash_function(h, fn.func, seen, depth)
    code = getattr(fn, "__code__", None)
    if code is None:
        call = getattr(type(fn), "__call__", None)
        h.update(f"{type(fn).__module__}.{type(fn).__qualname__}".encode())
        if call is not None and id(call) not in seen and hasattr(call, "__code__"):
            seen.add(id(call))
            _hash_function(h, call, seen, depth + 1)
        return
    if id(code) in seen:
        return
    seen.add(id(code))
    h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
    _hash_code(h, code)
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _simple(v):
            h.update(repr(v).encode())
        elif _user_function(v) and depth < 8:
            _hash_function(h, v, seen, depth + 1)
        else:
            h.update(type(v).__qualname__.encode())
    h.update(repr([d if _simple(d) else type(d).__qualname__
                   for d in (fn.__defaults__ or ())]).encode())
    g = getattr(fn, "__globals__", {})
    for name in sorted(_all_names(code)):
        if name not in g:
            continue
        v = g[name]
        if _simple(v):
            h.update(f"{name}={v!r}".encode())
        elif _user_function(v) and depth < 8:
            _hash_function(h, v, seen, depth + 1)


def _source(fn: Any) -> str:
    try:
        return _inspect.getsource(_inspect.unwrap(fn))
    except (OSError, TypeError):
        return "<unavailable>"


def key_entries(owner: Any, key: tuple) -> dict[str, str]:
    """The named entries of the persistent key of ``owner`` (a ``Replicated``) called with
    the in-memory cache ``key`` (input structure and leaf signatures). See the module
    docstring for what each entry holds."""
    import jax
    import jaxlib

    fn = owner.fn
    h = hashlib.sha256()
    _hash_function(h, fn, set())
    opts = owner.options
    devs = list(owner.mesh.devices.flat)
    dev0 = devs[0]
    try:
        platform_version = dev0.client.platform_version
    except Exception:  # noqa: BLE001 - not every client has it
        platform_version = "?"
    return {
        "format": FORMAT,
        "fn.module": str(getattr(fn, "__module__", "?")),
        "fn.qualname": str(getattr(fn, "__qualname__", type(fn).__qualname__)),
        "fn.code": h.hexdigest(),
        "fn.source": _source(fn),
        "signature": _signature_text(key),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": f"{dev0.platform} {platform_version}",
        "jax_config": jc.trace_context_text(),
        "compiler": compiler_settings_text(),
        "mesh": f"shape={dict(owner.mesh.shape)} axes={tuple(owner.mesh.axis_names)} "
                f"devices={[d.id for d in devs]}",
        "pipeline": opts.pipeline,
        "options": f"num_replicas={owner.num_replicas} logical_devices={owner.logical_devices} "
                   f"loss_reduction={owner.loss_reduction} verify={opts.verify} "
                   f"bucket_bytes={opts.bucket_bytes} dynamic_shapes={opts.dynamic_shapes} "
                   f"bucketing={opts.bucketing!r} maximum_shapes={opts.maximum_shapes!r} "
                   f"steps_per_call={owner.steps_per_call} donate={owner.donate} "
                   f"step_outputs={owner.step_outputs}",
    }


#: JAX settings that change what XLA compiles a module to (JAX's compile options), not what
#: a trace gives: not in ``jax_config``
_COMPILER_SETTINGS = ("jax_optimization_level", "jax_memory_fitting_level",
                      "jax_exec_time_optimization_effort", "jax_memory_fitting_effort",
                      "jax_compiler_enable_remat_pass", "jax_xla_profile_version",
                      "jax_use_shardy_partitioner")
#: environment variables XLA reads its flags from
_COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def compiler_settings_text() -> str:
    """The ``compiler`` entry: XLA's flags (``$XLA_FLAGS``, ``$LIBTPU_INIT_ARGS``) and the
    JAX settings of XLA's compile options. Before, a record compiled under other flags was
    served: a bfloat16 step written under XLA's default excess precision ran in a process
    with ``--xla_allow_excess_precision=false`` and gave 3877.68 where ``jax.jit`` there
    gives 3877.85 (found by a probe)."""
    import jax
    parts = [f"{name}={os.environ.get(name, '')!r}" for name in _COMPILER_ENV]
    for name in _COMPILER_SETTINGS:
        value = getattr(jax.config, name, None)
        if value is not None:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _signature_text(key: tuple) -> str:
    if key and key[0] == "dynamic":  # (runtime.dynamic: the buckets' signature and bounds)
        _, treedef, sigs, bounds, statics = key
        inner = _signature_text((treedef, sigs) + ((statics,) if statics else ()))
        return f"dynamic {inner}" + (f" :: bounds {dict(bounds)}" if bounds else "")

    def leaf(sig: Any) -> str:
        if sig and sig[0] == "per_replica":
            return f"PerReplica[{sig[1]}]({', '.join(leaf(s) for s in sig[2])})"
        shape, dtype, weak = sig[:3]
        return f"{getattr(dtype, 'name', dtype)}{list(shape)}{'~' if weak else ''}"
    text = f"{key[0]} :: " + ", ".join(leaf(s) for s in key[1])
    return text + (f" :: statics {key[2]!r}" if len(key) > 2 else "")


def digest(entries: dict[str, str]) -> str:
    """sha256 (hex) over ``"<name>=<sha256(value)>\\n"`` for every entry, in order."""
    h = hashlib.sha256()
    for name, value in entries.items():
        h.update(f"{name}={hashlib.sha256(value.encode()).hexdigest()}\n".encode())
    return h.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def program_fingerprint(graph: Any, out_treedef: Any = None) -> str:
    """sha256 (hex) of a traced step's program: the imported IR's text (object addresses,
    which differ between processes, dropped), the dtype, shape and bytes of every
    constant, shared regions once, and the structure the results are returned in
    (``out_treedef``: dict keys and containers, which the IR does not hold and a record
    restores). Two traces give the same fingerprint exactly when they are the same
    program: constants closed over (an array, a learning rate inside an optimizer
    object) are in it whatever the code key could see of them, and so are result names
    taken from a closed-over object (a hit returned the old names on the same values)."""
    from ir.printer import print_graph
    h = hashlib.sha256()
    h.update(_ADDRESS.sub(" at 0x?", print_graph(graph)).encode())
    if out_treedef is not None:
        h.update(_ADDRESS.sub(" at 0x?", f"\nresults: {out_treedef}").encode())
    seen: set[int] = set()

    def consts(g: Any) -> None:
        for op in g.ops:
            if op.name == "constant":
                v = np.asarray(op.attr("value"))
                h.update(f"{v.dtype.str}{v.shape}".encode())
                h.update(repr(v.tolist()).encode() if v.dtype == object
                         else np.ascontiguousarray(v).tobytes())
            for r in op.regions:
                if id(r) not in seen:
                    seen.add(id(r))
                    consts(r)
    consts(graph)
    return h.hexdigest()


def short_name(owner: Any, key: tuple) -> str:
    """``<fn>-<first 10 hex digits of the digest>``: a dump's folder name."""
    name = getattr(owner.fn, "__name__", "step")
    safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in name)
    return f"{safe}-{digest(key_entries(owner, key))[:10]}"


# ---------------------------------------------------------------------- configuration

def cache_dir_for(options: Any) -> str | None:
    """``options.cache_dir``, else ``$RT_CACHE_DIR``, else ``None`` (no persistent cache)."""
    return getattr(options, "cache_dir", None) or os.environ.get(CACHE_ENV) or None


_unusable_warned: set[str] = set()


def usable_cache_dir(options: Any) -> str | None:
    """:func:`cache_dir_for`, or ``None`` (run uncached) when that folder cannot be used: a
    file is in the way, or it cannot be created or written. Warns once per folder: a
    broken cache must cost the compile it would have saved, never the step."""
    root = cache_dir_for(options)
    if not root:
        return None
    rt_dir = os.path.join(os.path.abspath(root), "rt")
    try:
        os.makedirs(rt_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=rt_dir, prefix=".probe-")
        os.close(fd)
        os.remove(probe)
        return root
    except OSError as e:
        if root not in _unusable_warned:
            _unusable_warned.add(root)
            warnings.warn(f"persistent cache {root!r} cannot be used ({e.strerror or e}: "
                          f"{getattr(e, 'filename', '') or rt_dir}); running without it",
                          RuntimeWarning, stacklevel=4)
        return None


def configure_jax_cache(xla_dir: str) -> None:
    """Point JAX's persistent compilation cache at ``xla_dir`` (process-wide; the first
    directory wins: a later, different one only warns)."""
    global _jax_cache_dir
    import jax
    with _jax_cache_lock:
        if _jax_cache_dir == xla_dir:
            return
        current = jax.config.jax_compilation_cache_dir
        if _jax_cache_dir is not None or (current and current != xla_dir):
            warnings.warn(f"JAX's compilation cache already uses {current!r}; XLA executables of "
                          f"this step are cached there, not in {xla_dir!r}", RuntimeWarning,
                          stacklevel=3)
            _jax_cache_dir = xla_dir
            return
        os.makedirs(xla_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", xla_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        _jax_cache_dir = xla_dir


# ----------------------------------------------------------------------- the records

class PersistentCache:
    """Records of compiled programs under ``root/rt`` (and JAX's cache under ``root/xla``)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, "rt")
        os.makedirs(self.dir, exist_ok=True)
        configure_jax_cache(os.path.join(self.root, "xla"))

    def path(self, d: str) -> str:
        return os.path.join(self.dir, d + ".rec")

    # -- reading
    def load(self, d: str) -> dict[str, Any] | None:
        """The payload of record ``d``; ``None`` when absent or unreadable (with a warning)."""
        path = self.path(d)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._bad(path, f"cannot be read ({e})")
            return None
        if not data.startswith(_MAGIC):
            self._bad(path, f"does not start with {FORMAT!r} (garbage or another format)")
            return None
        rest = data[len(_MAGIC):]
        nl = rest.find(b"\n")
        if nl != 64:
            self._bad(path, "has no checksum line (truncated?)")
            return None
        want, payload = rest[:64].decode("ascii", "replace"), rest[65:]
        if hashlib.sha256(payload).hexdigest() != want:
            self._bad(path, f"fails its checksum ({len(payload)} payload bytes; truncated or corrupt)")
            return None
        try:
            rec = pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad record
            self._bad(path, f"cannot be unpickled ({type(e).__name__}: {e})")
            return None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            self._bad(path, "holds an unexpected payload")
            return None
        return rec

    def _bad(self, path: str, why: str) -> None:
        warnings.warn(f"persistent cache record {path} {why}; recompiling", RuntimeWarning,
                      stacklevel=4)
        try:
            os.remove(path)
        except OSError:
            pass

    # -- writing
    def store(self, d: str, entries: dict[str, str], program: Any,
              with_executable: bool = True) -> None:
        """Write the record of a compiled ``program`` (atomically: temp file + rename)."""
        from jax.experimental import serialize_executable as se
        exe = in_tree = out_tree = None
        if with_executable:
            exe, in_tree, out_tree = se.serialize(program.jax_compiled)
        rec = {
            "format": FORMAT, "digest": d, "entries": entries, "created": time.time(),
            "executable": exe, "in_tree": in_tree, "out_tree": out_tree,
            "key": program.key, "in_layout": program.in_layout,
            "entry_tree": program.entry_tree,
            "out_treedef": program.out_treedef, "out_varying": list(program.out_varying),
            "out_ranks": list(program.out_ranks), "donated": tuple(program.donated),
            "records": [(r.name, r.seconds, str(r.graph)) for r in program.records],
            "stablehlo": program.jax_lowered.as_text() if program.jax_lowered is not None else None,
        }
        payload = pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL)
        data = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        _atomic_write(self.path(d), data)
        meta = {"digest": d, "function": f"{entries['fn.module']}:{entries['fn.qualname']}",
                "created": rec["created"], "entries": entries}
        _atomic_write(os.path.join(self.dir, d + ".json"), json.dumps(meta, indent=1).encode())

    # -- explaining
    def explain_miss(self, d: str, entries: dict[str, str]) -> dict[str, Any]:
        """Compare a missed key with the newest record of the same function; write and
        return ``last_miss.json``."""
        fn = f"{entries['fn.module']}:{entries['fn.qualname']}"
        best, best_t = None, -1.0
        for name in os.listdir(self.dir):
            if not name.endswith(".json") or name == "last_miss.json":
                continue
            try:
                with open(os.path.join(self.dir, name)) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            if meta.get("function") == fn and meta.get("created", 0) > best_t:
                best, best_t = meta, meta.get("created", 0)
        out: dict[str, Any] = {"function": fn, "digest": d, "time": time.time()}
        if best is None:
            out["compared_with"] = None
            out["differing"] = []
            out["note"] = "no earlier record of this function: first compile"
        else:
            old = best["entries"]
            out["compared_with"] = best["digest"]
            out["differing"] = [
                {"entry": k, "before": old.get(k), "after": entries.get(k)}
                for k in dict.fromkeys(list(old) + list(entries)) if old.get(k) != entries.get(k)]
        try:
            _atomic_write(os.path.join(self.dir, "last_miss.json"),
                          json.dumps(out, indent=1).encode())
        except OSError as e:
            log.warning("cannot write last_miss.json: %s", e)
        return out

    # -- the runtime's entry point
    def build(self, owner: Any, key: tuple, trace: Callable[[], Any],
              finish: Callable[[Any], Any]) -> Any:
        """The program for ``key``: ``trace()`` traces the step (``runtime.program.
        trace_step``), whose fingerprint ends the key; then the record on disk (counted as
        a disk hit), else ``finish(traced)`` (passes, lower, compile; XLA may hit JAX's
        own cache), stored."""
        entries = key_entries(owner, key)
        traced = trace()
        entries["program"] = program_fingerprint(traced.graph, traced.out_treedef)
        d = digest(entries)
        rec = self.load(d)
        if rec is not None and (rec.get("digest") != d or rec.get("entries") != entries):
            # a record under this name whose own key is another's (copied or renamed
            # files): never run it, whatever its checksum says
            self._bad(self.path(d), "holds the record of another key")
            rec = None
        if rec is not None and rec.get("executable") is not None:
            try:
                prog = _restore(owner, rec, traced.out_treedef)
            except Exception as e:  # noqa: BLE001 - an unusable record is a miss
                self._bad(self.path(d), f"cannot be loaded ({type(e).__name__}: {e})")
            else:
                owner._cache.count_disk_hit()
                owner._last_miss = {"function": f"{entries['fn.module']}:{entries['fn.qualname']}",
                                    "digest": d, "disk_hit": True, "differing": []}
                log.info("loaded %s from the persistent cache (%s)", entries["fn.qualname"], d[:10])
                return prog
        miss = self.explain_miss(d, entries)
        before = _xla_cache_hits()
        prog = finish(traced)
        # An executable that JAX loaded from its own cache cannot be serialized again on
        # CPU (the reloaded object code is not kept): then the record keeps no executable
        # and later processes trace again and get the executable from JAX's cache.
        from_xla_cache = _xla_cache_hits() > before
        if from_xla_cache:
            owner._cache.count_disk_hit()
        miss["xla_cache_hit"] = from_xla_cache
        owner._last_miss = miss
        try:
            self.store(d, entries, prog, with_executable=not from_xla_cache)
            owner._cache.count_disk_write()
        except Exception as e:  # noqa: BLE001 - a cache that cannot write must not fail the step
            warnings.warn(f"could not write a persistent cache record for {entries['fn.qualname']} "
                          f"({type(e).__name__}: {e}); JAX's own cache still holds the executable",
                          RuntimeWarning, stacklevel=3)
        return prog


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _restore(owner: Any, rec: dict[str, Any], out_treedef: Any) -> Any:
    """A ready-to-call program from a record (no trace, no compile) returning its results
    in ``out_treedef``, this process's trace's: the record's may differ from it in the
    static data of a node (an object whose text, addresses dropped, the fingerprint
    cannot tell from another: a hit returned the writer's ``schedule='linear'`` where
    the step returns ``'cosine'``; found by a probe)."""
    from jax.experimental import serialize_executable as se

    from compiler.pass_manager import PassRecord
    from runtime.program import Program

    entry = rec.get("entry_tree") is not None  # (the executable returns that structure)
    compiled = se.deserialize_and_load(rec["executable"], rec["in_tree"],
                                       out_treedef if entry else rec["out_tree"],
                                       execution_devices=list(owner.mesh.devices.flat))
    records = [PassRecord(name, seconds, _LazyGraph(text)) for name, seconds, text in rec["records"]]
    prog = Program(owner, records, None, rec["in_layout"], out_treedef,
                   rec["out_varying"], rec["out_ranks"], entry_tree=rec.get("entry_tree"))
    prog.key = rec["key"]
    prog.donated = tuple(rec.get("donated", ()))
    prog.set_executable(compiled)
    prog.stablehlo_text = rec.get("stablehlo")
    prog.from_disk = True
    return prog


class _LazyGraph:
    """An IR graph parsed from its text on first use (a disk hit should not pay for it)."""

    def __init__(self, text: str):
        self._text = text
        self._graph = None

    def _get(self) -> Any:
        if self._graph is None:
            from ir.parser import parse
            self._graph = parse(self._text)
        return self._graph

    def __str__(self) -> str:
        return self._text

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)


def explain_text(info: dict[str, Any]) -> str:
    """``last_miss.json`` (or ``step.cache_explain()``'s dict) as text."""
    if not info:
        return "no miss recorded"
    if info.get("disk_hit"):
        return f"{info['function']}: last build was a disk hit ({info['digest'][:10]})"
    lines = [f"{info['function']}: miss on key {info['digest'][:16]}"
             + ("; the XLA executable came from JAX's persistent cache (traced again, "
                "nothing compiled)" if info.get("xla_cache_hit") else "")]
    if info.get("compared_with") is None:
        lines.append("  " + info.get("note", "no earlier record of this function"))
        return "\n".join(lines)
    lines.append(f"  compared with the newest record of the same function, "
                 f"{info['compared_with'][:16]}: {len(info['differing'])} entr"
                 f"{'y' if len(info['differing']) == 1 else 'ies'} differ")
    for d in info["differing"]:
        what = _MEANING.get(d["entry"])
        lines.append(f"  {d['entry']}:" + (f" {what}" if what else ""))
        lines.append(f"    before: {_clip(d['before'])}")
        lines.append(f"    after:  {_clip(d['after'])}")
    return "\n".join(lines)


#: what a differing entry means, where its value does not say (``explain_text``)
_MEANING = {"program": "the traced step differs (its IR or a constant in it): a value it "
                       "closes over changed (an optimizer's learning rate, a model object, "
                       "an array), or code it calls"}


def _clip(v: Any, n: int = 160) -> str:
    if v is None:
        return "(absent)"
    s = str(v).replace("\n", "\\n")
    return s if len(s) <= n else s[:n - 3] + "..."

