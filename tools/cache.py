"""Look into a persistent cache folder (``RunOptions(cache_dir=DIR)`` / ``$RT_CACHE_DIR``).

    python -m tools.cache explain DIR     # which key entries differed on the last miss
    python -m tools.cache list DIR        # the records: digest, function, size, age

See ``runtime.persistent`` for the key entries and the file formats.
"""
from __future__ import annotations

from tools._common import ArgumentParser as _ArgumentParser  # noqa: E402

import argparse
import json
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="python -m tools.cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sp = sub.add_parser("explain", help="which key entries differed on the last miss",
                        description="Print DIR/rt/last_miss.json: the last miss's key and, "
                                    "entry by entry, how it differed from the newest record "
                                    "of the same function.")
    sp.add_argument("dir", metavar="DIR", help="the cache folder (cache_dir / $RT_CACHE_DIR)")
    sp.add_argument("--json", action="store_true", help="print the raw JSON instead")
    sp = sub.add_parser("list", help="list the records",
                        description="One line per record: digest, function, bytes, age.")
    sp.add_argument("dir", metavar="DIR", help="the cache folder (cache_dir / $RT_CACHE_DIR)")
    for sp in sub.choices.values():
        sp.add_argument("--debug", action="store_true",
                        help="on an error, print the whole traceback instead of one line")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from tools._common import run_tool
    return run_tool("cache", lambda: _main(ns), ns.debug)


def _main(ns: argparse.Namespace) -> int:
    from tools._common import ToolError
    rt_dir = os.path.join(ns.dir, "rt")
    if not os.path.isdir(rt_dir):
        raise ToolError(f"{ns.dir} holds no persistent cache (no rt/ folder)")
    from runtime.persistent import explain_text  # imports no JAX at module level
    if ns.command == "explain":
        path = os.path.join(rt_dir, "last_miss.json")
        if not os.path.exists(path):
            print("no miss recorded yet")
            return 0
        try:
            with open(path) as f:
                info = json.load(f)
            text = json.dumps(info, indent=1) if ns.json else explain_text(info)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ToolError(f"{path} is unreadable or incomplete ({type(e).__name__}: {e}); "
                            f"delete it, the next miss writes a new one") from None
        print(text)
    else:
        now = time.time()
        for name in sorted(os.listdir(rt_dir)):
            if not name.endswith(".json") or name == "last_miss.json":
                continue
            try:
                with open(os.path.join(rt_dir, name)) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                print(f"{name}: unreadable metadata (skipped)", file=sys.stderr)
                continue
            if not isinstance(meta, dict) or not {"digest", "function"} <= set(meta):
                print(f"{name}: incomplete metadata (skipped)", file=sys.stderr)
                continue
            rec = os.path.join(rt_dir, meta["digest"] + ".rec")
            size = os.path.getsize(rec) if os.path.exists(rec) else 0
            print(f"{meta['digest'][:16]}  {meta['function']:40s} {size:>10d} B  "
                  f"{(now - meta.get('created', now)) / 60:8.1f} min ago")
    return 0


if __name__ == "__main__":
    sys.exit(main())
