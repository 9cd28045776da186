"""The demo's report: report.json, the AUC and epsilon plots, and the printed table."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.privacy.layered import charged_by_purpose
from common.privacy.ledger import read_ledger
from common.releases.bundle import read_bundle
from common.releases.evaluation_interval import interval_text
from coordinator.store import CoordinatorStore
from demo.hospital import hospital_figures, hospital_report, intermediaries_label
from demo.tasks import Demo


def write_report(demo: Demo, sites: list[str], baselines: dict[str, dict[str, float]]) -> dict[
    str, Any
]:
    rows = demo.follower.rows
    final_row = rows[-1] if rows else None
    final_metrics = dict(final_row.metrics) if final_row else {}
    eps = epsilon_by_site(demo.out, sites)
    model = model_file(demo)
    report: dict[str, Any] = {
        "sites": sites,
        "privacy_unit": "hospital" if demo.o.privacy_unit == "hospital" else (
            "patient" if demo.o.patient_column else "record"),
        "delta": demo.o.delta,
        "rounds": [
            {
                "round": r.round,
                "participants": r.participants,
                "dropped": r.dropped,
                "secure_aggregation": r.secure_aggregation,
                "evaluation_only": r.evaluation_only,
                "auc": r.auc,
                "auc_interval_low": r.metrics.get("auc_interval_low"),
                "auc_interval_high": r.metrics.get("auc_interval_high"),
                "epsilon": r.epsilon,
                "intermediaries": r.intermediaries,
            }
            for r in rows
        ],
        "aborted_rounds": demo.follower.aborted,
        "study": str(demo.served_study) if demo.served_study else None,
        "statistics_round": demo.follower.statistics_round,
        "evaluation_round": next(
            (r.round for r in rows if r.evaluation_only), None
        ),
        "model": model,
        "threshold": model.get("threshold") if model else None,
        "final": {
            **{k: final_metrics.get(k) for k in ("auc", "sensitivity", "specificity", "ppv",
                                                "auc_interval_low", "auc_interval_high")},
            "epsilon": eps,
            # Each purpose composed alone (they do not add up to "epsilon").
            "epsilon_by_purpose": epsilon_by_purpose(demo, sites),
            "budget": {s: demo.o.budget_epsilon for s in sites},
        },
        "baselines": baselines,
        "privacy_audit": demo.audit,
        "seconds": round(time.monotonic() - demo.started, 1),
    }
    if demo.o.privacy_unit == "hospital":
        report["hospital"] = hospital_report(demo.out, sites, demo.o)
        report["hospital"]["intermediaries_by_round"] = {
            str(r.round): r.intermediaries for r in rows
            if r.intermediaries is not None
        }
    if model is not None and model.get("kind") == "final bundle":
        report["final"]["exact"] = demo.task.exact_final(demo, Path(model["path"]))
    (demo.out / "report.json").write_text(json.dumps(report, indent=2, default=_json))
    plot(demo, report)
    print_table(demo, report)
    return report


def epsilon_by_purpose(demo: Demo, sites: list[str]) -> dict[str, dict[str, float]]:
    """Each site's epsilon per ledger purpose (training, evaluation, statistics,
    count), each purpose's entries composed ALONE as the ledger charges them (hospital
    mode: the model updates at 2S, per patient): they do not add up to the total."""
    out: dict[str, dict[str, float]] = {}
    for site in sites:
        path = demo.out / "sites" / site / "privacy-ledger.db"
        if not path.exists():
            out[site] = {}
            continue
        header, entries = read_ledger(path)
        out[site] = charged_by_purpose(
            [(e.purpose, e.mechanisms) for e in entries], delta=header.delta,
            accountant=header.accountant, charge=header.charge)
    return out


def epsilon_by_site(out: Path, sites: list[str]) -> dict[str, float]:
    """Each site's epsilon spent so far, from its ledger under the demo's folder `out`
    (0 before its ledger exists)."""
    spent = {}
    for site in sites:
        path = out / "sites" / site / "privacy-ledger.db"
        if not path.exists():
            spent[site] = 0.0
            continue
        _, entries = read_ledger(path)
        spent[site] = entries[-1].epsilon_after if entries else 0.0
    return spent


def model_file(demo: Demo) -> dict[str, Any] | None:
    """The model the study produced: the coordinator's final bundle when there is
    one (with its decision threshold), else its latest checkpoint (no threshold)."""
    state = demo.out / "coordinator"
    bundle = state / "model" / "final.safetensors"
    if bundle.is_file():
        threshold = read_bundle(bundle).threshold.value
        return {"path": str(bundle), "kind": "final bundle",
                "sha256": hashlib.sha256(bundle.read_bytes()).hexdigest(),
                "threshold": threshold}
    database = state / "coordinator.db"
    if not database.is_file():
        return None
    store = CoordinatorStore(f"sqlite:///{database}")
    try:
        checkpoint = store.latest_checkpoint()
    finally:
        store.close()
    if checkpoint is None:
        return None
    # The store records the digest of the tensor bytes; the report gives the FILE's
    # sha256, which is what someone checking the file they were sent computes.
    return {"path": str(checkpoint.path), "kind": "latest checkpoint (no bundle)",
            "round": checkpoint.round_number,
            "sha256": hashlib.sha256(Path(checkpoint.path).read_bytes()).hexdigest(),
            "threshold": None}


def _mark_rounds(ax: Any, report: dict[str, Any]) -> None:
    """Aborted rounds (red dotted) and the evaluation-only round (shaded)."""
    for index, aborted in enumerate(report["aborted_rounds"]):
        ax.axvline(aborted["round"], color="tab:red", linestyle=":", linewidth=1.2,
                   label="aborted round" if index == 0 else None)
    evaluation = report.get("evaluation_round")
    if evaluation is not None:
        ax.axvspan(evaluation - 0.3, evaluation + 0.3, color="tab:blue", alpha=0.12,
                   label="evaluation-only round")


def plot(demo: Demo, report: dict[str, Any]) -> None:
    # matplotlib: loaded only for the plots at the end of a run, never by `medfed --help`
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib.pyplot: after the file-only backend is chosen
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rounds = [r for r in report["rounds"] if r["auc"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r["round"] for r in rounds], [r["auc"] for r in rounds], marker="o",
            label="federated, DP + SecAgg+")
    colours = {"centralized_nodp": "tab:gray", "federated_nodp": "tab:green"}
    for name, m in report["baselines"].items():
        ax.axhline(m["auc"], linestyle="--", linewidth=1, color=colours.get(name, "black"),
                   label=name.replace("_", " "))
    _mark_rounds(ax, report)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (AUC of the global model entering it)")
    ax.set_ylabel("AUC (federation held-out, secure histograms)")
    # Outside the axes: a legend never hides a line.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, borderaxespad=0)
    fig.tight_layout()
    fig.savefig(demo.out / "auc_by_round.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    styles = ("-", "--", "-.", ":")
    markers = ("o", "s", "^", "D", "v", "P", "X", "*")
    # Every site's line starts at (0, 0): nothing spent before the first round.
    # Sites that spend alike would hide each other: each is shifted a little in x.
    xs = [0] + [r["round"] for r in report["rounds"]]
    n_sites = len(report["sites"])
    for index, site in enumerate(report["sites"]):
        shift = 0.12 * (index - (n_sites - 1) / 2) / max(n_sites - 1, 1)
        ys = [0.0] + [r["epsilon"].get(site, 0.0) for r in report["rounds"]]
        ax.plot([x + shift for x in xs], ys, linestyle=styles[index % len(styles)],
                marker=markers[index % len(markers)], markersize=5, label=site)
    ax.axhline(demo.o.budget_epsilon, color="black", linestyle="--", linewidth=1,
               label="budget")
    _mark_rounds(ax, report)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=-0.1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (sites offset slightly so equal spends stay visible)")
    ax.set_ylabel(f"epsilon spent (delta={demo.o.delta:g}, composed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, borderaxespad=0)
    fig.tight_layout()
    fig.savefig(demo.out / "epsilon_by_round.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def dp_auc_text(metrics: dict[str, Any]) -> str:
    """A DP AUC as the demo prints it: with its 95% interval, or "too noisy to read"
    (`common.releases.evaluation_interval.interval_text`)."""
    auc, low, high = (metrics.get(k) for k in ("auc", "auc_interval_low", "auc_interval_high"))
    if not isinstance(auc, float):
        return "-"
    if isinstance(low, float) and isinstance(high, float):
        return interval_text(auc, low, high)
    return f"{auc:.3f}"


def baseline_label(demo: Demo, name: str) -> str:
    """How the table and the [baseline] lines name a baseline of `report["baselines"]`."""
    return {"centralized_nodp": demo.task.centralized_label,
            "federated_nodp": "Federated (no DP)"}.get(name, name)


def print_table(demo: Demo, report: dict[str, Any]) -> None:
    """The privacy/utility table: the non-private baselines and the DP model, each on
    every hospital's held-out patients, exact (the demo holds every hospital's data); the
    DP model's row at its bundle's threshold, then the gap to centralized training and
    the federation's own DP estimate of the same AUC (all a real consortium sees)."""
    cols = ("auc", "sensitivity", "specificity", "ppv")
    final = report["final"]
    exact = final.get("exact")
    rows = [
        *((baseline_label(demo, name), report["baselines"][name])
          for name in ("centralized_nodp", "federated_nodp")),
        (f"Federated + DP (eps<={demo.o.budget_epsilon:g}) + SecAgg+"
         if "hospital" not in report else
         f"Federated + hospital-level DP (budget {demo.o.budget_epsilon:g}; "
         f"{hospital_figures(report['hospital'])}) "
         "+ SecAgg+" + intermediaries_label(report["hospital"]),
         exact if exact else final),
    ]
    width = max(len(r[0]) for r in rows) + 2
    demo.say("")
    demo.say(f"{'Metric':<{width}}" + "".join(f"{c.upper():>13}" for c in cols))
    for name, metrics in rows:
        values = "".join(
            f"{metrics[c]:>13.3f}" if isinstance(metrics.get(c), float) else f"{'-':>13}"
            for c in cols
        )
        demo.say(f"{name:<{width}}{values}")
    central = report["baselines"]["centralized_nodp"].get("auc")
    if exact and isinstance(exact.get("auc"), float) and isinstance(central, float):
        chosen = (report.get("model") or {}).get("threshold")
        where = (f"its bundle's threshold, {chosen:.3f}, chosen from the DP evaluation"
                 if isinstance(chosen, float) else
                 "0.5 (its bundle carries no threshold)")
        demo.say("(every row: exact, on the same held-out patients; the baselines at "
                 f"Youden's point of their exact scores, the DP model at {where})")
        demo.say(f"DP model against centralized training without DP: AUC "
                 f"{exact['auc'] - central:+.3f} ({exact['auc']:.3f} vs {central:.3f})")
    if isinstance(final.get("auc"), float):
        demo.say(f"Federated + DP AUC as the federation reads it: {dp_auc_text(final)} "
                 "(its DP evaluation of the same held-out patients, one record each; "
                 "the 95% interval holds the exact held-out AUC: DP noise on the released "
                 "counts, simulated, plus the score buckets' resolution)")
    audit = report.get("privacy_audit") or {}
    if audit.get("skipped", True):
        demo.say(f"membership inference AUC: not measured ({audit.get('reason', '-')})")
    else:
        demo.say(f"{audit['line']} (one-run audit on {audit['site']}: epsilon lower bound "
                 f"{audit['no_dp']['epsilon_lower_bound']:.2f} without DP, "
                 f"{audit['dp']['epsilon_lower_bound']:.2f} with DP at 95%)")
    demo.say("")
    demo.say(f"Privacy ({report['privacy_unit']}-level DP, delta={demo.o.delta:g}; "
             "per purpose: each composed alone):")
    for site in report["sites"]:
        spent = report["final"]["epsilon"][site]
        budget = report["final"]["budget"][site]
        purposes = report["final"].get("epsilon_by_purpose", {}).get(site, {})
        split = ", ".join(f"{p} {e:.2f}" for p, e in purposes.items())
        demo.say(f"  {site:<18} epsilon {spent:6.2f} of {budget:g} "
                 f"({100 * spent / budget:4.0f}% of budget)" + (f"; {split}" if split else ""))
    if "hospital" in report:
        print_hospital(demo, report["hospital"])
    demo.say(f"\nReport: {demo.out / 'report.json'}; plots: auc_by_round.png, "
             f"epsilon_by_round.png ({report['seconds']:.0f} s)")


