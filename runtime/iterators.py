"""Input distribution (TF's ``experimental_distribute_dataset`` and
``experimental_distribute_values_from_function``).

    for batch in rt.distribute_iterator(global_batches, 8, step=step):   # PerReplica
        params = step(params, batch)

``distribute_iterator`` splits each global batch over the replicas on a background thread
and places it on the step's devices while the step runs: the ``PerReplica`` it yields
carries the global arrays already laid out as ``NamedSharding(mesh, P('replica'))``, so
``replicate`` hands them to the executable without copying.
"""
from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from compiler.mesh import build_mesh
from ir.jaxpr_import import REPLICA_AXIS
from runtime.per_replica import PerReplica

__all__ = ["distribute_iterator", "DistributedIterator", "distribute_values_from_function",
           "ValueContext", "distribute_steps"]


@dataclass(frozen=True)
class ValueContext:
    """What ``distribute_values_from_function`` tells ``fn`` about the replica it makes a
    value for (TF's ``tf.distribute.experimental.ValueContext``)."""

    replica_id: int
    num_replicas: int


def distribute_values_from_function(fn: Callable[[ValueContext], Any],
                                    num_replicas: int) -> PerReplica:
    """``PerReplica([fn(ValueContext(r, num_replicas)) for r in range(num_replicas)])``:
    each replica's value from a function of its replica id."""
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"distribute_values_from_function: num_replicas must be a positive "
                         f"int, got {num_replicas!r}")
    return PerReplica([fn(ValueContext(r, num_replicas)) for r in range(num_replicas)])


def distribute_steps(batches: Sequence[Any], num_replicas: int) -> PerReplica:
    """k global batches (a Python list of k batches, or one pytree — a tuple counts as a
    pytree — whose leaves are [k, B, ...]) as the input of
    a ``steps_per_call=k`` step: replica r's value has leaves ``[k, B/N, ...]`` (step t on
    axis 0), and the global layout the runtime places without copying per replica."""
    if isinstance(batches, list):
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)
    else:
        stacked = batches
    leaves, treedef = jax.tree.flatten(stacked)
    parts: list[list[Any]] = [[] for _ in range(num_replicas)]
    glob = []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.ndim < 2 or a.shape[1] % num_replicas:
            raise ValueError(f"distribute_steps: a leaf of shape {a.shape} is not [k, B, ...] "
                             f"with B divisible by {num_replicas} replicas")
        k, b = a.shape[0], a.shape[1] // num_replicas
        per = a.reshape((k, num_replicas, b) + a.shape[2:]).swapaxes(0, 1)  # [N, k, b, ...]
        for r in range(num_replicas):
            parts[r].append(per[r])
        glob.append(np.ascontiguousarray(per).reshape((num_replicas * k, b) + a.shape[2:]))
    out = PerReplica([treedef.unflatten(p) for p in parts])
    out._global = (treedef, glob)
    return out


_END = object()


