"""Multi-process runs (TF's multi-worker TPUStrategy): ``initialize_distributed`` joins
this process to the others through ``jax.distributed``; ``replicate`` then spans every
process's devices.

    rt.initialize_distributed()            # reads RT_COORDINATOR_ADDRESS, RT_NUM_PROCESSES, ...
    step = rt.replicate(fn)                # N = all devices of all processes
    params = step(params, local_batch)     # PerReplica of THIS process's replicas only

Each process passes a ``PerReplica`` holding the values of its own replicas (in the order
of its local devices in the mesh) and the same mirrored arguments as every other process;
varying results come back as a ``PerReplica`` of its local replicas, mirrored results are
global arrays, fully replicated, identical everywhere (``np.asarray`` works).
``python -m tools.launch -n 2 script.py`` starts such processes on one machine.
"""
from __future__ import annotations

import os

import jax

__all__ = ["initialize_distributed", "ENV_VARS", "ProcessMismatchError"]

#: the environment variables ``initialize_distributed`` reads (``tools.launch`` sets them)
ENV_VARS = ("RT_COORDINATOR_ADDRESS", "RT_NUM_PROCESSES", "RT_PROCESS_ID", "RT_LOCAL_DEVICE_IDS")
#: seconds a process waits at a compile for the other processes to reach the same one
#: (``check_same_arguments``); ``RT_ARGUMENTS_TIMEOUT_S`` overrides it
ARGUMENTS_TIMEOUT_S = 300.0


class ProcessMismatchError(ValueError):
    """The processes of a multi-process run called a replicated step with arguments of
    different shapes or dtypes (each would compile its own program, and their collectives
    would not match: wrong numbers on one, a hang or a crash on another)."""


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           local_device_ids: list[int] | None = None) -> None:
    """Wrap ``jax.distributed.initialize``; call it before any other JAX call.

    Arguments left ``None`` come from ``RT_COORDINATOR_ADDRESS`` (``host:port``),
    ``RT_NUM_PROCESSES``, ``RT_PROCESS_ID`` and ``RT_LOCAL_DEVICE_IDS`` (comma-separated),
    and failing those from JAX's own detection (its ``JAX_COORDINATOR_ADDRESS`` etc. or a
    cluster environment such as SLURM). On CPU, cross-process collectives use gloo
    (``jax_cpu_collectives_implementation``), set here before initializing. A second call
    in the same process does nothing."""
    if _initialized():
        return
    coordinator_address = coordinator_address or os.environ.get("RT_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("RT_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("RT_PROCESS_ID")
    if local_device_ids is None and os.environ.get("RT_LOCAL_DEVICE_IDS"):
        local_device_ids = [int(x) for x in os.environ["RT_LOCAL_DEVICE_IDS"].split(",")]
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        # without it CPU computations that span processes fail at run time
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)


def _initialized() -> bool:
    from ir import _jax_compat as jc  # noqa: PLC0415
    return jc.distributed_initialized()


_compiles: dict[str, int] = {}  # function name -> its compiles so far in this process


def check_same_arguments(fn_name: str, described: list[str]) -> None:
    """At a compile of ``fn_name`` in a multi-process run: every process must build it for
    the same arguments (``described``: one line per argument leaf, their count first; a
    per-replica leaf by its replicas' shape, the same on every process). Each process
    publishes its lines in ``jax.distributed``'s key-value store under the compile's
    number, then reads every other process's; a difference is a
    :class:`ProcessMismatchError` naming the leaf and both processes' values, before
    anything is traced. One process that compiles while another does not (a cache hit
    there: its arguments differ from this call's) is an error after
    ``RT_ARGUMENTS_TIMEOUT_S`` seconds (default 300). No-op in one process."""
    from ir import _jax_compat as jc  # noqa: PLC0415
    client = jc.distributed_client()
    if client is None or jax.process_count() == 1:
        return
    seq = _compiles[fn_name] = _compiles.get(fn_name, 0) + 1
    me, text = jax.process_index(), "\n".join(described)
    prefix = f"replicate_arguments/{fn_name}/{seq}"
    client.key_value_set(f"{prefix}/{me}", text)
    timeout = float(os.environ.get("RT_ARGUMENTS_TIMEOUT_S") or ARGUMENTS_TIMEOUT_S)
    for other in range(jax.process_count()):
        if other == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{prefix}/{other}", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - the store's timeout (a JaxRuntimeError)
            raise ProcessMismatchError(
                f"replicate({fn_name}): process {me} compiles the step for the {_nth(seq)} time "
                f"and process {other} did not within {timeout:g} s (RT_ARGUMENTS_TIMEOUT_S): "
                f"its arguments may have the shapes of an earlier call (a cache hit there) "
                f"while this process's are new: every process must pass arguments of the "
                f"same shapes and dtypes in every call; this process's: {text!r}") from e
        if theirs != text:
            mine_l, their_l = described, theirs.split("\n")
            i = next((i for i, (a, b) in enumerate(zip(mine_l, their_l)) if a != b),
                     min(len(mine_l), len(their_l)))
            a = mine_l[i] if i < len(mine_l) else "(none)"
            b = their_l[i] if i < len(their_l) else "(none)"
            label, a = a.split(": ", 1) if ": " in a else ("", a)
            b = b.split(": ", 1)[-1]
            raise ProcessMismatchError(
                f"replicate({fn_name}): the processes call the step with different arguments "
                f"({_nth(seq)} compile): {label + ' is ' if label else ''}{a} on process {me} "
                f"and {b} on process {other}; every "
                f"process must pass its replicas' values with the same shapes and dtypes, "
                f"and the same mirrored arguments (the program spans every process's "
                f"devices: each compiling its own would not match)")


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def describe_arguments(key: tuple) -> list[str]:
    """The count of argument leaves, then one line per leaf of a cache key
    (``Replicated._key_from``: each leaf's signature), for :func:`check_same_arguments`."""
    sigs = key[1]  # (not the structure's or static arguments' text: it may hold addresses)
    lines = [f"argument leaves: {len(sigs)}"]
    for i, sig in enumerate(sigs):
        if sig and sig[0] == "per_replica":
            _, td, inner = sig
            leaves = ", ".join(_array(s) for s in inner)
            lines.append(f"argument leaf {i}: per-replica {leaves}")
        else:
            lines.append(f"argument leaf {i}: {_array(sig)}")
    return lines


def _array(sig: tuple) -> str:
    shape, dtype, weak = (tuple(sig) + (False,) * 3)[:3]
    return f"{getattr(dtype, 'name', dtype)}{list(shape)}{' (weak)' if weak else ''}"
