"""`medfed site ...` commands."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.core.config import SiteSettings, load_settings
from common.core.errors import ConfigError
from common.core.logs import configure_logging
from common.core.observer import ObserverFactory

if TYPE_CHECKING:
    from site_agent.runner import HookFactory


def register(
    subparsers: Any, *, hook_factory: HookFactory | None = None,
    observer_factory: ObserverFactory | None = None,
) -> None:
    """`medfed site ...`. `hook_factory` replaces the site's training (Opacus DP-SGD,
    or non-private for baselines, on its `--data`) with a plug-in's: the transport
    benchmarks' deterministic double (`bench.transport_site`). `observer_factory` plugs
    in what watches the rounds (tests and benchmarks: `bench.instrumented`; the product
    watches nothing)."""
    parser = subparsers.add_parser("site", help="run a hospital's site agent")
    sub = parser.add_subparsers(dest="site_command", required=True, metavar="ACTION")
    run = sub.add_parser(
        "run",
        help="connect to the coordinator (outbound only) and take part in rounds",
        description="Precedence: flags > environment variables MEDFED_SITE_* (nested "
        "with __) > the TOML config file > built-in defaults.",
    )
    run.add_argument("--config", type=Path, help="TOML settings file")
    run.add_argument(
        "--log-format", choices=["json", "text"],
        help="stderr logs: json (one object per line, default) or text (for people)",
    )
    run.add_argument("--pki", type=Path, help="folder with ca.crt and sites/SITE.crt/.key")
    run.add_argument("--tls-ca", type=Path, help="federation CA certificate (instead of --pki)")
    run.add_argument("--tls-cert", type=Path, help="this site's certificate")
    run.add_argument("--tls-key", type=Path, help="this site's private key")
    run.add_argument("--site", help="this site's id (must match its certificate)")
    run.add_argument("--coordinator", help="HOST:PORT of the coordinator")
    run.add_argument("--metrics-listen", help="HOST:PORT of the Prometheus /metrics endpoint")
    run.add_argument("--state", type=Path, help="folder for the privacy ledger and state")
    run.add_argument("--data", type=Path,
                     help="CSV or Parquet file with this site's records (what trains), or, "
                     "for an images study, a folder of images with labels.csv")
    run.add_argument("--study", type=Path,
                     help="study.toml this site agreed to: it joins no other study (the "
                     "coordinator serves the study; without --study, the coordinator's)")
    run.add_argument("--allow-factory", action="append", default=None, metavar="PKG.MOD:FN",
                     help="custom model factory this site may import and run (repeatable)")
    run.add_argument(
        "--once", action="store_true", default=None,
        help="exit 0 once the study's final model is stored (default: stay up for the "
        "next study)",
    )
    run.add_argument("--budget-epsilon", type=float, help="this site's epsilon budget")
    run.add_argument("--delta", type=float, help="DP delta")
    run.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    run.add_argument(
        "--trainer", choices=["dpsgd", "nonprivate"],
        help="dpsgd (default); nonprivate trains without DP (baselines only)",
    )
    run.add_argument("--exit-after-rounds", type=int, help="leave after this many rounds")
    run.add_argument(
        "--allow-plain-aggregation", action="store_true", default=None,
        help="accept rounds without secure aggregation (benchmarks only)",
    )
    run.set_defaults(func=partial(_run, hook_factory=hook_factory,
                                  observer_factory=observer_factory))
    from site_agent import approve_cli

    approve_cli.register(sub)


def settings_from_args(args: argparse.Namespace) -> SiteSettings:
    overrides: dict[str, Any] = {
        "pki": args.pki,
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "site": args.site,
        "coordinator": args.coordinator,
        "metrics_listen": args.metrics_listen,
        "state": args.state,
        "exit_after_rounds": args.exit_after_rounds,
        "once": args.once,
        "log_format": args.log_format,
        "data": {"path": args.data},
        "privacy": {"budget_epsilon": args.budget_epsilon, "delta": args.delta},
        "training": {"device": args.device, "trainer": args.trainer},
        "study_file": args.study,
        "policy": {
            "allow_plain_aggregation": args.allow_plain_aggregation,
            "allowed_model_factories": args.allow_factory,
        },
    }
    return load_settings(SiteSettings, config_file=args.config, overrides=overrides)


def _run(
    args: argparse.Namespace, *, hook_factory: HookFactory | None = None,
    observer_factory: ObserverFactory | None = None,
) -> int:
    from site_agent.runner import run_site

    settings = settings_from_args(args)
    if settings.data.path is None and hook_factory is None:
        # Nothing could ever train: say so now, not at enrolment (docs/deploy.md).
        raise ConfigError(
            "data.path", "name this site's data file (data.path in the config, or --data "
            "FILE): the study the coordinator serves says what its columns are"
        )
    path = settings.data.path
    if path is not None and not Path(path).exists():
        # Its contents are checked against the study at enrolment; its absence now.
        raise ConfigError("data.path", f"{path} does not exist")
    configure_logging(f"site:{settings.site}", settings.log_level, settings.log_format)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    observer = observer_factory(settings.state) if observer_factory is not None else None
    return run_site(settings, stop=stop, announce=lambda info: print(json.dumps(info), flush=True),
                    hook_factory=hook_factory, observer=observer)
