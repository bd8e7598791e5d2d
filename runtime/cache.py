"""The executable cache: one compile per key, counted, thread-safe.

Key: everything that changes the program: the input pytree structure, every leaf's
shape, dtype and weak type (after bucketing), which inputs are per-replica, static
options, the mesh with its device order, and JAX's trace context (``jc.trace_context()``:
``default_matmul_precision``, ``numpy_rank_promotion``, x64, ... as ``jax.jit`` keys on
it; the callers add it to the key). The function itself is implicit: each
``replicate`` object owns its cache. Two threads asking for a cold key compile once:
the first builds, the others wait for its result (or its exception)."""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple


class CacheInfo(NamedTuple):
    """``hits``: calls served from memory; ``misses``: builds (each one either a compile or
    a load from the persistent cache); ``currsize``: entries in memory. With a persistent
    cache (``RunOptions(cache_dir=...)``): ``disk_hits``: misses served from disk with
    nothing compiled; ``disk_writes``: records written. ``memory_hits`` is ``hits`` and
    ``compiles`` is ``misses - disk_hits``."""

    hits: int
    misses: int
    currsize: int
    disk_hits: int = 0
    disk_writes: int = 0

    @property
    def memory_hits(self) -> int:
        """Calls served by an executable in memory (``hits``)."""
        return self.hits

    @property
    def compiles(self) -> int:
        """Builds that ran XLA's compile: the misses not served from disk."""
        return self.misses - self.disk_hits


class ExecutableCache:
    """A dict from key to entry with single-flight builds."""

    def __init__(self) -> None:
        self._entries: dict[Any, Any] = {}
        self._building: dict[Any, Future] = {}
        self._lock = threading.Lock()
        self.hits = 0            # counted under the lock
        self._fast_hits = itertools.count()  # counted lock-free by count_fast_hit
        self.misses = 0
        self.disk_hits = 0
        self.disk_writes = 0

    def get(self, key: Any) -> Any | None:
        """The entry for ``key`` (counted as a hit), or ``None``. The lookup is lock-free;
        only the hit count takes the (uncontended, ~50 ns) lock."""
        entry = self._entries.get(key)
        if entry is not None:
            self.count_hit()
        return entry

    def count_hit(self) -> None:
        """Count one hit served by the caller's own fast path. ``+=`` on an attribute is
        not atomic: threads hitting at once would lose counts without the lock."""
        with self._lock:
            self.hits += 1

    def count_fast_hit(self) -> None:
        """Count a hit on the hottest path without a lock: ``next()`` of an
        ``itertools.count`` is one atomic C call."""
        next(self._fast_hits)

    def count_disk_hit(self) -> None:
        """Count a miss that the persistent cache served (nothing compiled)."""
        with self._lock:
            self.disk_hits += 1

    def count_disk_write(self) -> None:
        """Count a record written to the persistent cache."""
        with self._lock:
            self.disk_writes += 1

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        """The entry for ``key``, built by ``build()`` on a miss. Concurrent callers of a
        cold key wait for the one build (a hit each) and share its result or exception."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                return entry
            fut = self._building.get(key)
            owner = fut is None
            if owner:
                fut = Future()
                self._building[key] = fut
                self.misses += 1
            else:
                self.hits += 1
        if not owner:
            return fut.result()
        try:
            entry = build()
        except BaseException as e:
            with self._lock:
                del self._building[key]
            fut.set_exception(e)
            raise
        with self._lock:
            self._entries[key] = entry
            del self._building[key]
        fut.set_result(entry)
        return entry

    def info(self) -> CacheInfo:
        """Hits, misses and the number of entries."""
        # the count's current value, unconsumed: its repr is ``count(N)`` (copying an
        # itertools.count is deprecated in Python 3.13 and gone in 3.14)
        fast = int(repr(self._fast_hits)[len("count("):-1])
        return CacheInfo(self.hits + fast, self.misses, len(self._entries), self.disk_hits,
                         self.disk_writes)

    def clear(self) -> None:
        """Drop every entry and reset the counts."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = self.disk_hits = self.disk_writes = 0
            self._fast_hits = itertools.count()
