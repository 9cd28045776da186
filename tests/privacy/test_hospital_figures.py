"""Honest reporting of hospital-level DP: three figures, named plainly.

A patient added or removed inside a hospital (or intermediary) that stays in the round moves
that unit's clipped update by up to 2S (replace relation), so the per-patient figure composes
the DDGauss rounds at 2S with the rest of the history and is larger than the
intermediary-level (add/remove one unit, S) one, which a ledger without the per-patient
charge (written before it) is charged with. The ledger
(`medfed ledger show`), the model card and `model show` name all three; a study that
says unit = "hospital" gets one intermediary per hospital unless it opts in to more,
and is warned what that costs."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from common.commands.privacy import main as privacy_main
from common.commands.study import main as study_main
from common.privacy import hospital
from common.privacy.accountant import compose_epsilon
from common.privacy.ddgauss import DDGaussPlan
from common.privacy.ledger import PrivacyLedger, verify_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Mechanism
from common.study import intermediaries_warning, study_from_mapping, study_sha256
from common.study.hospital_terms import study_terms
from coordinator import hospital_sum
from site_agent import dp_release
from tests.privacy.conftest import Pki
from tests.study.helpers import study_mapping

NOW = datetime(2026, 11, 23, tzinfo=UTC)
DELTA = 1e-5
CLIP = 0.5
DIM = 4096


def _site_plan(*, n_noise: int = 2) -> DDGaussPlan:
    ring = hospital.ring_plan(hospital.HospitalTerms(CLIP, 1.5), dim=DIM, max_sites=3)
    return hospital.site_plan(ring, n_noise=n_noise)


def _history(*, units: int) -> list[tuple[str, tuple[Mechanism, ...]]]:
    """Two DDGauss training rounds (`units` intermediaries each) plus the per-patient
    releases a hospital-mode site also makes (evaluation histograms)."""
    plan = _site_plan()
    evaluation = dp_release.evaluation_mechanism(noise_std=5.0, n_noise=2, bins=10)
    return [
        ("training", (hospital.mechanism(plan, units=units),)),
        ("evaluation", (evaluation,)),
        ("training", (hospital.mechanism(plan, units=units),)),
        ("evaluation", (evaluation,)),
    ]


@pytest.mark.parametrize("units", [1, 3])
def test_per_patient_is_the_2s_composition_and_exceeds_the_unit_level(units: int) -> None:
    history = _history(units=units)
    figures = hospital.guarantees(history, delta=DELTA, accountant="rdp")
    # Independently: every training round re-planned at twice the sensitivity (the
    # replace-one-unit relation), composed with the other releases as they are.
    plan = _site_plan()
    doubled = DistributedDiscreteGaussian.from_plan(plan, replacement=True, units=units)
    assert doubled.l2_sensitivity == pytest.approx(2 * plan.l2_sensitivity)
    others = [m for purpose, ms in history if purpose != "training" for m in ms]
    expected = compose_epsilon([doubled, doubled, *others], delta=DELTA, accountant="rdp")
    assert figures.per_patient == pytest.approx(expected, rel=1e-9)
    # The charge (add/remove one unit at S, every release) understates it.
    charged = compose_epsilon([m for _, ms in history for m in ms], delta=DELTA,
                              accountant="rdp")
    assert figures.intermediary < charged < figures.per_patient
    assert not figures.layered and figures.dpsgd_path == figures.hospital_path
    # A history of DDGauss model updates alone: the 2S composition, against S.
    alone = [entry for entry in history if entry[0] == "training"]
    only = hospital.guarantees(alone, delta=DELTA, accountant="rdp")
    assert only.per_patient == pytest.approx(
        compose_epsilon([doubled, doubled], delta=DELTA, accountant="rdp"), rel=1e-9)
    assert only.per_patient > only.intermediary == pytest.approx(compose_epsilon(
        [m for _, ms in alone for m in ms], delta=DELTA, accountant="rdp"), rel=1e-9)
    if units == 1:
        assert figures.intermediary == figures.hospital and figures.largest_v == 1
    else:
        assert figures.intermediary < figures.hospital and figures.largest_v == units


def _ledger(path: Path, pki: Pki, *, units: int) -> PrivacyLedger:
    ledger = PrivacyLedger(path, site_id="hospital-a", budget_epsilon=40.0, delta=DELTA,
                           privacy_unit="hospital", accountant="rdp", signer=pki.signer_a)
    for number, (purpose, mechanisms) in enumerate(_history(units=units), start=1):
        ledger.reserve((number + 1) // 2, mechanisms, now=NOW, purpose=purpose)
    return ledger


@pytest.mark.parametrize("units", [1, 3])
def test_ledger_show_names_all_three(
    tmp_path: Path, pki_material: Pki, capsys: pytest.CaptureFixture[str], units: int
) -> None:
    ledger = _ledger(tmp_path / "ledger.db", pki_material, units=units)
    assert verify_ledger(ledger.path).ok
    assert privacy_main(["ledger", "show", "--ledger", str(ledger.path), "--json"]) == 0
    summary: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figures = hospital.guarantees(_history(units=units), delta=DELTA, accountant="rdp")
    assert summary["hospital_level_epsilon"] == pytest.approx(figures.hospital)
    assert summary["intermediary_level_epsilon"] == pytest.approx(figures.intermediary)
    assert summary["per_patient_epsilon"] == pytest.approx(figures.per_patient)
    # A ledger without the per-patient charge says what it is charged with: not per-patient.
    assert summary["spent_epsilon"] < summary["per_patient_epsilon"]
    assert "NOT per-patient" in summary["budget_charge"]
    assert "patient_level_epsilon" not in summary  # the old, understated key
    assert summary["intermediaries_max"] == units

    assert privacy_main(["ledger", "show", "--ledger", str(ledger.path)]) == 0
    text = capsys.readouterr().out
    for name in ("hospital-level epsilon", "intermediary-level epsilon", "per-patient epsilon"):
        assert name in text
    assert "2S" in text and "charged with" in text


def _hospital_study(**privacy: Any) -> Any:
    return study_from_mapping(study_mapping(unit="hospital", update_clip_norm=CLIP,
                                            **privacy), source="test")


@pytest.mark.parametrize("intermediaries", [1, 3])
def test_the_card_names_all_three(intermediaries: int) -> None:
    study = _hospital_study(intermediaries=intermediaries)
    figures = hospital.guarantees(_history(units=intermediaries), delta=DELTA,
                                  accountant="rdp")
    row = hospital_sum.HospitalEpsilons(figures.hospital, DELTA, figures.intermediary,
                                        figures.largest_v, figures.per_patient)
    guarantees, notes = hospital_sum.card_parts(study, {"alpha": row})
    by_unit = {g.unit: g for g in guarantees}
    assert set(by_unit) == {"hospital", "intermediary", "patient"}
    assert by_unit["hospital"].epsilon == pytest.approx(figures.hospital)
    assert by_unit["intermediary"].epsilon == pytest.approx(figures.intermediary)
    assert by_unit["patient"].epsilon == pytest.approx(figures.per_patient)
    assert "2S" in by_unit["patient"].note
    assert "add/remove one hospital" in by_unit["hospital"].note
    # The card says the budget is charged with the per-patient figure.
    assert any("charged with: the per-patient epsilon" in note for note in notes)
    assert hospital_sum.card_budget_charge(study) == "record_level"


def test_model_show_names_all_three(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`medfed model show` on a written bundle prints the three figures under their
    names and labels sites[].epsilon as the budget charge."""
    from common.releases.bundle import PrivacyCard, SitePrivacy, write_bundle
    from site_agent.predict_cli import main as predict_main
    from tests.study.helpers import trained_bundle, write_hospital_csv

    study = _hospital_study(intermediaries=1)
    figures = hospital.guarantees(_history(units=1), delta=DELTA, accountant="rdp")
    row = hospital_sum.HospitalEpsilons(figures.hospital, DELTA, figures.intermediary, 1,
                                        figures.per_patient)
    guarantees, notes = hospital_sum.card_parts(study, {"alpha": row})
    base = trained_bundle(write_hospital_csv(tmp_path / "a.csv", 200, seed=2), steps=5)
    card = PrivacyCard(unit="hospital", accountant="per-site ledger",
                       mechanisms=hospital_sum.card_mechanisms(study), rounds=2,
                       sites=(SitePrivacy(site="alpha", epsilon=1.0, delta=DELTA),),
                       group_guarantees=guarantees, notes=notes)
    statistics = base.statistics.model_copy(update={"study_sha256": study_sha256(study)})
    bundle = dataclasses.replace(base, study=study, card=card, statistics=statistics)
    path = tmp_path / "model.safetensors"
    write_bundle(path, bundle)
    assert predict_main(["model", "show", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    # A card written before the budget_charge field: the add/remove charge, said so.
    for label in ("hospital-level: epsilon", "intermediary-level: epsilon",
                  "patient-level: epsilon", "budget charge (add/remove one unit; "
                  "not per-patient)"):
        assert label in text
    charged_card = card.model_copy(update={
        "budget_charge": hospital_sum.card_budget_charge(study)})
    write_bundle(path, dataclasses.replace(bundle, card=charged_card))
    assert predict_main(["model", "show", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    assert "budget charge = per-patient (model updates at 2S)" in text
    assert "not per-patient" not in text


def test_default_is_one_intermediary_and_more_is_warned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study = _hospital_study()
    assert study.privacy.intermediaries == 1
    assert study_terms(study).intermediaries == 1
    assert not study_terms(study).norm_segment
    assert intermediaries_warning(study.privacy) is None
    for value, shown in (("auto", "up to 8"), (4, "v = 4")):
        warning = intermediaries_warning(_hospital_study(intermediaries=value).privacy)
        assert warning is not None and "v-fold" in warning and shown in warning
    # `medfed study check` prints the warning line for an opted-in split.
    path = tmp_path / "study.toml"
    path.write_text('[study]\nname = "s"\nrounds = 2\nclasses = ["no", "yes"]\n\n'
                    '[data]\nlabel_column = "y"\n\n[[features]]\nname = "x"\n'
                    'type = "numeric"\nrange = [0, 1]\n\n[privacy]\nunit = "hospital"\n'
                    'update_clip_norm = 1.0\nintermediaries = "auto"\n')
    assert study_main(["study", "check", "--study", str(path)]) == 0
    captured = capsys.readouterr()
    assert "hospital-level epsilon is v-fold" in captured.err
    path.write_text(path.read_text().replace('intermediaries = "auto"\n', ""))
    assert study_main(["study", "check", "--study", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err
