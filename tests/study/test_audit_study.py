"""`medfed privacy audit --study`: the audit trains what the federation trains (the
study's encoding of a hospital-style CSV with a categorical column and missing values,
its model from the registry, its privacy unit and epsilon). Fixed seeds: a 95% bound
still exceeds the truth 5% of the time by design."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.core.errors import ConfigError
from common.study import encoded_feature_names, load_study
from site_agent.audit import load_study_audit_data, run_audit
from site_agent.audit_cli import main
from site_agent.audit_settings import AuditSettings
from tests.study.helpers import study_toml, write_hospital_csv


def write_study(path: Path, *, unit: str = "patient") -> Path:
    path.write_text(study_toml(
        "sepsis-audit", rounds=3, unit=unit, hidden=16, epsilon=4.0, delta=1e-3,
        training={"learning_rate": 0.1, "batch_size": 64},
    ), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hospital(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("audit-study")
    # 600 patients (+ canaries): delta 1e-3 allows at most 1/delta privacy units.
    return write_hospital_csv(folder / "st-marys.csv", 600, seed=5), write_study(
        folder / "study.toml"
    )


def audit_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(list(argv)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(last)  # type: ignore[no-any-return]


def test_study_audit_with_dp_stays_below_the_studys_epsilon(
    capsys: pytest.CaptureFixture[str], hospital: tuple[Path, Path]
) -> None:
    csv, study = hospital
    out = audit_json(
        capsys, "--data", str(csv), "--study", str(study), "--epochs", "3",
        "--canaries", "60", "--seed", "2", "--json",
    )
    for key in ("attack_auc", "tpr_at_1pct_fpr", "epsilon_lower_bound", "epsilon_claimed"):
        assert key in out
    claimed = float(out["epsilon_claimed"])  # type: ignore[arg-type]
    assert claimed == pytest.approx(4.0, rel=0.05)  # the study's epsilon
    assert out["privacy_unit"] == "patient"
    assert float(out["epsilon_lower_bound"]) < claimed  # type: ignore[arg-type]
    assert 0.0 <= float(out["attack_auc"]) <= 1.0  # type: ignore[arg-type]


def test_study_audit_without_dp_reports_no_claim(
    capsys: pytest.CaptureFixture[str], hospital: tuple[Path, Path]
) -> None:
    csv, study = hospital
    out = audit_json(
        capsys, "--data", str(csv), "--study", str(study), "--no-dp", "--epochs", "30",
        "--canaries", "60", "--seed", "2", "--json",
    )
    assert out["epsilon_claimed"] is None
    assert out["privacy_unit"] == "none"
    assert float(out["attack_auc"]) > 0.5  # type: ignore[arg-type]


def test_study_model_and_encoding_are_the_federations(
    hospital: tuple[Path, Path], tmp_path: Path
) -> None:
    csv, study_path = hospital
    study = load_study(study_path)
    data, model = load_study_audit_data(csv, study, statistics=None, seed=0)
    # Encoded as the study says: age, Sex=F/M, lactate + its missing indicator,
    # three admission levels; the registry's mlp with the study's hidden layer.
    assert encoded_feature_names(study)[:3] == ["Age (years)", "Sex=F", "Sex=M"]
    assert data.features.shape[1] == len(encoded_feature_names(study)) == 8
    assert data.patient_ids is not None
    network = model.build(8)
    assert [m.out_features for m in network.modules() if hasattr(m, "out_features")] == [16, 1]
    # A record-level study: each record is its own unit (no patient ids).
    record_study = load_study(write_study(tmp_path / "record.toml", unit="record"))
    records, _ = load_study_audit_data(csv, record_study, statistics=None, seed=0)
    assert records.patient_ids is None
    report = run_audit(
        records, AuditSettings(canaries=20, epochs=1, epsilon=None, batch_size=64),
        seed=1, model=model,
    )
    assert report.result.canaries == 20


def test_hospital_unit_and_conflicting_flags_are_refused(
    capsys: pytest.CaptureFixture[str], hospital: tuple[Path, Path], tmp_path: Path
) -> None:
    csv, study = hospital
    assert main(["--data", str(csv), "--study", str(study), "--label-column", "Outcome"]) == 2
    assert "the study names the label" in capsys.readouterr().err
    assert main(["--data", str(csv)]) == 2
    assert "--label-column" in capsys.readouterr().err
    hospital_study = write_study(tmp_path / "hospital.toml", unit="hospital")
    assert main(["--data", str(csv), "--study", str(hospital_study)]) == 2
    assert "hospital-level DP" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="hospital"):
        load_study_audit_data(csv, load_study(hospital_study), statistics=None, seed=0)


def test_a_multiclass_model_is_audited() -> None:
    import numpy as np

    from common.models.build import build_model
    from site_agent.audit import AuditModel
    from site_agent.data import SiteData

    rng = np.random.default_rng(0)
    features = rng.standard_normal((300, 4)).astype(np.float32)
    labels = np.argmax(features[:, :3], axis=1).astype(np.int64)
    data = SiteData(features=features, labels=labels, patient_ids=None, source="three classes")
    model = AuditModel(
        build=lambda n: build_model("mlp", num_classes=3, in_features=n),
        task="multiclass",
        num_classes=3,
    )
    report = run_audit(
        data, AuditSettings(canaries=30, epochs=2, epsilon=None, batch_size=32), seed=3,
        model=model,
    )
    assert report.result.canaries == 30 and 0.0 <= report.result.attack_auc <= 1.0
