"""Prometheus metrics of a site agent (every name prefixed ``medfed_site_``).

They are the hospital's: its own ledger, device and the counts it trained on. The
hospital's Prometheus scrapes them (deploy/prometheus/site); the consortium operator's
monitoring reads the coordinator's series only and needs none of these.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRAINING_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
ROUND_OUTCOMES = ("completed", "aborted", "failed", "declined_budget")


class SiteMetrics:
    def __init__(self, site_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.site_id = site_id
        self.training_seconds = Histogram(
            "medfed_site_training_duration_seconds",
            "Local training time per round.",
            buckets=TRAINING_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "medfed_site_rounds",
            "Rounds this site took part in, by outcome "
            "(completed, aborted, failed, declined_budget).",
            ["outcome"],
            registry=r,
        )
        self.epsilon_spent = Gauge(
            "medfed_site_epsilon_spent", "Epsilon spent, composed over the ledger.", registry=r
        )
        self.epsilon_remaining = Gauge(
            "medfed_site_epsilon_remaining", "Epsilon budget left.", registry=r
        )
        self.epsilon_budget = Gauge("medfed_site_epsilon_budget", "Epsilon budget.", registry=r)
        self.samples_used = Gauge(
            "medfed_site_training_samples",
            "FedAvg weight of the last round: the DP count of units where the site keeps "
            "a ledger (DP on), else the exact record count. For the hospital's own "
            "Prometheus only: the consortium's monitoring never scrapes a site agent.",
            registry=r,
        )
        self.patients_used = Gauge(
            "medfed_site_training_patients",
            "Training units (patients) of the last round: the DP count where the site "
            "keeps a ledger (DP on), else the exact count. For the hospital's own "
            "Prometheus only.",
            registry=r,
        )
        self.device = Gauge(
            "medfed_site_device_info", "Device used for training (label).", ["device"], registry=r
        )
        self.grad_sample_mode = Gauge(
            "medfed_site_dp_grad_sample_mode_info",
            "Record-level DP-SGD path in use (1): ghost or hooks, and how it was chosen "
            "(configured, measured by auto, or rule for multi-process training).",
            ["mode", "source"],
            registry=r,
        )
        self.grad_sample_step_seconds = Gauge(
            "medfed_site_dp_grad_sample_step_seconds",
            "Best seconds per DP-SGD step of each record-level mode, as auto measured them "
            "on synthetic inputs of the training batch shape.",
            ["mode"],
            registry=r,
        )
        self.connected = Gauge(
            "medfed_site_connected", "1 while enrolled with the coordinator.", registry=r
        )

        self.crl_next_update = Gauge(
            "medfed_site_crl_next_update_timestamp_seconds",
            "nextUpdate of the CA's CRL this site last accepted (unix seconds); rounds are "
            "refused once it passes.",
            registry=r,
        )
        self.certificate_expiry = Gauge(
            "medfed_site_certificate_expiry_timestamp_seconds",
            "notAfter of this site's certificate and of its federation CA copy (unix seconds).",
            ["certificate"],
            registry=r,
        )
        # Unknown until the coordinator relays a CRL: NaN, not an alert-firing 0.
        self.crl_next_update.set(float("nan"))

        # Labelled series print nothing until first used; create them at zero so that
        # dashboards and alert rules see every outcome from the first scrape.
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome=outcome)

    def observe_budget(self, spent: float, budget: float) -> None:
        self.epsilon_spent.set(spent)
        self.epsilon_budget.set(budget)
        self.epsilon_remaining.set(max(budget - spent, 0.0))

    def observe_certificates(self, *, own: x509.Certificate, ca: x509.Certificate) -> None:
        for name, cert in (("site", own), ("ca", ca)):
            expiry: dt.datetime = cert.not_valid_after_utc
            self.certificate_expiry.labels(certificate=name).set(expiry.timestamp())

    def observe_grad_sample(
        self, *, mode: str, source: str, seconds_per_step: Mapping[str, float]
    ) -> None:
        """The trainer's record-level DP path and what `auto` measured (if it did)."""
        self.grad_sample_mode.clear()
        self.grad_sample_mode.labels(mode=mode, source=source).set(1)
        self.grad_sample_step_seconds.clear()
        for measured, seconds in seconds_per_step.items():
            self.grad_sample_step_seconds.labels(mode=measured).set(seconds)
