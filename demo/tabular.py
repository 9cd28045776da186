"""The tabular demo: the embedded synthetic sepsis cohort, or one CSV per site from
``--data DIR`` with a study drafted from the files (`demo.study`) and served with
`coordinator serve --study`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import ConfigError
from demo.hospital import hospital_study
from demo.options import HISTOGRAM_BINS, DemoOptions
from demo.terms import federation_terms

if TYPE_CHECKING:
    from demo.run import Demo


class TabularTask:
    """``--task tabular`` (the default)."""

    name = "tabular"
    histogram_bins = HISTOGRAM_BINS

    def prepare(self, demo: Demo) -> dict[str, Path | None]:
        """Site ids and their data files (None: the site's slice of the embedded cohort)."""
        if demo.out.exists():
            shutil.rmtree(demo.out)
        demo.out.mkdir(parents=True)
        if demo.o.data is not None:
            files: dict[str, Path | None] = {
                p.stem: p.resolve() for p in sorted(demo.o.data.glob("*.csv"))
            }
            if len(files) < 2:
                raise ConfigError("--data", f"need at least 2 site CSVs (one per site) in "
                                            f"{demo.o.data}, found {len(files)}")
            self.draft_study(demo, {site: path for site, path in files.items() if path})
            return files
        from site_agent.synthetic import site_names

        names = site_names(demo.o.sites)
        demo.say(f"[setup] synthetic sepsis cohort: {len(names)} hospitals x "
                 f"{demo.o.patients_per_site:,} patients, several encounters each, "
                 f"non-IID ({', '.join(names)}); each site generates only its own slice")
        return dict.fromkeys(names)

    def draft_study(self, demo: Demo, files: dict[str, Path]) -> None:
        """`--data DIR`: the study every site is enrolled into (demo.study)."""
        from common.study_cli import render_study_toml
        from demo.study import draft_demo_study

        o = demo.o
        study, notes = draft_demo_study(
            files, name="medfed-demo", label_column=o.label_column,
            patient_column=o.patient_column, rounds=o.rounds,
            epsilon=o.budget_epsilon, delta=o.delta, histogram_bins=HISTOGRAM_BINS,
        )
        if o.privacy_unit == "hospital":
            study = hospital_study(study, o)
        # The threat terms every site sizes its noise with: the demo sites' own policy.
        policy = federation_terms(len(files), histogram_bins=HISTOGRAM_BINS).policy
        study = study.model_copy(update={"privacy": study.privacy.model_copy(update={
            "max_colluding_sites": policy.max_colluding_sites,
            "min_round_sites": policy.min_round_sites})})
        demo.served_study = demo.out / "study.toml"
        demo.served_study.write_text(render_study_toml(study), encoding="utf-8")
        demo.study = study
        demo.say(f"[setup] study {demo.served_study}: {len(study.features)} features, "
                 f"label {o.label_column!r}, {study.privacy.unit}-level DP; served with "
                 "`coordinator serve --study`, sites enrolled into it")
        for note in notes:
            demo.say(f"[setup]   {note} (read from the demo's files; a real study declares it)")

    def load_datasets(
        self, demo: Demo, files: dict[str, Path | None]
    ) -> tuple[dict[str, Any], list[str]]:
        """The same records the sites train on, for the in-process baselines."""
        from site_agent.synthetic import FEATURES, generate_cohort

        sites = sorted(files)
        if demo.o.data is None:
            cohort = generate_cohort(sites, seed=demo.o.seed,
                                     patients_per_site=demo.o.patients_per_site)
            return cohort, list(FEATURES)
        from demo.study import exact_statistics
        from site_agent.data import Preprocessor, load_study_table

        study = demo.study
        tables = {s: load_study_table(p, study) for s, p in files.items() if p}
        preprocess = Preprocessor(study, exact_statistics(tables, study, seed=demo.o.seed))
        datasets = {s: preprocess.site_data(t) for s, t in tables.items()}
        # Without a patient column the sites key each record by its values as read.
        from site_agent.unit_split import study_record_keys

        self.units = {s: study_record_keys(t) for s, t in tables.items()
                      if t.patient_ids is None}
        return datasets, preprocess.feature_names()

    def baselines(self, demo: Demo, datasets: dict[str, Any]) -> dict[str, dict[str, float]]:
        return compute_baselines(datasets, demo.o, keys=demo.split_keys,
                                 units=getattr(self, "units", None))

    def initial_model(self, demo: Demo, n_features: int) -> Path | None:
        """The synthetic cohort's MLP; with ``--data`` the served study gives the model."""
        if demo.served_study is not None:
            return None
        import torch

        from common.modelfile import ModelFile, write_model_file
        from common.models.layout import wire_model
        from common.models.tables.mlp import TabularMLP

        torch.manual_seed(demo.o.seed)
        path = demo.out / "initial-model.mfm"
        write_model_file(path, ModelFile(*wire_model(TabularMLP(n_features))))
        return path

    def site_config(self, demo: Demo, site: str, data: Path | None) -> str:
        o = demo.o
        if demo.served_study is not None:
            # The study (label, patient column, features) comes at enrolment.
            source = f'path = "{data}"\n'
        elif data is None:
            source = (f"synthetic = true\nsynthetic_cohort_seed = {o.seed}\n"
                      f"synthetic_patients = {o.patients_per_site}\n")
        else:
            patient = (f'patient_column = "{o.patient_column}"\n'
                       if o.patient_column else "")
            source = (f'path = "{data}"\nlabel_column = "{o.label_column}"\n'
                      f"{patient}")
        return f"""[data]
{source}
[privacy]
budget_epsilon = {o.budget_epsilon}
delta = {o.delta}
{'privacy_unit = "hospital"' if o.privacy_unit == "hospital" else ""}

[policy]
min_round_sites = {demo.terms.policy.min_round_sites}
max_colluding_sites = {demo.terms.policy.max_colluding_sites}
# Without a study (the synthetic cohort) a site plans its noise for its own
# planned_rounds: the demo's rounds, so the budget is spent by the demo's end.
planned_rounds = {o.rounds}

[training]
batch_size = {o.batch_size}
max_physical_batch_size = 4096
device = "cpu"
"""

    def finish_report(self, demo: Demo, report: dict[str, Any]) -> None:
        """The tabular report is complete as written."""


def compute_baselines(
    datasets: dict[str, Any], o: DemoOptions, *, keys: dict[str, bytes],
    units: dict[str, Any] | None = None,
) -> dict[str, dict[str, float]]:
    """Centralized and federated non-private baselines, in process (no DP, no SecAgg), on
    the sites' own splits (`keys`: each site's split key; `units`: a site's unit ids when
    not its records' own)."""
    from site_agent.baselines import centralized_nodp, federated_nodp

    return {
        "centralized_nodp": centralized_nodp(datasets, o, keys=keys, units=units,
                                             bins=HISTOGRAM_BINS),
        "federated_nodp": federated_nodp(datasets, o, keys=keys, units=units,
                                         bins=HISTOGRAM_BINS),
    }
