"""Shared builders for the study tests: a hospital-style CSV, a study, statistics.

`noiseless_statistics` fits preprocessing statistics on one file without any noise. It
exists for tests only: the product takes `GlobalStatistics` from the federated DP
release or a model bundle, never from a site's own data.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from common.releases.seam import release_kind, study_noise_sites, sum_noise_sigmas
from common.releases.statistics import TableLike, unit_values
from common.study import (
    CategoricalStatistics,
    GlobalStatistics,
    NumericStatistics,
    Study,
    study_from_mapping,
    study_sha256,
)
from site_agent.data import StudyTable

COLUMNS = ["Patient-ID", "Age (years)", "Sex", "Lactate mmol/L", "Admission type", "Outcome"]
ADMISSION = ["elective", "emergency", "transfer"]


def hospital_rows(n_patients: int, *, seed: int, missing_rate: float = 0.08) -> list[list[str]]:
    """Records of a made-up hospital: two visits per patient, string labels no/yes, a
    string categorical column, some missing lactate and admission values."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_patients):
        age = rng.integers(18, 95)
        sex = "F" if rng.random() < 0.5 else "M"
        for _visit in range(2):
            admission = ADMISSION[int(rng.integers(0, 3))]
            lactate = rng.gamma(2.0, 1.0)
            risk = (
                0.04 * (age - 60) + 0.9 * (lactate - 2) + (0.8 if admission == "emergency" else 0)
            )
            outcome = "yes" if rng.random() < 1 / (1 + math.exp(-risk)) else "no"
            lactate_cell = "" if rng.random() < missing_rate else f"{lactate:.2f}"
            admission_cell = "NA" if rng.random() < missing_rate else admission
            rows.append([f"H{seed}-{p:05d}", str(age), sex, lactate_cell, admission_cell, outcome])
    return rows


def write_hospital_csv(path: Path, n_patients: int = 120, *, seed: int = 1) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(hospital_rows(n_patients, seed=seed))
    return path


def study_mapping(**privacy: Any) -> dict[str, Any]:
    return {
        "study": {"name": "sepsis-pilot", "rounds": 3, "classes": ["no", "yes"]},
        "data": {"label_column": "Outcome", "patient_column": "Patient-ID"},
        "features": [
            {"name": "Age (years)", "type": "numeric", "range": [18, 100]},
            {"name": "Sex", "type": "categorical", "levels": ["F", "M"]},
            {"name": "Lactate mmol/L", "missing": "indicator"},
            {
                "name": "Admission type",
                "type": "categorical",
                "levels": ADMISSION,
                "missing": "impute",
            },
        ],
        "model": {"name": "mlp", "hidden": [16]},
        "privacy": {"unit": "patient", "epsilon": 4.0, "delta": 1e-3, **privacy},
    }


def hospital_csvs(root: Path, sites: list[str], n_patients: int = 120) -> dict[str, Path]:
    """One hospital file per site, ROOT/SITE.csv, each its own patients (seeds 1, 2, ...)."""
    return {site: write_hospital_csv(root / f"{site}.csv", n_patients, seed=index + 1)
            for index, site in enumerate(sites)}


def study_toml(
    name: str, *, rounds: int, unit: str = "patient", hidden: int = 8,
    training: dict[str, Any] | None = None, **privacy: Any,
) -> str:
    """`study_mapping`'s four-feature hospital study as the study.toml a coordinator
    serves and sites check their files against. Defaults as the process tests run it:
    epsilon 8 at delta 1e-5, a hidden layer of 8, no final evaluation round;
    `privacy` adds or overrides [privacy] keys."""
    mapping = study_mapping(unit=unit, **{"epsilon": 8.0, "delta": 1e-5, **privacy})
    mapping["study"].update(name=name, rounds=rounds)
    mapping["model"]["hidden"] = [hidden]
    mapping["training"] = {"final_evaluation": False} if training is None else training
    study_from_mapping(mapping, source="tests.study.helpers.study_toml")  # valid
    lines: list[str] = []
    for section in ("study", "data", "features", "model", "training", "privacy"):
        tables = mapping[section] if section == "features" else [mapping[section]]
        for table in tables:
            lines += ["", "[[features]]" if section == "features" else f"[{section}]"]
            lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines[1:]) + "\n"


def hospital_study() -> Study:
    return study_from_mapping(study_mapping(), source="test")


