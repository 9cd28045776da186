"""`medfed bench ...`: benchmarks that print ratios measured side by side in one run.

Each benchmark module exposes ``register(bench_subparsers)``; to add one, append its
module name to BENCHMARK_MODULES. Modules are imported lazily so that a benchmark
with heavy imports (torch) does not slow down the others' start-up more than once.
"""

from __future__ import annotations

import importlib
from typing import Any

BENCHMARK_MODULES: list[str] = [
    "bench.secagg",
    "bench.dpsgd",
    "bench.round",
    "bench.soak",
    "bench.ddgauss",
    "bench.noiseplan",
    "bench.ledger",
    "bench.utility",
    "bench.query",
]
"""Registrars of `medfed bench` subcommands, in help order."""


def register(subparsers: Any) -> None:
    """Add the ``bench`` command and every benchmark under it."""
    parser = subparsers.add_parser("bench", help="run a benchmark")
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name in BENCHMARK_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise  # a real missing dependency inside an existing benchmark
            continue  # benchmark not written yet
        module.register(sub)
