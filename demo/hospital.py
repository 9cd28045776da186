"""The demo under hospital-level DP (``--privacy-unit hospital``): the study's privacy
section (its z planned from the study's epsilon) and the three figures the report gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.privacy.hospital import guarantees
from common.privacy.ledger import read_ledger
from common.study import StudyPrivacySection
from demo.options import DemoOptions


def hospital_figures(hospital: dict[str, Any]) -> str:
    """The table row's privacy figures under hospital-level DP: the largest hospital-level
    and per-patient epsilon over the sites (the budget is charged with the per-patient
    figure, which counts the updates at 2S, and so caps it)."""
    whole = max(hospital.get("epsilon", {}).values(), default=0.0)
    patient = max(hospital.get("per_patient_epsilon", {}).values(), default=0.0)
    return f"hospital eps {whole:.2f}, per-patient eps {patient:.2f}"


def intermediaries_label(hospital: dict[str, Any]) -> str:
    """The table row's suffix naming the intermediaries: fixed v, or v per round."""
    v = hospital.get("intermediaries", 1)
    if v == "auto":
        chosen = hospital.get("intermediaries_by_round", {})
        return ", v auto per round " + (
            "/".join(str(x) for x in chosen.values()) if chosen else "-")
    return f", v={v}" if v != 1 else ""


def hospital_report(out: Path, sites: list[str], o: DemoOptions) -> dict[str, Any]:
    """Each site's three hospital-mode figures from its own ledger
    (`common.privacy.hospital.guarantees`): hospital-level and intermediary-level (model
    updates only) and per-patient (every release, the updates at 2S)."""
    epsilon: dict[str, float] = {}
    intermediary: dict[str, float] = {}
    per_patient: dict[str, float] = {}
    for site in sites:
        path = out / "sites" / site / "privacy-ledger.db"
        if not path.exists():
            epsilon[site] = intermediary[site] = per_patient[site] = 0.0
            continue
        header, entries = read_ledger(path)
        pairs = [(e.purpose, tuple(getattr(e, "mechanisms", ()))) for e in entries]
        figures = guarantees(pairs, delta=header.delta, accountant=header.accountant)
        epsilon[site] = figures.hospital
        intermediary[site] = figures.intermediary
        per_patient[site] = figures.per_patient
    return {"epsilon": epsilon, "intermediary_epsilon": intermediary,
            "per_patient_epsilon": per_patient,
            "intermediaries": o.intermediaries, "update_clip_norm": o.update_clip_norm,
            "note": ("hospital-level and intermediary-level epsilon cover the model updates "
                     "only; per-patient composes every release with the updates at 2S, and "
                     "is what the budget (epsilon by site above) is charged with")}


def hospital_study(study: Any, o: DemoOptions) -> Any:
    """The drafted study under hospital-level DP: unit hospital, clip S and
    the intermediaries per hospital; z is planned from the study's epsilon."""
    privacy = StudyPrivacySection.model_validate({
        **study.privacy.model_dump(), "unit": "hospital",
        "update_clip_norm": o.update_clip_norm, "intermediaries": o.intermediaries,
    })
    return study.model_copy(update={"privacy": privacy})