def noiseless_statistics(study: Study, table: StudyTable) -> GlobalStatistics:
    """TEST ONLY: statistics fitted on one table without noise (see the module doc)."""
    numeric = {}
    for spec in study.features:
        if spec.type != "numeric":
            continue
        values = table.numeric[spec.name]
        observed = values[~np.isnan(values)]
        if spec.range == "auto":
            low, high = float(observed.min()), float(observed.max())
        else:
            low, high = spec.range
        clipped = np.clip(observed, low, high)
        numeric[spec.name] = NumericStatistics(
            mean=float(clipped.mean()),
            scale=float(clipped.std()) or 1.0,
            impute=float(np.median(clipped)),
            clip_low=low,
            clip_high=high,
        )
    categorical = {}
    for spec in study.features:
        if spec.type != "categorical":
            continue
        codes = table.categorical[spec.name]
        counts = np.bincount(codes[codes >= 0], minlength=len(spec.levels or ()))
        categorical[spec.name] = CategoricalStatistics(
            impute=(spec.levels or ())[int(np.argmax(counts))]
        )
    return GlobalStatistics(
        study_sha256=study_sha256(study),
        source="test: noiseless fit on one file",
        numeric=numeric,
        categorical=categorical,
    )


def privacy_card(study: Study) -> Any:
    from common.releases.bundle import GroupGuarantee, PrivacyCard, SecAggCard, SitePrivacy

    return PrivacyCard(
        unit=study.privacy.unit,
        accountant="prv",
        mechanisms=("sampled-gaussian (DP-SGD)", "gaussian (evaluation histograms)"),
        rounds=study.study.rounds,
        sites=(
            SitePrivacy(site="st-marys", epsilon=3.2, delta=1e-5),
            SitePrivacy(site="county", epsilon=2.9, delta=1e-5),
        ),
        group_guarantees=(
            GroupGuarantee(unit="hospital", epsilon=12.8, delta=4e-5, note="4-fold group"),
        ),
        secagg=SecAggCard(threshold=2, neighbours=2, max_colluding_sites=1, ring_bits=32),
        statistics_release="test: noiseless fit",
    )


def trained_bundle(train_csv: Path, *, steps: int = 300) -> Any:
    """A real TabularMLP trained (non-privately, for speed) on one hospital's file."""
    import torch

    from common.models.architecture import architecture_from_study
    from common.releases.bundle import ModelBundle, Threshold
    from site_agent.data import Preprocessor, load_study_table
    from site_agent.predict import build_model

    torch.manual_seed(0)
    study = hospital_study()
    table = load_study_table(train_csv, study)
    stats = noiseless_statistics(study, table)
    data = Preprocessor(study, stats).site_data(table)
    arch = architecture_from_study(study)
    model = build_model(arch)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.from_numpy(data.features)
    y = torch.from_numpy(data.labels.astype(np.float32))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    parameters = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return ModelBundle(
        study=study,
        architecture=arch,
        statistics=stats,
        threshold=Threshold(value=0.45, method="youden-dp-roc", histogram_bins=20),
        card=privacy_card(study),
        parameters=parameters,
        round=study.study.rounds,
        final=True,
    )


# ------------------------------------------------------------- oracles of the release


def ring_to_signed(aggregate: np.ndarray) -> np.ndarray:
    """The uint32 ring sum of integer vectors (noise may be negative) as int64: what
    `common.releases.egress.EgressManifest.decode_integers` reads, written out."""
    assert aggregate.dtype == np.uint32
    return aggregate.view(np.int32).astype(np.int64)


def clipped_sums(table: TableLike, study: Study) -> dict[str, float]:
    """Noiseless sum over units of each declared-range numeric value clipped into its
    range (what the statistics release estimates, before rounding and noise): one unit
    moves it by at most max(|low|, |high|)."""
    _, numeric, _ = unit_values(table, study)
    out = {}
    for spec in study.features:
        if spec.type == "numeric" and spec.range != "auto":
            low, high = spec.range
            values = numeric[spec.name]
            values = values[~np.isnan(values)]
            out[spec.name] = float(np.clip(values, low, high).sum())
    return out


def release_noise_sigma(study: Study, *, contributors: int) -> float:
    """Std of the noise on each entry of the secure sum of `contributors` statistics
    releases, every member having planned for the study's n_noise (the seam's
    `sum_noise_sigmas` of the registered statistics release, one block)."""
    release = release_kind("statistics").build(study)  # type: ignore[misc]
    (sigma,) = sum_noise_sigmas(release, contributors=contributors,
                                noise_sites=study_noise_sites(study))
    return sigma
