"""A child for tests/unit/test_zygote.py: reports what it was started with, then exits as
its first argument says."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import sys


def main() -> None:
    mode = sys.argv[1]
    atexit.register(lambda: print(json.dumps({"event": "atexit"}), flush=True))
    report = {
        "event": "started",
        "name": __name__,
        "argv": sys.argv[1:],
        "argv0": os.path.basename(sys.argv[0]),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "probe_env": os.environ.get("ZYGOTE_PROBE"),
        "stdin": sys.stdin.read(),
        "pid": os.getpid(),
    }
    if len(sys.argv) > 2:
        report["imported"] = importlib.import_module(sys.argv[2]).VALUE
    print(json.dumps(report), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "wait":
        signal.pause()
    if mode == "raise":
        raise ValueError("probe failed on purpose")
    sys.exit(int(mode))


if __name__ == "__main__":
    main()
