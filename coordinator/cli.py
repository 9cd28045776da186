"""`medfed coordinator ...` commands."""

from __future__ import annotations

import argparse
import asyncio
from functools import partial
from pathlib import Path
from typing import Any

from common.core.config import CoordinatorSettings, load_settings
from common.core.logs import configure_logging
from common.core.observer import ObserverFactory
from coordinator.checkpoints import InitialModel


def register(subparsers: Any, *, observer_factory: ObserverFactory | None = None,
             model_without_study: InitialModel | None = None) -> None:
    """`medfed coordinator ...`. `observer_factory` plugs in what watches the rounds and
    `model_without_study` the flat model a coordinator serves instead of a study (tests
    and benchmarks: `bench.instrumented`; the product watches nothing and serves a
    study)."""
    parser = subparsers.add_parser("coordinator", help="run the federation coordinator")
    sub = parser.add_subparsers(dest="coordinator_command", required=True, metavar="ACTION")
    serve = sub.add_parser(
        "serve",
        help="serve the federation API over mutual TLS and run the configured rounds",
        description="Precedence: flags > environment variables MEDFED_COORDINATOR_* (nested "
        "with __) > the TOML config file > built-in defaults.",
    )
    serve.add_argument("--config", type=Path, help="TOML settings file")
    serve.add_argument(
        "--log-format", choices=["json", "text"],
        help="stderr logs: json (one object per line, default) or text (for people)",
    )
    serve.add_argument("--pki", type=Path, help="folder with ca.crt, crl.pem, coordinator.*")
    serve.add_argument("--listen", help="HOST:PORT of the mTLS gRPC port (port 0: any free)")
    serve.add_argument("--metrics-listen", help="HOST:PORT of the Prometheus /metrics endpoint")
    serve.add_argument(
        "--metrics-tls", action=argparse.BooleanOptionalAction, default=None,
        help="serve /metrics over HTTPS to monitor certificates only (default: whenever "
        "--metrics-listen is not a loopback address); --no-metrics-tls: plain HTTP",
    )
    serve.add_argument("--state", type=Path, help="folder for state database and checkpoints")
    serve.add_argument("--database-url", help="sqlite:///... (default: STATE/coordinator.db)")
    serve.add_argument("--rounds", type=int, help="rounds to complete")
    serve.add_argument("--min-sites", type=int, help="sites needed to start a round")
    serve.add_argument(
        "--study", type=Path,
        help="study.toml: model, features and training settings (`medfed study init`)",
    )
    serve.add_argument(
        "--initial-model", type=Path,
        help="the study's untrained network from `medfed model init` (a coordinator "
        "without torch, such as the coordinator image; default: built here)",
    )
    serve.add_argument(
        "--plain", action="store_true", default=None,
        help="plain FedAvg without secure aggregation (benchmarks only)",
    )
    serve.add_argument("--phase-seconds", type=float, help="deadline of each SecAgg phase")
    serve.add_argument("--train-seconds", type=float, help="deadline for local training")
    serve.add_argument("--heartbeat-seconds", type=float,
                       help="interval of the sites' heartbeats during a round")
    serve.add_argument("--selection-seconds", type=float,
                       help="wait this long for more sites once min_sites are ready")
    serve.add_argument(
        "--exit-when-finished", action="store_true",
        help="exit (0) once the study is finished, after --linger-seconds (batch use); "
        "by default the coordinator stays up and reports the study as finished",
    )
    serve.add_argument("--linger-seconds", type=float, default=5.0,
                       help="with --exit-when-finished: keep serving this long after the "
                       "last round so waiting sites hear that the study is finished")
    serve.set_defaults(func=partial(_serve, observer_factory=observer_factory,
                                    model_without_study=model_without_study))


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    overrides: dict[str, Any] = {
        "pki": args.pki,
        "listen": args.listen,
        "metrics_listen": args.metrics_listen,
        "metrics_tls": args.metrics_tls,
        "state": args.state,
        "database_url": args.database_url,
        "rounds": args.rounds,
        "study": args.study,
        "initial_model": args.initial_model,
        "min_sites": args.min_sites,
        "aggregation": {"secure_aggregation": False} if args.plain else None,
        "deadlines": {
            "phase_seconds": args.phase_seconds,
            "train_seconds": args.train_seconds,
            "selection_seconds": args.selection_seconds,
            "heartbeat_seconds": args.heartbeat_seconds,
        },
        "log_format": args.log_format,
    }
    return load_settings(CoordinatorSettings, config_file=args.config, overrides=overrides)


def _serve(args: argparse.Namespace, *, observer_factory: ObserverFactory | None = None,
           model_without_study: InitialModel | None = None) -> int:
    # grpc: loaded only to serve; registering the command stays grpc-free, since a grpc
    # core imported before a fork ignores the child's GRPC_* environment (tests/zygote.py
    # forks its processes from an interpreter that preloaded this module).
    from coordinator.service import serve

    settings = settings_from_args(args)
    configure_logging("coordinator", settings.log_level, settings.log_format)
    observer = observer_factory(settings.state) if observer_factory is not None else None
    return asyncio.run(serve(settings, exit_when_finished=args.exit_when_finished,
                             linger_seconds=args.linger_seconds, observer=observer,
                             model_without_study=model_without_study))
