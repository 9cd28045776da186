"""The coordinator of `medfed bench soak --diagnose`, with a memory probe beside it.

``python -m bench.soak_probe --out FILE --every S [--tracemalloc FRAMES] -- ARGS...``
runs ``python -m bench.instrumented ARGS...`` (the coordinator, with the soak's flat
model: ``--model-dim``) in this process and, from a daemon thread,
appends one JSON object per line to FILE every S seconds, so that RSS growth can be
split between Python objects, the C heap and fragmentation:

* ``rss``: VmRSS, RssAnon and RssFile from /proc/self/status;
* ``maps``: resident bytes of the anonymous mappings by kind (/proc/self/smaps): the
  brk ``heap`` (glibc's main arena), ``arena64m`` (glibc's per-thread arenas, reserved
  64 MiB at a time: grpc core's threads allocate there), ``anon_1m`` (exactly 1 MiB:
  CPython's object arenas in 3.10+), ``anon_other`` (large mallocs, numpy buffers) and
  ``anon_mmap``, the sum of the last two;
* ``malloc``: glibc ``mallinfo2()`` over every arena: ``uordblks`` bytes in use,
  ``fordblks`` free bytes kept, ``hblkhd`` bytes in mmapped chunks;
* ``sqlite``: ``sqlite3_memory_used()`` and its high-water mark, from the SQLite library
  Python's `sqlite3` module loaded;
* ``gc``: the number of objects the collector tracks, the 15 most common types, and
  ``sys.getallocatedblocks()`` (every live block of CPython's allocator);
* ``tracemalloc`` (with ``--tracemalloc``): bytes traced now and the 15 tracebacks whose
  traced bytes grew most since the second sample (the first is start-up) and since the
  previous one.

``--sqlite-heap-limit BYTES`` sets SQLite's soft heap limit (``sqlite3_soft_heap_limit64``):
SQLite then recycles page-cache pages beyond it, which takes its bounded cache out of
the RSS curve.

A throw-away wrapper for measurement only: the product coordinator runs without it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import signal
import sqlite3  # noqa: F401 - loads libsqlite3 into the process, for `_sqlite`
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench import instrumented

_MAPPING_KINDS = ("heap", "arena64m", "anon_1m", "anon_other", "file", "stack_other")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost",
    )]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    return libc


def _sqlite() -> ctypes.CDLL | None:
    """The SQLite library the `sqlite3` module is linked against (already loaded)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libsqlite3" in line:
            lib = ctypes.CDLL(line.split()[-1])
            lib.sqlite3_memory_used.restype = ctypes.c_int64
            lib.sqlite3_memory_highwater.restype = ctypes.c_int64
            lib.sqlite3_memory_highwater.argtypes = [ctypes.c_int]
            return lib
    return None


def status_fields() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem of this process in bytes."""
    wanted = {"VmRSS", "RssAnon", "RssFile", "RssShmem"}
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            out[key] = int(value.split()[0]) * 1024
    return out


def mapping_rss() -> dict[str, int]:
    """Resident bytes of this process's mappings, grouped by what usually backs them."""
    totals = dict.fromkeys(_MAPPING_KINDS, 0)
    kind = "file"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            size = end - start
            name = parts[5] if len(parts) > 5 else ""
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("/"):
                kind = "file"
            elif name:
                kind = "stack_other"
            elif size == 1 << 20:
                kind = "anon_1m"
            elif start % (64 << 20) == 0 or size == 64 << 20:
                kind = "arena64m"
            else:
                kind = "anon_other"
        elif parts[0] == "Rss:":
            totals[kind] += int(parts[1]) * 1024
    # The kernel merges neighbouring anonymous mappings with the same permissions, so
    # an object arena next to a large malloc chunk moves between the two kinds: their
    # sum is the stable figure.
    totals["anon_mmap"] = totals["anon_1m"] + totals["anon_other"]
    return totals


