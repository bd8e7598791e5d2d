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

__all__ = ["initialize_distributed", "ENV_VARS"]

#: the environment variables ``initialize_distributed`` reads (``tools.launch`` sets them)
ENV_VARS = ("RT_COORDINATOR_ADDRESS", "RT_NUM_PROCESSES", "RT_PROCESS_ID", "RT_LOCAL_DEVICE_IDS")


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
