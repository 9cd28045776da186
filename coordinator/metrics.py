"""Prometheus metrics of the coordinator (every name prefixed ``medfed_``, units in names).

A private `CollectorRegistry` per coordinator keeps tests independent and the output
free of unrelated collectors; `/metrics` is served by `serve_metrics`.
"""

from __future__ import annotations

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
ROUND_OUTCOMES = ("completed", "aborted", "abandoned")
# Phases a site can be dropped in (coordinator.phases.SECURE_PHASES values, listed here
# so that this module stays import-free of the engine).
DROPOUT_PHASES = (
    "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask",
)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rounds_total = Counter(
            "medfed_coordinator_rounds",
            "Federated rounds by outcome (completed, aborted, abandoned).",
            ["outcome"],
            registry=r,
        )
        self.phase_seconds = Histogram(
            "medfed_coordinator_phase_duration_seconds",
            "Wall-clock time each round phase stayed open.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.sites_enrolled = Gauge(
            "medfed_coordinator_sites_enrolled", "Sites that have ever enrolled.", registry=r
        )
        self.sites_active = Gauge(
            "medfed_coordinator_sites_active",
            "Eligible sites waiting for, or selected into, the current round.",
            registry=r,
        )
        self.dropouts_total = Counter(
            "medfed_coordinator_dropouts",
            "Sites dropped from a round, by the phase whose deadline they missed.",
            ["phase"],
            registry=r,
        )
        self.database_reconnects_total = Counter(
            "medfed_coordinator_database_reconnects",
            "Outages of the state database (lost connection) ridden out: counted when "
            "the coordinator reconnected.",
            registry=r,
        )
        self.database_outage_seconds = Gauge(
            "medfed_coordinator_database_outage_seconds",
            "Duration of the latest state-database outage ridden out.",
            registry=r,
        )
        self.bytes_received = Counter(
            "medfed_coordinator_received_bytes",
            "Bytes of masked update vectors received.",
            registry=r,
        )
        self.unmask_seconds = Histogram(
            "medfed_coordinator_unmask_duration_seconds",
            "Time to reconstruct secrets and remove masks from the aggregate.",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.quorum_margin = Gauge(
            "medfed_coordinator_quorum_margin_sites",
            "Survivors minus the Shamir threshold in the last secure round.",
            registry=r,
        )
        self.site_epsilon_spent = Gauge(
            "medfed_coordinator_site_epsilon_spent",
            "Epsilon each site reports as spent (its own ledger is authoritative).",
            ["site"],
            registry=r,
        )
        self.site_epsilon_budget = Gauge(
            "medfed_coordinator_site_epsilon_budget",
            "Epsilon budget each site reports.",
            ["site"],
            registry=r,
        )
        self.site_last_contact = Gauge(
            "medfed_coordinator_site_last_contact_timestamp_seconds",
            "When each site enrolled since the coordinator started last called it (unix "
            "seconds): a live agent calls at least every minute, and beats every "
            "heartbeat interval while it waits or takes part in a round.",
            ["site"],
            registry=r,
        )
        self.model_auc = Gauge(
            "medfed_coordinator_model_auc_ratio",
            "AUC of the global model, from securely aggregated score histograms.",
            registry=r,
        )
        self.model_auc_interval_low = Gauge(
            "medfed_coordinator_model_auc_interval_low_ratio",
            "Lower end of the 95% interval of the DP AUC "
            "(common.releases.evaluation_interval.auc_interval): "
            "the exact held-out AUC lies within it at about that rate.",
            registry=r,
        )
        self.model_auc_interval_high = Gauge(
            "medfed_coordinator_model_auc_interval_high_ratio",
            "Upper end of the 95% interval of the DP AUC "
            "(common.releases.evaluation_interval.auc_interval).",
            registry=r,
        )
        self.hospital_intermediaries = Gauge(
            "medfed_coordinator_hospital_intermediaries",
            "Intermediaries per hospital (v) the next hospital-level round announces "
            "(the adaptive rule under privacy.intermediaries = auto).",
            registry=r,
        )
        self.grpc_requests = Counter(
            "medfed_coordinator_grpc_requests",
            "gRPC requests by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.misbehaving_total = Counter(
            "medfed_coordinator_misbehaving_reports",
            "Rounds in which a site revealed Shamir shares that failed the checks "
            "(corrected or the round aborted): a broken or malicious site.",
            ["site"],
            registry=r,
        )
        self.calls_refused = Counter(
            "medfed_coordinator_calls_refused",
            "Calls refused with RESOURCE_EXHAUSTED: the site held too many calls or "
            "request bytes in flight, or all sites' requests the parsing budget.",
            ["site"],
            registry=r,
        )
        self.metrics_scrapes_refused = Counter(
            "medfed_coordinator_metrics_scrapes_refused",
            "Scrapes of /metrics over HTTPS refused for their client certificate (not a "
            "monitor's, revoked, or the CRL unusable); each is logged as call_refused.",
            registry=r,
        )
        self.round_reports_refused = Counter(
            "medfed_coordinator_round_reports_refused",
            "Calls refused because the site's ledger_last_round was far past the "
            "coordinator's round numbering and no other site corroborated it.",
            ["site"],
            registry=r,
        )
        self.study_finished = Gauge(
            "medfed_coordinator_study_finished",
            "1 once every round of the study completed (the coordinator stays up and "
            "serves the final model: not an outage), else 0.",
            registry=r,
        )
        self.current_round = Gauge(
            "medfed_coordinator_round_number", "Number of the latest round.", registry=r
        )
        self.crl_next_update = Gauge(
            "medfed_coordinator_crl_next_update_timestamp_seconds",
            "nextUpdate of the CA's CRL the coordinator relays (unix seconds); once it "
            "passes, sites refuse every round and the coordinator refuses every caller.",
            registry=r,
        )
        self.certificate_expiry = Gauge(
            "medfed_coordinator_certificate_expiry_timestamp_seconds",
            "notAfter (unix seconds) of the coordinator's certificate (kind=coordinator), "
            "the CA (kind=ca) and each enrolled site's certificate (kind=site).",
            ["kind", "name"],
            registry=r,
        )

        # Labelled series print nothing until first used; create them at zero so that
        # dashboards and alert rules see every outcome/phase from the first scrape.
        for outcome in ROUND_OUTCOMES:
            self.rounds_total.labels(outcome=outcome)
        for phase in DROPOUT_PHASES:
            self.dropouts_total.labels(phase=phase)
        # Unknown until the first secure round / evaluation: NaN, not a misleading 0
        # (a 0 margin would fire MedfedQuorumMarginLow on a fresh coordinator).
        self.quorum_margin.set(float("nan"))
        self.model_auc.set(float("nan"))
        self.model_auc_interval_low.set(float("nan"))
        self.model_auc_interval_high.set(float("nan"))
        self.crl_next_update.set(float("nan"))

    def observe_budget(self, site: str, spent: float, budget: float) -> None:
        self.site_epsilon_spent.labels(site=site).set(spent)
        self.site_epsilon_budget.labels(site=site).set(budget)

    def observe_certificate(self, kind: str, name: str, cert: x509.Certificate) -> None:
        """Expiry of a certificate the federation depends on (alerted 7 days ahead)."""
        self.certificate_expiry.labels(kind=kind, name=name).set(
            cert.not_valid_after_utc.timestamp()
        )
