"""The demo's membership-inference line: `medfed privacy audit` on one site's records.

Seed 002 reports membership-inference AUC 0.71 without DP and 0.53 at epsilon 8; the
demo reports ours next to its privacy/utility table, from the one-run audit (Steinke,
Nasr, Jagielski, NeurIPS 2023; site_agent/audit.py): the same local training once
without DP and once with DP-SGD at the demo's epsilon, on a sample of one hospital's
patients, with small settings so it adds well under a minute on two cores. The audit
runs in the demo process on a copy of the records; nothing it trains leaves it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from common.core.errors import MedfedError
from demo.tasks import Demo
from site_agent.audit_settings import AuditSettings
from site_agent.data import SiteData, check_cohort_size

AUDIT_PATIENTS = 300
AUDIT_CANARIES = 100
AUDIT_EPOCHS = 30
AUDIT_BATCH = 64
METRICS = ("attack_auc", "tpr_at_1pct_fpr", "epsilon_lower_bound", "epsilon_claimed")


def sample_units(data: Any, *, units: int, seed: int) -> Any:
    """At most `units` privacy units (patients with all their records, or records)."""
    rng = np.random.default_rng(seed)
    if data.patient_ids is None:
        if len(data) <= units:
            return data
        return data.subset(np.sort(rng.choice(len(data), size=units, replace=False)))
    patients = np.unique(data.patient_ids)
    if patients.size <= units:
        return data
    chosen = rng.choice(patients, size=units, replace=False)
    return data.subset(np.flatnonzero(np.isin(data.patient_ids, chosen)))


def audit_line(no_dp: float, dp: float, epsilon: float) -> str:
    return f"membership inference AUC: no DP {no_dp:.2f}, DP eps={epsilon:g} {dp:.2f}"


def skipped(reason: str) -> dict[str, Any]:
    return {"skipped": True, "reason": reason}


def demo_audit(
    datasets: dict[str, Any], *, epsilon: float, delta: float, seed: int, model: Any = None
) -> dict[str, Any]:
    """Audit non-private and DP training on the first site's sampled records, with the
    study's model (`site_agent.audit.AuditModel`) or the default tabular one.

    A failure (a site too small for DP training, say) is reported as skipped with its
    reason: the audit illustrates the guarantee, the federation does not depend on it.
    """
    site = sorted(datasets)[0]
    started = time.monotonic()
    data = sample_units(datasets[site], units=AUDIT_PATIENTS, seed=seed)
    unit = "record" if data.patient_ids is None else "patient"
    results: dict[str, dict[str, Any]] = {}
    try:
        # Before any training: the site's own units alone must be enough for DP-SGD.
        check_cohort_size(data.num_patients, delta=delta, unit=unit, file=data.source or None)
        # site_agent.audit imports torch and Opacus: loaded only once there is something to train
        from site_agent.audit import run_audit

        for name, target in (("no_dp", None), ("dp", epsilon)):
            settings = AuditSettings(
                canaries=AUDIT_CANARIES, epochs=AUDIT_EPOCHS, batch_size=AUDIT_BATCH,
                epsilon=target, delta=delta,
            )
            # A fixed seed keeps the demo's figures reproducible; this audit's models are
            # thrown away, so its noise protects nothing that is released.
            report = run_audit(data, settings, seed=seed, model=model).as_dict()
            results[name] = {k: report[k] for k in (*METRICS, "privacy_unit")}
    except MedfedError as exc:
        return skipped(f"{site}: {exc}")
    return {
        "skipped": False,
        "method": "one-run audit (Steinke, Nasr, Jagielski, NeurIPS 2023), 95% confidence",
        "site": site,
        "units": data.num_patients,
        "records": len(data),
        "canaries": AUDIT_CANARIES,
        "epochs": AUDIT_EPOCHS,
        "epsilon": epsilon,
        "delta": delta,
        "no_dp": results["no_dp"],
        "dp": results["dp"],
        "line": audit_line(results["no_dp"]["attack_auc"], results["dp"]["attack_auc"], epsilon),
        "seconds": round(time.monotonic() - started, 1),
    }


def privacy_audit(demo: Demo, datasets: dict[str, Any]) -> dict[str, Any]:
    """The demo's audit on one site's records with the study's encoding and model, its
    lines said; skipped with ``--no-audit`` and on images."""
    if not demo.o.audit:
        return skipped("--no-audit")
    if not all(isinstance(d, SiteData) for d in datasets.values()):
        return skipped("the audit runs on tables; image data is not audited yet")
    demo.say("[audit] membership inference on one site's records, without DP and with "
             f"DP at epsilon {demo.o.budget_epsilon:g} ...")
    # site_agent.audit imports torch and Opacus: loaded only when the audit runs
    from site_agent.audit import study_audit_model

    model = study_audit_model(demo.study)  # the study's encoding and model
    result = demo_audit(datasets, epsilon=demo.o.budget_epsilon, delta=demo.o.delta,
                        seed=demo.o.seed, model=model)
    demo.say(f"[audit] {result.get('line') or 'skipped: ' + str(result.get('reason'))}")
    return result
