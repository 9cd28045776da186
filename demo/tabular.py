"""The tabular demo: the embedded synthetic sepsis cohort written as one CSV per site, or
one CSV per site from ``--data DIR``; either way a study (declared for the cohort, drafted
from the files: `demo.study`) served with `coordinator serve --study`, every site enrolled
into it as a hospital is."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from common.commands.study import render_study_toml
from common.core.errors import ConfigError
from common.releases.bundle import read_bundle
from demo.hospital import hospital_study
from demo.options import HELD_OUT_FRACTION, HISTOGRAM_BINS, DemoOptions
from demo.study import draft_demo_study, exact_statistics, synthetic_demo_study
from demo.tasks import Demo
from site_agent.data import Preprocessor, load_study_table
from site_agent.synthetic import generate_cohort, site_names, write_site_csvs
from site_agent.unit_split import held_out_mask, study_record_keys


class TabularTask:
    """``--task tabular`` (the default)."""

    name = "tabular"
    histogram_bins = HISTOGRAM_BINS
    centralized_label = "Centralized logistic regression (no DP)"

    def prepare(self, demo: Demo) -> dict[str, Path | None]:
        """Site ids and their data files (the synthetic cohort's are written here)."""
        if demo.out.exists():
            shutil.rmtree(demo.out)
        demo.out.mkdir(parents=True)
        o = demo.o
        if o.data is not None:
            files = {p.stem: p.resolve() for p in sorted(o.data.glob("*.csv"))}
            if len(files) < 2:
                raise ConfigError("--data", f"need at least 2 site CSVs (one per site) in "
                                            f"{o.data}, found {len(files)}")
            self.draft_study(demo, files)
            return dict(files)
        names = site_names(o.sites)
        folder = demo.out / "cohort"
        written = write_site_csvs(folder, generate_cohort(
            names, seed=o.seed, patients_per_site=o.patients_per_site))
        demo.say(f"[setup] synthetic sepsis cohort: {len(names)} hospitals x "
                 f"{o.patients_per_site:,} patients, several encounters each, "
                 f"non-IID ({', '.join(names)}); one CSV per hospital in {folder}")
        study = synthetic_demo_study(
            name="medfed-demo", rounds=o.rounds, epsilon=o.budget_epsilon, delta=o.delta,
            histogram_bins=HISTOGRAM_BINS, local_epochs=o.local_epochs,
            learning_rate=o.learning_rate, batch_size=o.batch_size,
        )
        self.serve_study(demo, study, what="declared for the cohort")
        return {site: path.resolve() for site, path in written.items()}

    def draft_study(self, demo: Demo, files: dict[str, Path]) -> None:
        """`--data DIR`: the study drafted from the files (demo.study)."""
        o = demo.o
        study, notes = draft_demo_study(
            files, name="medfed-demo", label_column=o.label_column,
            patient_column=o.patient_column, rounds=o.rounds,
            epsilon=o.budget_epsilon, delta=o.delta, histogram_bins=HISTOGRAM_BINS,
        )
        self.serve_study(demo, study, what="drafted from the files")
        for note in notes:
            demo.say(f"[setup]   {note} (read from the demo's files; a real study declares it)")

    def serve_study(self, demo: Demo, study: Any, *, what: str) -> None:
        """Write the study every site is enrolled into; the coordinator serves it."""
        o = demo.o
        if o.privacy_unit == "hospital":
            study = hospital_study(study, o)
        # The threat terms every site sizes its noise with: the demo sites' own policy.
        policy = demo.terms.policy
        study = study.model_copy(update={"privacy": study.privacy.model_copy(update={
            "max_colluding_sites": policy.max_colluding_sites,
            "min_round_sites": policy.min_round_sites})})
        demo.served_study = demo.out / "study.toml"
        demo.served_study.write_text(render_study_toml(study), encoding="utf-8")
        demo.study = study
        demo.say(f"[setup] study {demo.served_study} ({what}): {len(study.features)} "
                 f"features, label {study.data.label_column!r}, {study.privacy.unit}-level "
                 "DP; served with `coordinator serve --study`, sites enrolled into it")

    def load_datasets(
        self, demo: Demo, files: dict[str, Path | None]
    ) -> tuple[dict[str, Any], list[str]]:
        """The same records the sites train on, for the in-process baselines."""
        study = demo.study
        tables = {s: load_study_table(p, study) for s, p in files.items() if p}
        self.tables = tables
        preprocess = Preprocessor(study, exact_statistics(tables, study, seed=demo.o.seed))
        datasets = {s: preprocess.site_data(t) for s, t in tables.items()}
        # Without a patient column the sites key each record by its values as read.
        self.units = {s: study_record_keys(t) for s, t in tables.items()
                      if t.patient_ids is None}
        return datasets, preprocess.feature_names()

    def baselines(self, demo: Demo, datasets: dict[str, Any]) -> dict[str, dict[str, float]]:
        return compute_baselines(datasets, demo.o, keys=demo.split_keys,
                                 units=getattr(self, "units", None), study=demo.study)

    def site_config(self, demo: Demo, site: str, data: Path | None) -> str:
        o = demo.o
        # The study (label, patient column, features, model, training) comes at enrolment.
        return f"""[data]
path = "{data}"

[privacy]
budget_epsilon = {o.budget_epsilon}
delta = {o.delta}
{'privacy_unit = "hospital"' if o.privacy_unit == "hospital" else ""}

[policy]
min_round_sites = {demo.terms.policy.min_round_sites}
max_colluding_sites = {demo.terms.policy.max_colluding_sites}
allow_open_membership = false

[training]
max_physical_batch_size = 4096
device = "cpu"
"""

    def exact_final(self, demo: Demo, bundle: Path) -> dict[str, Any]:
        """`DemoTask.exact_final`: the bundle scores every site's held-out records as
        `medfed predict` would (its own DP statistics encode them), pooled."""
        # site_agent.predict imports torch: loaded only to score the final model
        from site_agent.predict import load_model, prediction_from_scores, score_table

        model_bundle = read_bundle(bundle)
        model = load_model(model_bundle)
        scores: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        for site, table in sorted(self.tables.items()):
            units = (self.units[site] if table.patient_ids is None
                     else np.asarray(table.patient_ids, dtype=object))
            held = table.subset(np.flatnonzero(held_out_mask(
                units, key=demo.split_keys[site], held_out_fraction=HELD_OUT_FRACTION)))
            if held.labels is None:  # the demo's tables are read with their labels
                raise ConfigError("--label-column", f"{site}: no labels to evaluate")
            scores.append(score_table(model, model_bundle, held))
            labels.append(held.labels)
        found = prediction_from_scores(model_bundle, np.concatenate(scores),
                                       np.concatenate(labels)).metrics
        return dict(found or {})

    def finish_report(self, demo: Demo, report: dict[str, Any]) -> None:
        """The tabular report is complete as written."""


def compute_baselines(
    datasets: dict[str, Any], o: DemoOptions, *, keys: dict[str, bytes],
    units: dict[str, Any] | None = None, study: Any = None,
) -> dict[str, dict[str, float]]:
    """Centralized and federated non-private baselines, in process (no DP, no SecAgg), on
    the sites' own splits (`keys`: each site's split key; `units`: a site's unit ids when
    not its records' own); the federated one trains the served `study`'s network with
    its settings."""
    # site_agent.baselines imports torch and Opacus: loaded only to train the baselines
    from site_agent.baselines import centralized_nodp, federated_nodp

    return {
        "centralized_nodp": centralized_nodp(datasets, o, keys=keys, units=units,
                                             bins=HISTOGRAM_BINS),
        "federated_nodp": federated_nodp(datasets, o, keys=keys, units=units,
                                         bins=HISTOGRAM_BINS, study=study),
    }