class _Error:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class DistributedIterator:
    """Iterator of ``PerReplica`` batches made on a background thread; see
    :func:`distribute_iterator`. Close it (``close()``, ``with``, or let it run out) to
    stop the thread; an exception in the producer is raised by the next ``next()``."""

    def __init__(self, iterable: Iterable[Any], num_replicas: int, prefetch: int = 2,
                 mesh: Any = None):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"distribute_iterator: num_replicas must be a positive int, "
                             f"got {num_replicas!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"distribute_iterator: prefetch must be a positive int, got {prefetch!r}")
        if mesh is None:
            mesh = build_mesh(num_replicas, 1)
        if mesh.shape[REPLICA_AXIS] != num_replicas:
            raise ValueError(f"distribute_iterator: the mesh has {mesh.shape[REPLICA_AXIS]} "
                             f"replicas but num_replicas is {num_replicas}")
        self.num_replicas = num_replicas
        self.mesh = mesh
        self._sharding = NamedSharding(mesh, P(REPLICA_AXIS))
        devs = mesh.devices.reshape(num_replicas, -1)
        me = jax.process_index()
        # the replicas whose values this process holds (all of them in one process)
        self._local = [(r, devs[r, 0]) for r in range(num_replicas)
                       if devs[r, 0].process_index == me]
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._done = False
        # The thread holds no reference to the iterator, only to what it needs: an
        # iterator dropped without close() is collected, and its finalizer stops the thread.
        placer = _Placer(num_replicas, self._sharding, self._local)
        self._thread = threading.Thread(target=_produce,
                                        args=(iter(iterable), placer, self._queue, self._stop),
                                        name="rt-distribute-iterator", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._stop.set)

    def _place(self, batch: Any) -> PerReplica:
        """Split one global batch (see :class:`_Placer`)."""
        return _Placer(self.num_replicas, self._sharding, self._local).place(batch)

    # -- consumer ---------------------------------------------------------------------------
    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PerReplica:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Error):
            self._finish()
            raise item.exc
        return item

    def _finish(self) -> None:
        self._done = True
        self._stop.set()
        self._thread.join(timeout=5)

    def close(self) -> None:
        """Stop the producer thread and drop what it prefetched."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        """Is the producer thread alive?"""
        return self._thread.is_alive()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



class _Placer:
    """What the producer thread needs to place batches (and nothing of the iterator)."""

    def __init__(self, num_replicas: int, sharding: Any, local: list):
        self.num_replicas, self._sharding, self._local = num_replicas, sharding, local

    def place(self, batch: Any) -> PerReplica:
        """Split one global batch: device-put every leaf as a global array sharded over
        the replicas; each replica's value is its shard (no copy)."""
        if isinstance(batch, PerReplica):
            return batch
        leaves, treedef = jax.tree.flatten(batch)
        n = self.num_replicas
        glob = []
        for leaf in leaves:
            shape = np.shape(leaf)
            if not shape or shape[0] % n:
                raise ValueError(f"distribute_iterator: a batch leaf of shape {tuple(shape)} "
                                 f"cannot be split over {n} replicas on axis 0")
            if jax.process_count() > 1:
                a = np.asarray(leaf)  # every process reads the same global batch
                glob.append(jax.make_array_from_callback(a.shape, self._sharding,
                                                         lambda idx, a=a: a[idx]))
            else:
                glob.append(jax.device_put(leaf, self._sharding))
        shards = []
        for g in glob:
            by_dev = {s.device: s.data for s in g.addressable_shards}
            shards.append([by_dev[d] for _, d in self._local])
        out = PerReplica([treedef.unflatten([s[i] for s in shards])
                          for i in range(len(self._local))])
        out._global = (treedef, glob)
        return out


def _put(q: queue.Queue, stop: threading.Event, item: Any) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _produce(it: Any, placer: _Placer, q: queue.Queue, stop: threading.Event) -> None:
    """The producer thread: place batches into ``q`` until the data ends or ``stop``."""
    try:
        while not stop.is_set():
            try:
                batch = next(it)
            except StopIteration:
                _put(q, stop, _END)
                return
            if not _put(q, stop, placer.place(batch)):
                return
    except BaseException as e:  # handed to the consumer, raised by its next()
        _put(q, stop, _Error(e))
    finally:
        close = getattr(it, "close", None)  # a generator source: run its finally blocks
        if close is not None:
            try:
                close()
            except Exception:
                pass


def distribute_iterator(iterable: Iterable[Any], num_replicas: int | None = None,
                        prefetch: int = 2, *, mesh: Any = None, step: Any = None
                        ) -> DistributedIterator:
    """Turn an iterable of global batches into ``PerReplica`` batches on the devices.

    A background thread takes each global batch (a pytree whose leaves split evenly on
    axis 0), places every leaf as one global array ``NamedSharding(mesh, P('replica'))``
    and yields a ``PerReplica`` whose replica r value is its shard, ``prefetch`` batches
    ahead of the consumer. ``step=`` (a ``replicate``d step) or ``mesh=`` gives the mesh,
    so the arrays are already where that step wants them; otherwise the first
    ``num_replicas`` devices. With ``jax.distributed`` every process passes the same global
    batches and gets its local replicas' values. An exception in the producer (or the
    source iterable) is raised by the consumer's next ``next()``; ``close()``, a ``with``
    block, or the end of the data stops the thread."""
    if step is not None:
        mesh = step.mesh
        num_replicas = num_replicas or step.num_replicas
    if mesh is not None and num_replicas is None:
        num_replicas = mesh.shape[REPLICA_AXIS]
    if num_replicas is None:
        raise ValueError("distribute_iterator: give num_replicas, mesh= or step=")
    return DistributedIterator(iterable, num_replicas, prefetch, mesh)
