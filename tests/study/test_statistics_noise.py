"""The "auto" range statistics of a realistic small cohort (three hospitals of 400-700
records) against the release's own DP noise: bins holding only noise must not drag the
quantiles out to +-1e4 (the clamp-at-0 decode did: lactate scale 59, clip range
[-56061, 3168] for a true SD of 1 and range 0-5), and a release the noise swamps says
so, naming the feature."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from common.releases.statistics import (
    HISTOGRAM_BINS,
    auto_statistics,
    decode_release,
    encode_release,
    histogram_bin,
    plan_statistics,
    statistics_layout,
    statistics_length,
)
from common.study import (
    Study,
    check_statistics,
    statistics_bytes,
    statistics_from_bytes,
    study_from_mapping,
)
from site_agent.data import load_study_table
from tests.study.helpers import release_noise_sigma, ring_to_signed

SITES = (400, 550, 700)
COLLUDING = 1
N_NOISE = len(SITES) - COLLUDING  # the round-size floor 3 minus one colluder


def _study() -> Study:
    """What `medfed study init` writes for a sepsis table: every numeric range "auto"."""
    numeric = ["age", "heart_rate", "sys_bp", "temp", "lactate"]
    return study_from_mapping({
        "study": {"name": "sepsis-small", "rounds": 3, "classes": ["0", "1"]},
        "data": {"label_column": "sepsis"},
        "features": [
            *({"name": name, "type": "numeric", "missing": "impute"} for name in numeric),
            {"name": "sex", "type": "categorical", "levels": ["F", "M"]},
        ],
        "model": {"name": "mlp", "hidden": [16]},
        "privacy": {"unit": "record", "epsilon": 4.0, "delta": 1e-5},
    }, source="test")


def _write_site(path: Path, n: int, rng: np.random.Generator) -> Path:
    lactate = np.maximum(rng.normal(2.0, 1.0, n), 0.0)
    columns = {
        "age": rng.normal(62, 16, n).clip(18, 99),
        "heart_rate": rng.normal(88, 18, n),
        "sys_bp": rng.normal(120, 19.5, n),
        "temp": rng.normal(37.2, 0.8, n),
        "lactate": lactate,
    }
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([*columns, "sex", "sepsis"])
        for i in range(n):
            writer.writerow([*(f"{columns[c][i]:.3f}" for c in columns),
                             "F" if rng.random() < 0.5 else "M", int(rng.random() < 0.1)])
    return path


def _noisy_sum(tmp_path: Path, study: Study, *, seed: int) -> tuple[np.ndarray, dict[str, float]]:
    """Three sites' noised releases summed in the uint32 ring, as SecAgg+ delivers them
    (the noise from a seeded generator instead of the OS CSPRNG: a reproducible test)."""
    rng = np.random.default_rng(seed)
    plan = plan_statistics(study, n_noise=N_NOISE)
    total = np.zeros(plan.length, dtype=np.uint32)
    values: dict[str, list[float]] = {"sys_bp": [], "lactate": []}
    for index, n in enumerate(SITES):
        path = _write_site(tmp_path / f"site{index}.csv", n, rng)
        table = load_study_table(path, study)
        for name in values:
            values[name].extend(table.numeric[name].tolist())
        release = encode_release(table, study, uniform=rng.random)
        noisy = release + plan.noise(rng.bytes)
        total += (noisy % (1 << 32)).astype(np.uint32)
    truth = {f"{name}.sd": float(np.std(v)) for name, v in values.items()}
    truth.update({f"{name}.range": float(np.ptp(v)) for name, v in values.items()})
    return ring_to_signed(total), truth


def test_small_cohort_auto_ranges_are_not_swamped_by_empty_bin_noise(tmp_path: Path) -> None:
    study = _study()
    sigma = release_noise_sigma(study, contributors=len(SITES))
    assert sigma > 10  # the regime of the walkthrough: ~17 per bin
    for seed in (11, 12, 13):
        total, truth = _noisy_sum(tmp_path, study, seed=seed)
        stats = decode_release(total, study, source="test", noise_sigma=sigma)
        check_statistics(study, stats)
        lactate, bp = stats.numeric["lactate"], stats.numeric["sys_bp"]
        # Lactate ~ N(2, 1) clipped at 0: scale within 2x of the true SD, range sane.
        assert truth["lactate.sd"] / 2 < lactate.scale < 2 * truth["lactate.sd"], lactate
        assert lactate.clip_high - lactate.clip_low < 2 * truth["lactate.range"], lactate
        assert lactate.clip_low > -1.0 and 0.5 < lactate.impute < 3.5, lactate
        # Systolic BP ~ N(120, 19.5) mostly falls in ONE log bin ([100, 215]: three bins
        # per decade), so a quantile inside it is only known to that bin's width: the
        # scale can come out ~2.5x the SD, never the 7x (137) of the clamp-at-0 decode.
        assert truth["sys_bp.sd"] / 2 < bp.scale < 3 * truth["sys_bp.sd"], bp
        assert bp.clip_high - bp.clip_low < 2 * truth["sys_bp.range"], bp
        assert bp.clip_low > 0 and 80 < bp.impute < 200, bp
        assert not any("lactate" in w or "sys_bp" in w for w in stats.warnings), stats.warnings


def test_noise_only_histogram_warns_naming_the_feature() -> None:
    """Twenty units against a noise std of 17 per bin: no bin is credibly above the
    noise, so the fallback is used and said so; a noiseless decode warns about nothing."""
    study = _study()
    rng = np.random.default_rng(5)
    where = {segment.name: segment for segment in statistics_layout(study)}
    total = np.zeros(statistics_length(study), dtype=np.int64)
    total[0] = 20
    segment = where["lactate.histogram"]
    real = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
    real[35:37] = 10  # twenty units between 1 and 4.64
    sigma = 17.0
    noise = np.rint(rng.normal(0.0, sigma, HISTOGRAM_BINS)).astype(np.int64)
    total[segment.start : segment.start + segment.length] = real + noise
    stats = decode_release(total, study, source="test", noise_sigma=sigma)
    lactate = [w for w in stats.warnings if "'lactate'" in w]
    assert lactate and "declare its range" in lactate[0]
    assert statistics_from_bytes(statistics_bytes(stats)).warnings == stats.warnings
    # The same counts without noise: nothing to warn about, and the bytes of a
    # warning-free release are those of the format before warnings existed.
    total[segment.start : segment.start + segment.length] = real
    clean = decode_release(total, study, source="test")
    assert not [w for w in clean.warnings if "'lactate'" in w]
    assert b"warnings" not in statistics_bytes(clean)
    assert 1.0 <= clean.numeric["lactate"].impute <= 4.7


def test_rare_binary_feature_keeps_a_sane_scale() -> None:
    """A 0/1 column with 1.5% ones (flchain's `mgus`): the IQR lies inside the zero bin,
    so IQR / 1.349 alone gave scale 0.0016 and standardised ones of ~600. The clipped
    histogram's standard deviation floors it near the true 0.12."""
    values = np.r_[np.zeros(5_300), np.ones(80)]
    counts = np.bincount(histogram_bin(values), minlength=HISTOGRAM_BINS).astype(np.int64)
    stats = auto_statistics(counts, name="mgus", sigma=0.0, warnings=[])
    assert 0.05 < stats.scale < 0.5, stats
    assert (1.0 - stats.mean) / stats.scale < 20
