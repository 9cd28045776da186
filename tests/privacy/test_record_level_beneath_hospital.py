"""Record/patient-level DP-SGD underneath hospital-level DP: a site
of a `privacy.unit = "hospital"` study with `privacy.record_level` trains with real
Opacus DP-SGD, clips and DDGauss-encodes the result, and its real SQLite ledger holds
both mechanism kinds; `medfed ledger show --json` names both guarantees, and the budget
is charged with the larger of the record-level and hospital-level compositions
(common.privacy.layered), never with DP-SGD and DDGauss double-counted."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.commands.privacy import main as privacy_main
from common.core.config import SiteSettings
from common.core.errors import BudgetExhausted, ConfigError
from common.crypto.random import system_random
from common.models.build import initial_model
from common.models.layout import flatten_parameters, model_layout
from common.privacy import hospital, layered
from common.privacy.accountant import account, compose_epsilon
from common.privacy.ledger import PrivacyLedger, verify_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian, Mechanism, Segment
from common.rounds.announcement import RoundPlan
from common.study import Study, study_from_mapping
from common.study.hospital_terms import study_terms
from site_agent import dp_release
from site_agent.datacheck import site_policy
from site_agent.site_dataset import TableDataset
from site_agent.site_training import DpTrainingHook
from tests.privacy.conftest import Pki
from tests.study.helpers import noiseless_statistics, study_mapping, write_hospital_csv

NOW = datetime(2026, 11, 22, tzinfo=UTC)
DELTA = 1e-5


def layered_study(**privacy: Any) -> Study:
    options: dict[str, Any] = {
        "unit": "hospital", "update_clip_norm": 0.5, "intermediaries": 1,
        "record_level": "record", "record_epsilon": 3.0, "delta": DELTA, **privacy,
    }
    mapping = study_mapping(**options)
    mapping["study"]["rounds"] = 2
    return study_from_mapping(mapping, source="test")


def settings_for(tmp_path: Path, data: Path) -> SiteSettings:
    return SiteSettings(
        site="hospital-a",
        coordinator="127.0.0.1:1",
        state=tmp_path / "state",
        tls_ca=tmp_path / "ca.crt",
        tls_cert=tmp_path / "s.crt",
        tls_key=tmp_path / "s.key",
        data={"path": data},  # type: ignore[arg-type]
        training={"device": "cpu"},  # type: ignore[arg-type]
        policy={"planned_rounds": 2},  # type: ignore[arg-type]
    )


def run_round(
    hook: DpTrainingHook, ledger: PrivacyLedger, study: Study, *, number: int,
    global_flat: np.ndarray,
) -> tuple[list[Mechanism], np.ndarray]:
    """One hospital round as `TrainingRound._contribute` runs it: plan DP-SGD (planning
    thread), plan the site's DDGauss share, check the budget on the ledger's composition,
    reserve write-ahead, train, encode."""
    layout = model_layout(hook.model())
    plan = RoundPlan(round_number=number, planned_rounds=study.study.rounds, local_epochs=1,
                     learning_rate=0.1, fedprox_mu=0.0, histogram_bins=10, layout=layout)
    evaluation = [dp_release.evaluation_mechanism(noise_std=5.0, n_noise=2, bins=10)]
    segments: list[Mechanism] = list(hook.planned_segments(plan, evaluation=evaluation))
    ring = hospital.ring_plan(study_terms(study), dim=global_flat.size, max_sites=3)
    site = hospital.site_plan(ring, n_noise=2)
    segments.append(hospital.mechanism(site))
    after = ledger.preview(number, segments, also=[("evaluation", evaluation)])
    assert after <= ledger.budget_epsilon
    ledger.reserve(number, segments, now=NOW)
    ledger.reserve(number, evaluation, now=NOW, purpose="evaluation")
    update = hook.train(plan, global_flat)
    seed = hospital.rotation_seed(round_nonce=bytes(32), study_sha256=bytes(32),
                                  round_number=number)
    words = hospital.encode_update(update.delta, plan=site, seed=seed, rng=system_random)
    return segments, words


def show(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert privacy_main(["ledger", "show", "--ledger", str(path), "--json"]) == 0
    summary: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return summary


def test_dp_sgd_beneath_hospital_level_writes_both_and_reports_both(
    tmp_path: Path, pki_material: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    study = layered_study()
    data = write_hospital_csv(tmp_path / "a.csv", 160, seed=1)
    settings = settings_for(tmp_path, data)
    hook = DpTrainingHook(settings, dp=True)
    hook.join_study(study, site_policy(settings))
    assert isinstance(hook.dataset, TableDataset)
    hook.set_statistics(noiseless_statistics(study, hook.dataset.table))
    assert hook.privacy_unit == "hospital" and hook.dp_sgd and hook.record_level == "record"
    ledger = PrivacyLedger(tmp_path / "ledger.db", site_id="hospital-a", budget_epsilon=8.0,
                           delta=DELTA, privacy_unit="hospital", signer=pki_material.signer_a)
    (tmp_path / "state").mkdir(exist_ok=True)  # the split key may have made it
    hook.attach_ledger(ledger, state=tmp_path / "state")
    assert hook.released_units is not None  # a record count: DP-SGD samples records
    global_flat = flatten_parameters(initial_model(study, seed=0))

    for number in (1, 2):
        segments, words = run_round(hook, ledger, study, number=number,
                                    global_flat=global_flat)
        kinds = {type(m) for m in segments}
        assert kinds == {Segment, DistributedDiscreteGaussian}
        assert words.dtype == np.uint32 and words.size >= global_flat.size
        # Real DP-SGD ran: the trainer is Opacus-wrapped at record level, noise planned.
        trainer = hook.trainer_for(RoundPlan(
            round_number=number, planned_rounds=2, local_epochs=1, learning_rate=0.1,
            fedprox_mu=0.0, histogram_bins=10, layout=model_layout(hook.model())))
        assert trainer.privacy_unit == "record" and trainer.noise_multiplier > 0

    entries = ledger.entries()
    training = [e for e in entries if e.purpose == "training"]
    assert len(training) == 2
    for entry in training:
        assert any(isinstance(m, Segment) for m in entry.mechanisms)
        assert any(isinstance(m, DistributedDiscreteGaussian) for m in entry.mechanisms)
    pairs = [(e.purpose, e.mechanisms) for e in entries]
    everything = compose_epsilon([m for _, ms in pairs for m in ms], delta=DELTA)
    dpsgd_only = account(layered.dpsgd_path(pairs), delta=DELTA).epsilon
    hospital_only = hospital.hospital_level_epsilon(pairs, delta=DELTA, accountant="prv")

    summary = show(ledger.path, capsys)
    assert summary["hospital_level_epsilon"] == pytest.approx(hospital_only)
    assert summary["record_level_epsilon"] == pytest.approx(ledger.spent())
    assert summary["dpsgd_path_epsilon"] == pytest.approx(dpsgd_only)
    # The better of the two paths, never the two double-counted.
    assert summary["record_level_epsilon"] <= dpsgd_only + 1e-12
    assert summary["record_level_epsilon"] <= summary["hospital_path_epsilon"] + 1e-12
    assert summary["record_level_epsilon"] < everything
    # DP-SGD was planned for record_epsilon on its own path (evaluation of the rounds
    # left and the final evaluation reserved, so the rounds run fit with room to spare).
    assert dpsgd_only <= study.privacy.record_epsilon + 0.02  # type: ignore[operator]
    assert "patient_level_epsilon" not in summary
    assert verify_ledger(ledger.path).ok  # the charge recomposes exactly

    assert privacy_main(["ledger", "show", "--ledger", str(ledger.path)]) == 0
    text = capsys.readouterr().out
    assert "hospital-level epsilon" in text and "record/patient-level epsilon" in text


def test_the_budget_check_uses_the_larger_of_record_and_unit_level(
    tmp_path: Path, pki_material: Pki
) -> None:
    """A layered round is charged with the larger of the record-level composition (the
    better path) and the unit-level one (its DDGauss at S), never DP-SGD and DDGauss added
    up: accepted when that fits the budget although both together would not, refused
    when it does not; a round without DP-SGD beneath is charged as before."""
    ddg = DistributedDiscreteGaussian(noise_variance_per_site=4.0, contributors=2,
                                      l2_sensitivity=2.0, dimension=1024)
    sgd = Segment(1.2, 0.05, 100)
    ledger = PrivacyLedger(tmp_path / "l.db", site_id="hospital-a", budget_epsilon=3.5,
                           delta=DELTA, privacy_unit="hospital", signer=pki_material.signer_a)
    both = compose_epsilon([sgd, ddg], delta=DELTA)
    record = compose_epsilon([sgd], delta=DELTA)  # path A: DDGauss is post-processing
    unit = compose_epsilon([ddg], delta=DELTA)  # add/remove the hospital
    assert record < unit < 3.5 < both
    assert ledger.preview(1, [sgd, ddg]) == pytest.approx(unit)
    entry = ledger.reserve(1, [sgd, ddg], now=NOW)
    assert entry.epsilon_after == pytest.approx(unit)
    # Cheap DP-SGD does not buy another hospital round past the budget ...
    with pytest.raises(BudgetExhausted, match="budget"):
        ledger.reserve(2, [Segment(5.0, 0.01, 10), ddg], now=NOW)
    # ... and expensive DP-SGD is refused on the record-level figure.
    with pytest.raises(BudgetExhausted, match="budget"):
        ledger.reserve(2, [Segment(0.6, 0.05, 400), ddg], now=NOW)
    plain = PrivacyLedger(tmp_path / "p.db", site_id="hospital-a", budget_epsilon=30.0,
                          delta=DELTA, privacy_unit="hospital", signer=pki_material.signer_a)
    assert plain.reserve(1, [ddg], now=NOW).epsilon_after == pytest.approx(unit)


@pytest.mark.parametrize(
    ("privacy", "field"),
    [
        ({"record_level": "record", "record_epsilon": None}, "privacy.record_epsilon"),
        ({"record_level": "none", "record_epsilon": 2.0}, "privacy.record_epsilon"),
        ({"record_epsilon": 5.0, "epsilon": 4.0}, "privacy.record_epsilon"),
        ({"record_epsilon": 0.5}, "privacy.record_epsilon"),
        ({"intermediaries": "auto"}, "privacy.intermediaries"),
        ({"intermediaries": 3}, "privacy.intermediaries"),
        ({"unit": "patient", "update_clip_norm": None}, "privacy.record_level"),
    ],
)
def test_inconsistent_record_level_is_refused_naming_the_field(
    privacy: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        layered_study(**privacy)


def test_patient_record_level_needs_a_patient_column() -> None:
    mapping = study_mapping(unit="hospital", update_clip_norm=0.5, intermediaries=1,
                            record_level="patient", record_epsilon=3.0)
    del mapping["data"]["patient_column"]
    with pytest.raises(ConfigError, match=r"privacy\.record_level = 'patient' needs data"):
        study_from_mapping(mapping, source="test")


def test_default_keeps_hospital_mode_without_dp_sgd() -> None:
    study = study_from_mapping(study_mapping(unit="hospital", update_clip_norm=0.5),
                               source="test")
    assert study.privacy.record_level == "none" and study.privacy.record_epsilon is None


def test_the_two_paths_of_a_mixed_history() -> None:
    """A: DP-SGD for each layered round, the replace-relation DDGauss bound for a round
    without DP-SGD beneath; B: the replace-relation DDGauss bound for every hospital
    round; statistics, count and evaluation (a DDGauss too) in both, as they are."""
    ddg = DistributedDiscreteGaussian(noise_variance_per_site=9.0, contributors=3,
                                      l2_sensitivity=2.0, dimension=64)
    histogram = dp_release.evaluation_mechanism(noise_std=5.0, n_noise=2, bins=10)
    sgd = Segment(1.0, 0.1, 50)
    count = Gaussian(noise_std=10.0, l2_sensitivity=1.0)
    entries: list[tuple[str, list[Mechanism]]] = [
        ("count", [count]), ("training", [ddg]), ("training", [sgd, ddg]),
        ("evaluation", [histogram]),
    ]
    doubled = layered.replaced(ddg)
    assert doubled.l2_sensitivity == 4.0
    assert doubled.l1_sensitivity == 2 * ddg.effective_l1_sensitivity
    assert doubled.zcdp_rho == pytest.approx(4 * ddg.zcdp_rho, rel=1e-9)
    assert layered.dpsgd_path(entries) == [count, doubled, sgd, histogram]
    assert layered.hospital_path(entries) == [count, doubled, doubled, histogram]
    paths = layered.record_level(entries, delta=DELTA, accountant="prv")
    assert paths.epsilon == min(paths.dpsgd_path, paths.hospital_path)
    charged = layered.charged(entries, delta=DELTA, accountant="prv")
    assert layered.unit_level(entries) == [count, ddg, ddg, histogram]
    unit = compose_epsilon([count, ddg, ddg, histogram], delta=DELTA)
    assert charged.epsilon == pytest.approx(max(paths.epsilon, unit))
    # Without a layered entry the whole history is composed, as before.
    plain = entries[:2] + entries[3:]
    assert not layered.is_layered(plain)
    assert layered.charged(plain, delta=DELTA, accountant="prv").epsilon == pytest.approx(
        compose_epsilon([count, ddg, histogram], delta=DELTA))
