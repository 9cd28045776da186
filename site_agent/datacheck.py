"""`medfed data check`: a hospital checks its file against the study, alone and offline.

Runs at the hospital with no coordinator and sends nothing anywhere: the report (exact
counts) is for the hospital's own data manager. A mismatch with the study (missing
column, undeclared level, non-numeric cell, label outside the classes, a missing value
where the study says ``error``) is a `DataError` naming file, row and column; problems
of the cohort as a whole (too few privacy units, delta too large for N) are listed in
the report and make the command exit non-zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.core.config import SiteDataSection, SiteSettings
from common.core.errors import DataError
from common.study import SitePrivacyPolicy, Study, check_study_against_policy
from site_agent.data import StudyTable, check_cohort_size, load_study_table, training_units


@dataclass(frozen=True)
class LevelReport:
    declared: list[str]
    found: dict[str, int]
    unused: list[str]


@dataclass(frozen=True)
class DataReport:
    """What `check_data_against_study` found; `problems` empty means the site may join."""

    file: str
    records: int
    patients: int | None
    privacy_unit: str
    units: int
    missing: dict[str, int]
    levels: dict[str, LevelReport]
    labels: dict[str, int]
    outside_range: dict[str, int]
    delta: float
    max_delta: float
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def check_data_against_study(
    path: str | Path, study: Study, *, delta: float | None = None
) -> DataReport:
    """Check a site's file against `study`; a cell-level mismatch raises `DataError`.

    `delta` defaults to the study's requested delta; the cohort-size rule of
    `site_agent.data` (N >= MIN_PRIVACY_UNITS and delta <= 1/N) is checked on the privacy
    unit: patients when the study has a patient column, records otherwise.
    """
    if study.data.kind == "images":
        return check_images_against_study(path, study, delta=delta)
    table = load_study_table(path, study)
    return report_for_table(table, study, delta=study.privacy.delta if delta is None else delta)


def check_images_against_study(
    folder: str | Path, study: Study, *, delta: float | None = None, decode: bool = True
) -> DataReport:
    """Check an images study's folder: every labels.csv row, every file header and (with
    `decode`) every image's pixels; a bad file is a `DataError` naming it."""
    from site_agent.imaging import image_spec_for_study, load_image_folder

    # No cache: the check touches every image once and keeps none of them.
    data = load_image_folder(folder, image_spec_for_study(study, cache_bytes=0))
    if decode:
        for i in range(len(data)):
            data.image(i)
    delta = study.privacy.delta if delta is None else delta
    problems: list[str] = []
    warnings: list[str] = []
    patients = data.num_patients if data.patient_ids is not None else None
    unit = "patient" if patients is not None else "record"
    units = patients if patients is not None else len(data)
    _check_training_cohort(units, delta=delta, unit=unit, problems=problems)
    counts = np.bincount(data.labels, minlength=len(study.study.classes))
    labels = {str(c): int(counts[i]) for i, c in enumerate(study.study.classes)}
    absent = [name for name, count in labels.items() if count == 0]
    if absent:
        warnings.append(f"no images of class {absent}: this site cannot evaluate AUC")
    return DataReport(
        file=data.source,
        records=len(data),
        patients=patients,
        privacy_unit=unit,
        units=units,
        missing={},
        levels={},
        labels=labels,
        outside_range={},
        delta=delta,
        max_delta=1.0 / units,
        problems=problems,
        warnings=warnings,
    )


def _check_training_cohort(units: int, *, delta: float, unit: str, problems: list[str]) -> None:
    """The one cohort-size rule (site_agent.data's docstring) on the units DP-SGD will
    train on: those left after the held-out split (data.holdout_fraction, default 20%),
    as the site's trainer judges them."""
    held_out = SiteDataSection.model_fields["holdout_fraction"].default
    train = training_units(units, held_out_fraction=held_out)
    try:
        check_cohort_size(train, delta=delta, unit=unit)
    except DataError as exc:
        problems.append(f"{exc.message} (the training split: {units} {unit}s less the "
                        f"{held_out:.0%} held out for evaluation)")


