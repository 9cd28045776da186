"""Wire a site agent together from its settings: TLS, ledger, hook, metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.core.config import SiteSettings
from common.core.errors import ConfigError, LedgerUnavailable
from common.core.observer import RoundObserver
from common.core.state_lock import StateLock
from common.privacy.ledger import LedgerSigner, PrivacyLedger, check_history, recovery_hint
from common.privacy.signed import CHARGE_RECORD_LEVEL, CHARGE_UNIT
from common.protocol.metrics_http import serve_metrics
from site_agent.agent import SiteAgent
from site_agent.dp_release import COUNT_STATE_FILE
from site_agent.metrics import SiteMetrics
from site_agent.site_training import DpTrainingHook, TrainingHook
from site_agent.study_gate import check_at_start

HookFactory = Callable[[SiteSettings], TrainingHook]
"""How a site agent gets its training from its settings (`build_hook`, or a plug-in's)."""


def build_hook(settings: SiteSettings) -> TrainingHook:
    """The site's training on its data: Opacus DP-SGD, or non-private for baselines."""
    return DpTrainingHook(settings, dp=settings.training.trainer == "dpsgd")


def ledger_path(settings: SiteSettings) -> Path:
    """The site's privacy ledger, in its state folder."""
    return settings.state / "privacy-ledger.db"


def open_ledger(settings: SiteSettings, hook: TrainingHook) -> PrivacyLedger | None:
    if hook.privacy_unit == "none":
        return None
    privacy = settings.privacy
    _, cert, key = settings.tls_paths()
    # Entries are signed with the site's certificate key; the ledger refuses to open
    # (LedgerUnavailable / LedgerForkError) when it is missing, damaged, older or
    # rewritten while its anchor (state/privacy-ledger.db.anchor) shows history.
    path = ledger_path(settings)
    refuse_fresh_ledger_over_history(path)
    return PrivacyLedger(
        path,
        site_id=settings.site,
        budget_epsilon=privacy.budget_epsilon,
        delta=privacy.delta,
        accountant=privacy.accountant,
        privacy_unit=hook.privacy_unit,
        # Hospital mode charges the per-patient figure (the model updates at 2S), so the
        # budget bounds every patient; an older hospital ledger (charged at S) is refused
        # on open, naming `medfed ledger carry --charge record_level`.
        charge=CHARGE_RECORD_LEVEL if hook.privacy_unit == "hospital" else CHARGE_UNIT,
        signer=LedgerSigner.from_files(cert, key),
        receipts_dir=privacy.receipts_dir,
    )


def refuse_fresh_ledger_over_history(path: Path) -> None:
    """A ledger (and its anchor) gone while the state folder shows this site already
    released something: refuse to start a fresh ledger at zero.

    Evidence of history: the persisted DP cohort count (released once, with a ledger
    entry) or a stored model bundle (the site took part in a study)."""
    anchor = path.with_name(path.name + ".anchor")
    if path.exists() or anchor.exists():
        return  # the ledger's own checks (anchor, signatures) apply
    state = path.parent
    evidence = [state / COUNT_STATE_FILE, *sorted((state / "model").glob("*.safetensors"))]
    found = [p for p in evidence if p.is_file()]
    if found:
        raise LedgerUnavailable(
            path,
            f"privacy ledger {path} is missing, but this site's state shows history "
            f"({', '.join(str(p) for p in found)}): refusing to start a new ledger at zero "
            "and spend a budget already spent. " + recovery_hint(path),
        )


def run_site(
    settings: SiteSettings,
    *,
    stop: threading.Event | None = None,
    announce: Callable[[dict[str, Any]], None] | None = None,
    hook_factory: HookFactory | None = None,
    observer: RoundObserver | None = None,
) -> int:
    # Ledger, state database and checkpoints: readable by this service only.
    try:
        settings.state.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(
            "state", f"cannot create the state folder {settings.state}: {exc.strerror or exc}"
        ) from exc
    # One agent per state folder: two would fork the ledger (common/core/state_lock.py).
    with StateLock.acquire(settings.state, role=f"site {settings.site}"):
        return _run_site(settings, stop=stop, announce=announce,
                         hook_factory=hook_factory or build_hook, observer=observer)


def _run_site(
    settings: SiteSettings,
    *,
    stop: threading.Event | None,
    announce: Callable[[dict[str, Any]], None] | None,
    hook_factory: HookFactory,
    observer: RoundObserver | None,
) -> int:
    # What the site's own settings say it approved, before torch loads or it dials out.
    check_at_start(settings)
    metrics = SiteMetrics(settings.site)
    if hook_factory is build_hook and settings.training.trainer == "dpsgd":
        # What the ledger's open would refuse without the study's terms, now: a site
        # whose ledger was lost, shortened or rewritten stops before it loads torch and
        # Opacus (seconds) and enrols.
        ledger = ledger_path(settings)
        refuse_fresh_ledger_over_history(ledger)
        check_history(ledger, site_id=settings.site, receipts_dir=settings.privacy.receipts_dir)
    hook = hook_factory(settings)
    metrics.device.labels(device=hook.device).set(1)
    def open_and_attach() -> PrivacyLedger | None:
        ledger = open_ledger(settings, hook)
        if ledger is not None and isinstance(hook, DpTrainingHook):
            # The one DP count of this site's units (persisted; never re-released).
            hook.attach_ledger(ledger, state=settings.state)
        return ledger

    # The privacy unit (and so the ledger's terms) is known once the site joined the
    # coordinator's study: the agent opens the ledger then, before any release.
    agent = SiteAgent(settings, hook, metrics=metrics, ledger=None, stop=stop,
                      open_ledger=open_and_attach, observer=observer)
    agent.budget_pb()
    _, metrics_port = serve_metrics(settings.metrics_listen, metrics.registry)
    if announce is not None:
        announce({"event": "started", "site": settings.site, "metrics_port": metrics_port})
    return agent.run()