def print_hospital(demo: Demo, hospital: dict[str, Any]) -> None:
    """The three hospital-mode figures per site, each with the relation it holds for
    (the budget rows above are each ledger's charge: the per-patient figure)."""
    v = hospital["intermediaries"]
    if v == "auto":
        largest = max(hospital.get("intermediaries_by_round", {}).values(), default=1)
        fold = f"each round v-fold, largest v {largest}"
    else:
        fold = f"{v}-fold" if v != 1 else "v = 1: same as intermediary-level"
    demo.say("  the epsilons above are each budget's charge (the per-patient figure: "
             "every release, model updates at 2S); three figures per site:")
    demo.say(f"  {'site':<18} {'hospital':>9} {'intermed.':>9} {'patient':>9}   "
             f"hospital = add/remove one hospital ({fold}), intermediary = add/remove "
             "one unit (both MODEL UPDATES ONLY); patient = every release, updates at 2S")
    units = hospital.get("intermediary_epsilon", {})
    patients = hospital.get("per_patient_epsilon", {})
    for site, value in hospital["epsilon"].items():
        unit = units.get(site, value)
        patient = patients.get(site)
        demo.say(f"  {site:<18} {value:9.2f} {unit:9.2f} "
                 + (f"{patient:9.2f}" if patient is not None else f"{'-':>9}"))


def _json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)

