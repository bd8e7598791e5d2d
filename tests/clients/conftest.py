"""The client ports run at one replica count each by default, both under ``--long``.

Every port is parametrized over ``REPLICAS`` (2 and 8 replicas, ``_harness``). Both
counts of every port made a third of the suite's time, which has to stay under the
10-minute CI budget; the bugs a second count finds are those of the count itself (a
batch split into 2 or into 8), which the other ports cover. So by default a port runs
at one count, 2 for one half of the ports and 8 for the other (alternating over the
ports' file names in sorted order, so both counts stay covered every run and the choice
is stable from run to run); ``pytest --long`` runs every port at both. The tests left
out are reported as deselected, never skipped in silence.
"""
from __future__ import annotations

import functools
import os

from tests.clients._harness import REPLICAS

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def _port_files() -> tuple[str, ...]:
    """The test files of this folder, sorted (listed once per session)."""
    return tuple(sorted(f for f in os.listdir(HERE) if f.startswith("test_") and f.endswith(".py")))


def _default_count(module_file: str) -> int:
    """The replica count a port's file runs at without ``--long``: the ports' files in
    sorted order take 2, 8, 2, 8, ... (whatever is collected, so one file run alone runs
    as it does in the suite)."""
    files = _port_files()
    return REPLICAS[files.index(module_file) % len(REPLICAS)] if module_file in files else 0


def _replica_count(item) -> int | None:
    """The item's ``n`` parameter (its replica count), or ``None`` when it has none."""
    callspec = getattr(item, "callspec", None)
    n = None if callspec is None else callspec.params.get("n")
    return n if isinstance(n, int) else None


def _siblings(item) -> tuple:
    """What identifies the item but its replica count: the same test at another count
    has the same key."""
    params = {k: repr(v) for k, v in item.callspec.params.items() if k != "n"}
    return (str(item.path), item.originalname, tuple(sorted(params.items())))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        return
    counted = {id(it): (n, _default_count(os.path.basename(str(it.path))))
               for it in items if os.path.dirname(str(it.path)) == HERE
               and (n := _replica_count(it)) is not None}
    # a test is left out only where the same test runs at the file's default count
    # (a test parametrized at 8 replicas alone runs whatever its file's default)
    at_default = {_siblings(it) for it in items
                  if id(it) in counted and counted[id(it)][0] == counted[id(it)][1]}
    keep, drop = [], []
    for it in items:
        c = counted.get(id(it))
        if c is not None and c[0] != c[1] and _siblings(it) in at_default:
            drop.append(it)
        else:
            keep.append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