def report_for_table(table: StudyTable, study: Study, *, delta: float) -> DataReport:
    problems: list[str] = []
    warnings: list[str] = []
    patients = table.num_patients if table.patient_ids is not None else None
    unit = "patient" if patients is not None else "record"
    units = patients if patients is not None else len(table)
    if study.privacy.unit == "hospital":
        warnings.append(
            "privacy.unit is 'hospital': the cohort-size check below uses "
            f"{unit}s, the unit DP-SGD may still run on underneath"
        )
    max_delta = 1.0 / units
    _check_training_cohort(units, delta=delta, unit=unit, problems=problems)
    missing = table.missing_counts()
    for name, count in missing.items():
        if count == len(table):
            warnings.append(f"column {name!r}: every value is missing")
    levels: dict[str, LevelReport] = {}
    for spec in study.features:
        if spec.type != "categorical":
            continue
        declared = list(spec.levels or ())
        codes = table.categorical[spec.name]
        counts = np.bincount(codes[codes >= 0], minlength=len(declared))
        found = {level: int(counts[i]) for i, level in enumerate(declared) if counts[i]}
        unused = [level for level in declared if level not in found]
        if unused:
            warnings.append(f"column {spec.name!r}: declared levels never seen here: {unused}")
        levels[spec.name] = LevelReport(declared=declared, found=found, unused=unused)
    outside: dict[str, int] = {}
    for spec in study.features:
        if spec.type == "numeric" and spec.range != "auto":
            values = table.numeric[spec.name]
            low, high = spec.range
            count = int(np.sum((values < low) | (values > high)))  # NaN compares False
            outside[spec.name] = count
            if count:
                warnings.append(
                    f"column {spec.name!r}: {count} values outside the study's range "
                    f"[{low:g}, {high:g}] will be clipped"
                )
    labels: dict[str, int] = {}
    if table.labels is not None:
        label_counts = np.bincount(table.labels, minlength=len(study.study.classes))
        labels = {str(c): int(label_counts[i]) for i, c in enumerate(study.study.classes)}
        absent = [name for name, count in labels.items() if count == 0]
        if absent:
            warnings.append(f"no records of class {absent}: this site cannot evaluate AUC")
    return DataReport(
        file=table.source,
        records=len(table),
        patients=patients,
        privacy_unit=unit,
        units=units,
        missing=missing,
        levels=levels,
        labels=labels,
        outside_range=outside,
        delta=delta,
        max_delta=max_delta,
        problems=problems,
        warnings=warnings,
    )


def format_report(report: DataReport) -> list[str]:
    """Human-readable lines of a report."""
    lines = [f"data check of {report.file}: {'ok' if report.ok else 'PROBLEMS'}"]
    who = f", {report.patients} patients" if report.patients is not None else ""
    lines.append(f"  records: {report.records}{who} (privacy unit: {report.privacy_unit})")
    balance = ", ".join(f"{label}: {count}" for label, count in report.labels.items())
    lines.append(f"  labels: {balance}")
    missing = {name: count for name, count in report.missing.items() if count}
    lines.append(
        "  missing values: "
        + (", ".join(f"{name}: {count}" for name, count in missing.items()) or "none")
    )
    for name, level in report.levels.items():
        found = ", ".join(f"{lv}: {n}" for lv, n in level.found.items()) or "none"
        lines.append(f"  levels of {name}: declared {level.declared}; found {found}")
    lines.append(
        f"  delta {report.delta:g} vs 1/N = {report.max_delta:.3g}: "
        + ("ok" if report.delta <= report.max_delta else "too large")
    )
    lines.extend(f"  warning: {text}" for text in report.warnings)
    lines.extend(f"  problem: {text}" for text in report.problems)
    return lines


def site_policy(settings: SiteSettings) -> SitePrivacyPolicy:
    """The site's own privacy policy, from its config (its limits, never the study's).

    ``privacy_unit = "auto"`` accepts any unit the study asks for; an explicit unit is
    the weakest this site accepts.
    """
    privacy = settings.privacy
    unit = "record" if privacy.privacy_unit == "auto" else privacy.privacy_unit
    return SitePrivacyPolicy(
        epsilon=privacy.budget_epsilon,
        delta=privacy.delta,
        unit=unit,
        max_epsilon_per_round=settings.policy.max_epsilon_per_round,
        allowed_model_factories=tuple(getattr(settings.policy, "allowed_model_factories", ())),
        max_count_epsilon=privacy.count_epsilon,
        max_intermediaries=settings.policy.max_intermediaries,
        max_evaluations=settings.policy.max_evaluations,
        max_colluding_sites=settings.policy.max_colluding_sites,
        min_round_sites=settings.policy.min_round_sites,
        min_evaluation_noise_std=privacy.evaluation_noise_std,
    )


def check_site_can_join(
    study: Study, policy: SitePrivacyPolicy, data_path: str | Path
) -> DataReport:
    """What a site runs on receiving a study at enrolment, before it sends any key or
    update: the study's privacy requests against the site's policy (`PrivacyError`),
    then its data against the study (`DataError` naming file, row and column, or a
    cohort-level problem)."""
    check_study_against_policy(study, policy)
    report = check_data_against_study(data_path, study, delta=policy.delta)
    if not report.ok:
        raise DataError("; ".join(report.problems), file=str(data_path))
    return report