def _growth(now: tracemalloc.Snapshot, then: tracemalloc.Snapshot) -> list[dict[str, Any]]:
    """The 15 tracebacks whose traced bytes grew most from `then` to `now`."""
    return [
        {"size_diff": s.size_diff, "count_diff": s.count_diff, "size": s.size,
         "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback]}
        for s in now.compare_to(then, "traceback")[:15]
    ]


class Probe:
    def __init__(self, out: Path, *, every: float) -> None:
        self.out = out
        self.every = every
        self.libc = _libc()
        self.sqlite = _sqlite()
        # The first snapshot (after start-up) and the latest: growth since each.
        self.first: tracemalloc.Snapshot | None = None
        self.previous: tracemalloc.Snapshot | None = None
        self.seq = 0
        self.wake = threading.Event()
        self.final = False

    def sample(self, *, trim: bool = False) -> dict[str, Any]:
        record: dict[str, Any] = {"time": time.time(), "rss": status_fields(),
                                  "maps": mapping_rss()}
        if self.libc is not None:
            info = self.libc.mallinfo2()
            record["malloc"] = {name: getattr(info, name) for name, _ in info._fields_}
            if trim:
                self.libc.malloc_trim(0)
                record["rss_after_malloc_trim"] = status_fields()["VmRSS"]
        if self.sqlite is not None:
            record["sqlite"] = {
                "memory_used": self.sqlite.sqlite3_memory_used(),
                "memory_highwater": self.sqlite.sqlite3_memory_highwater(0),
            }
        # Blocks of CPython's allocator count every live object, those the collector
        # does not track too (str, bytes, int, dicts of atoms): cheap, unlike tracemalloc.
        # No census by type: gc.get_objects() from this thread holds a reference to
        # whatever the service's threads are building, and a tuple being built from a
        # generator must have none (CPython raised "SystemError: bad argument to
        # internal function" in the measured coordinator's round engine).
        record["gc"] = {"allocated_blocks": sys.getallocatedblocks()}
        if tracemalloc.is_tracing():
            snapshot = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__),)
            )
            current, peak = tracemalloc.get_traced_memory()
            record["tracemalloc"] = {"current": current, "peak": peak}
            if self.seq == 0:
                pass  # start-up: imports and first buffers still arriving
            elif self.first is None:
                self.first = snapshot
            else:
                record["tracemalloc"]["growth"] = _growth(snapshot, self.first)
                if self.previous is not None:
                    record["tracemalloc"]["growth_since_previous"] = _growth(
                        snapshot, self.previous
                    )
                self.previous = snapshot
        return record

    def loop(self) -> None:
        """Sample every `every` seconds; after SIGUSR2, one last sample with
        malloc_trim(0) (what RSS falls to when glibc returns every free page it can
        tells free-but-kept memory from memory in use), then stop. Each sample is
        announced on stdout so that the soak can pair it with the round count."""
        while True:
            self.wake.wait(self.every)
            final = self.final
            record = {"seq": self.seq, **self.sample(trim=final), "final": final}
            with self.out.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            print(json.dumps({"event": "probe_sample", "seq": self.seq, "final": final}),
                  flush=True)
            self.seq += 1
            if final:
                return

    def request_final(self, _signum: int, _frame: object) -> None:
        self.final = True
        self.wake.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_probe")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=float, default=30.0)
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES")
    parser.add_argument("--sqlite-heap-limit", type=int, default=0, metavar="BYTES")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [w for w in args.command if w != "--"]
    if args.tracemalloc:
        tracemalloc.start(args.tracemalloc)
    probe = Probe(args.out, every=args.every)
    if args.sqlite_heap_limit and probe.sqlite is not None:
        probe.sqlite.sqlite3_soft_heap_limit64.restype = ctypes.c_int64
        probe.sqlite.sqlite3_soft_heap_limit64.argtypes = [ctypes.c_int64]
        probe.sqlite.sqlite3_soft_heap_limit64(args.sqlite_heap_limit)
    signal.signal(signal.SIGUSR2, probe.request_final)
    threading.Thread(target=probe.loop, name="soak-probe", daemon=True).start()
    return instrumented.main(command)


if __name__ == "__main__":
    sys.exit(main())
