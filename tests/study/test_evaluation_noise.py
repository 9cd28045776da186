"""The federated DP evaluation of a small held-out cohort (~34 positives, ~300 negatives,
every score <= 0.22) against the noise of the summed histogram (std 10 per bucket, the
sites' default): empty buckets' noise must not pull Youden's threshold above every
score nor inflate the AUC, the noise is reported beside the AUC, and `medfed predict`
says so when no record reaches the bundle's threshold."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from common.commands.cli import main_with
from common.releases.bundle import Threshold, read_bundle, threshold_from_histogram, write_bundle
from common.releases.evaluation import (
    denoised_histogram,
    metrics_from_histogram,
    metrics_from_scores,
    score_histogram,
)
from common.releases.evaluation_threshold import youden_threshold
from site_agent.predict_cli import register_model, register_predict
from tests.study.helpers import trained_bundle, write_hospital_csv
from tests.training.helpers import uniform_edges

BINS = 20
EDGES = uniform_edges(BINS)  # the noise filter's behaviour, measured on equal-width buckets
NOISE_STD = 10.0


def _cohort(
    rng: np.random.Generator, *, positives: int = 34, negatives: int = 300
) -> tuple[np.ndarray, np.ndarray]:
    """A weak model on a held-out set: scores in [0, 0.22], positives a bit higher."""
    neg = np.clip(rng.beta(2.0, 16.0, negatives) * 1.6, 0.0, 0.22)
    pos = np.clip(rng.beta(3.0, 12.0, positives) * 1.1, 0.0, 0.22)
    labels = np.concatenate([np.zeros(negatives, np.int64), np.ones(positives, np.int64)])
    return np.concatenate([neg, pos]), labels


def _noisy(hist: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    noise = np.rint(rng.normal(0.0, NOISE_STD, hist.size)).astype(np.int64)
    noisy: np.ndarray = hist + noise
    return noisy


def _clamped(noisy: np.ndarray) -> np.ndarray:
    """What the coordinator did before: every negative count to 0, nothing else."""
    clamped: np.ndarray = np.maximum(noisy, 0)
    return clamped


def _draws(
    positives: int, negatives: int, *, seed: int, draws: int = 200
) -> dict[str, np.ndarray]:
    """Threshold and AUC of `draws` noisy histograms of one cohort, new and old decode."""
    rng = np.random.default_rng(seed)
    scores, labels = _cohort(rng, positives=positives, negatives=negatives)
    true_hist = score_histogram(scores, labels, edges=EDGES)
    truth_auc = metrics_from_scores(scores, labels).auc
    truth_threshold = youden_threshold(true_hist, edges=EDGES)
    rows = []
    for _ in range(draws):
        noisy = _noisy(true_hist, rng)
        result = denoised_histogram(noisy)
        old = _clamped(noisy)
        rows.append((
            youden_threshold(result.counts, edges=EDGES) - truth_threshold,
            youden_threshold(old, edges=EDGES) - truth_threshold,
            metrics_from_histogram(result.counts, edges=EDGES).auc - truth_auc,
            metrics_from_histogram(old, edges=EDGES).auc - truth_auc,
            float(youden_threshold(result.counts, edges=EDGES) > scores.max()),
            float(youden_threshold(old, edges=EDGES) > scores.max()),
            result.noise_std, float(result.noise_dominated),
        ))
    table = np.array(rows)
    names = ("threshold", "old_threshold", "auc", "old_auc", "above", "old_above",
             "noise_std", "flagged")
    return {name: table[:, i] for i, name in enumerate(names)}


def test_small_cohort_threshold_stays_among_the_scores_and_is_flagged() -> None:
    """34 positives against noise 10 per bucket: the threshold lands among the scores
    (before: above every score in most draws, the walkthrough's sensitivity 0), and the
    AUC, which no post-processing can make precise here, is flagged noise-dominated."""
    d = _draws(34, 300, seed=2026)
    assert d["old_above"].mean() > 0.5
    assert d["above"].mean() <= 0.05
    assert np.abs(d["threshold"]).mean() < 0.5 * np.abs(d["old_threshold"]).mean()
    assert np.abs(d["threshold"]).mean() <= 0.075
    # The noise is estimated from the negative counts (~10), and flagged.
    assert 8.0 < float(np.median(d["noise_std"])) < 12.0
    assert np.all((d["noise_std"] > 4.0) & (d["noise_std"] < 20.0))
    assert d["flagged"].mean() >= 0.95


def test_larger_cohort_auc_is_closer_to_the_truth() -> None:
    """150 positives, 1500 negatives: the empty buckets' fake mass inflated the AUC by
    ~0.08 (ranking fake positives above every real negative); now it is within ~0.04."""
    d = _draws(150, 1500, seed=5)
    old_error, error = np.abs(d["old_auc"]).mean(), np.abs(d["auc"]).mean()
    assert error < 0.6 * old_error and error < 0.05
    assert d["old_auc"].mean() > 0.05  # the old decode's bias was upward
    assert d["above"].mean() <= 0.05 < d["old_above"].mean()


def test_a_large_clean_histogram_is_unchanged() -> None:
    """No negative count: no visible noise, nothing filtered; many units per bucket
    against the noise: the same AUC and threshold as the plain clamp."""
    rng = np.random.default_rng(7)
    scores = rng.random(20_000)
    labels = (rng.random(20_000) < scores).astype(np.int64)
    hist = score_histogram(scores, labels, edges=EDGES)
    clean = denoised_histogram(hist)
    assert np.array_equal(clean.counts, hist) and not clean.noise_dominated
    noisy = _noisy(hist, rng)
    result = denoised_histogram(noisy, noise_std=NOISE_STD)
    assert np.array_equal(result.counts, _clamped(noisy)) and not result.noise_dominated
    assert youden_threshold(result.counts, edges=EDGES) == youden_threshold(
        _clamped(noisy), edges=EDGES
    )


def test_bundle_threshold_carries_the_auc_and_its_noise() -> None:
    rng = np.random.default_rng(3)
    scores, labels = _cohort(rng)
    result = denoised_histogram(_noisy(score_histogram(scores, labels, edges=EDGES), rng))
    metrics = {"auc": metrics_from_histogram(result.counts, edges=EDGES).auc,
               **result.metrics()}
    threshold = threshold_from_histogram(result.counts, bins=BINS, edges=EDGES,
                                         evaluation=metrics)
    assert threshold.noise_dominated and threshold.noise_std == pytest.approx(result.noise_std)
    assert threshold.auc is not None and 0.0 <= threshold.auc <= 1.0
    assert threshold.value is not None and threshold.value <= 0.25


def _run(argv: list[str]) -> int:
    return main_with([register_model, register_predict], argv)


def test_predict_warns_when_no_record_reaches_the_threshold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = write_hospital_csv(tmp_path / "train.csv", n_patients=150, seed=21)
    bundle = trained_bundle(train, steps=60)
    noisy_threshold = Threshold(value=1.0, method="youden-dp-roc", histogram_bins=BINS,
                                auc=0.88, noise_std=10.0, relative_noise=0.66,
                                noise_dominated=True)
    model = tmp_path / "final.safetensors"
    write_bundle(model, replace(bundle, threshold=noisy_threshold))
    assert read_bundle(model).threshold == noisy_threshold
    data = write_hospital_csv(tmp_path / "county.csv", n_patients=40, seed=22)
    out = tmp_path / "scores.csv"
    argv = ["predict", "--model", str(model), "--data", str(data), "--out", str(out)]
    assert _run(argv) == 0
    captured = capsys.readouterr()
    assert "no record reaches the bundle's threshold 1" in captured.err
    assert "sensitivity 0.000" in captured.out
    assert _run([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["warnings"] and "no record reaches" in result["warnings"][0]
    assert _run(["model", "show", "--model", str(model)]) == 0
    shown = capsys.readouterr().out
    assert "federated DP AUC 0.880; DP noise std 10 per score bucket, 66%" in shown
    assert "WARNING: the federated evaluation was noise-dominated" in shown
    # A threshold some records reach: no warning.
    reached = noisy_threshold.model_copy(update={"value": 0.45})
    write_bundle(model, replace(bundle, threshold=reached))
    assert _run(argv) == 0
    assert "no record reaches" not in capsys.readouterr().err


def test_coordinator_reports_the_noise_beside_the_auc(caplog: pytest.LogCaptureFixture) -> None:
    """The round's metrics carry the noise indication and the coordinator logs a
    warning when the noise dominates (coordinator.aggregation.evaluation_metrics)."""
    from coordinator.aggregation import evaluation_metrics

    rng = np.random.default_rng(2026)
    scores, labels = _cohort(rng)
    noisy = _noisy(score_histogram(scores, labels, edges=EDGES), rng)
    metrics: dict[str, float] = {}
    with caplog.at_level("WARNING", logger="medfed.coordinator"):
        histogram = evaluation_metrics(noisy, edges=(EDGES,), classes=1, metrics=metrics)
    assert metrics["auc_noise_dominated"] == 1.0 and metrics["auc_noise_std"] > 0
    assert 0.0 <= metrics["auc"] <= 1.0 and histogram.min() >= 0
    assert any("noise-dominated" in r.getMessage() for r in caplog.records)
    # A round without evaluation (all zeros): no metrics, no warning.
    caplog.clear()
    quiet: dict[str, float] = {}
    empty = evaluation_metrics(np.zeros(2 * BINS, np.int64), edges=(EDGES,), classes=1,
                               metrics=quiet)
    assert not empty.any() and quiet == {} and not caplog.records


def test_model_show_never_prints_an_absurd_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A smaller class released as ~0 makes noise / count meaningless: `model show`
    says "more than the smaller class's count (noise-dominated)", not "100000000%"."""
    train = write_hospital_csv(tmp_path / "train.csv", n_patients=60, seed=23)
    bundle = trained_bundle(train, steps=5)
    model = tmp_path / "final.safetensors"
    for share, noise_dominated, expected in (
        (1e6, True, "DP noise std 10.8 per score bucket, more than the smaller class's "
                    "count (noise-dominated)"),
        (0.4, False, "DP noise std 10.8 per score bucket, 40% of the smaller class's count "
                     "(noise-dominated)"),
        (0.05, False, "DP noise std 10.8 per score bucket, 5% of the smaller class's count\n"),
    ):
        threshold = Threshold(value=0.4, method="youden-dp-roc", histogram_bins=BINS,
                              histogram_edges=tuple(EDGES), auc=0.7, noise_std=10.8,
                              relative_noise=share, noise_dominated=noise_dominated)
        write_bundle(model, replace(bundle, threshold=threshold))
        assert _run(["model", "show", "--model", str(model)]) == 0
        shown = capsys.readouterr().out
        assert expected in shown and "00%" not in shown


def test_model_show_describes_an_image_model_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An image model's inputs are its channels and size, from the study."""
    from common.models.architecture import architecture_from_study
    from common.models.build import initial_model
    from common.releases.bundle import ModelBundle, bundle_summary
    from common.study import GlobalStatistics, load_study, study_sha256
    from tests.study.helpers import privacy_card
    from tests.training.test_study_hook import images_study

    study = load_study(images_study(tmp_path))
    model = initial_model(study, seed=0)
    bundle = ModelBundle(
        study=study, architecture=architecture_from_study(study),
        statistics=GlobalStatistics(study_sha256=study_sha256(study), source="test"),
        threshold=Threshold(value=0.5, method="fixed"), card=privacy_card(study),
        parameters={n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        round=1, final=True,
    )
    path = tmp_path / "images.safetensors"
    write_bundle(path, bundle)
    assert _run(["model", "show", "--model", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "inputs: image 1 x 16 x 16 (channels x height x width)" in shown
    assert "inputs (0)" not in shown
    assert bundle_summary(bundle)["inputs"] == "image 1 x 16 x 16 (channels x height x width)"
