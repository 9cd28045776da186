"""The approval gate (site_agent/study_gate.py): a site joins only the study its state
folder pins (`medfed site approve`), whatever flag, setting or coordinator says
otherwise; and `site approve --sha256` / `study_sha256` pin only the study the privacy
officer read out. Real files and the real command line; the end-to-end attacks against
each kit's start are tests/e2e/test_attack_unapproved_study.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.commands.cli import main
from common.commands.study import render_study_toml
from common.core.config import SiteSettings, load_settings
from common.core.errors import ConfigError, StudyNotApproved
from common.study import Study, study_from_mapping, study_sha256
from site_agent.approvals import Approvals
from site_agent.study_gate import check_at_start, check_served
from tests.study.helpers import study_mapping


def _study(name: str = "sepsis", rounds: int = 3) -> Study:
    mapping = study_mapping()
    mapping["study"] = {**mapping["study"], "name": name, "rounds": rounds}
    return study_from_mapping(mapping)


def _settings(tmp_path: Path, **overrides: object) -> SiteSettings:
    return load_settings(SiteSettings, overrides={
        "site": "alpha", "coordinator": "127.0.0.1:9", "state": tmp_path / "state",
        "pki": tmp_path, **overrides})


def test_a_site_that_approved_nothing_joins_nothing(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    served = _study()
    assert check_at_start(settings) is None  # nothing named: refused at enrolment
    with pytest.raises(StudyNotApproved) as refused:
        check_served(served, settings)
    message = str(refused.value)
    assert f"sha256 {study_sha256(served)}" in message
    assert f"medfed site approve STUDY.toml --state {settings.state}" in message
    assert "\n" not in message  # one line


def test_the_approved_study_is_joined_and_any_other_refused(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    approved, other = _study(), _study(rounds=1)
    Approvals(settings.state).approve_study(approved)
    check_served(approved, settings)
    with pytest.raises(StudyNotApproved, match="not the study this site approved"):
        check_served(other, settings)
    # Approved while a long-running site waited: the pin is read again at each enrolment.
    Approvals(settings.state).approve_study(other)
    check_served(other, settings)


def test_a_study_file_flag_is_no_approval(tmp_path: Path) -> None:
    """`--study FILE` names which approved study the site expects; it approves nothing."""
    study = _study()
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(study))
    settings = _settings(tmp_path, study_file=path)
    with pytest.raises(ConfigError, match="pins no study") as refused:
        check_at_start(settings)
    assert refused.value.field == "study_file"
    assert f"medfed site approve {path} --state" in str(refused.value)
    Approvals(settings.state).approve_study(_study(rounds=1))
    with pytest.raises(ConfigError, match="pins another study"):
        check_at_start(settings)
    Approvals(settings.state).approve_study(study)
    assert check_at_start(settings) == study


def test_the_configured_sha256_must_be_the_pinned_study(tmp_path: Path) -> None:
    study = _study()
    settings = _settings(tmp_path, study_sha256=study_sha256(study))
    with pytest.raises(ConfigError, match="pins no study") as refused:
        check_at_start(settings)
    assert refused.value.field == "study_sha256"
    Approvals(settings.state).approve_study(_study(rounds=1))
    with pytest.raises(ConfigError, match="correct study_sha256"):
        check_at_start(settings)
    Approvals(settings.state).approve_study(study)
    assert check_at_start(settings) == study


@pytest.mark.parametrize("value", ["SHA256_OF_THE_STUDY", "A" * 64, "a" * 63])
def test_a_malformed_study_sha256_names_the_setting(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="64 lower-case hex digits") as refused:
        _settings(tmp_path, study_sha256=value)
    assert refused.value.field == "study_sha256"


def test_an_empty_study_sha256_is_unset(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """compose passes `${MEDFED_STUDY_SHA256:-}` through: empty means not set."""
    monkeypatch.setenv("MEDFED_SITE_STUDY_SHA256", "")
    assert _settings(tmp_path).study_sha256 is None


def _approve(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["site", "approve", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_approve_pins_only_the_study_the_officer_read_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study, other = _study(), _study(rounds=1)
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(other))
    state = tmp_path / "state"
    code, out, err = _approve(str(path), "--state", str(state), "--yes",
                              "--sha256", study_sha256(study), capsys=capsys)
    assert code == 2
    assert f"its SHA-256 is {study_sha256(other)}, not the approved {study_sha256(study)}" \
        in err
    assert Approvals(state).study() is None
    path.write_text(render_study_toml(study))
    code, out, _ = _approve(str(path), "--state", str(state), "--yes",
                            "--sha256", study_sha256(study), capsys=capsys)
    assert code == 0
    assert json.loads(out.splitlines()[-1])["sha256"] == study_sha256(study)
    assert Approvals(state).study() == study


def test_approve_takes_the_hash_from_the_sites_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the kits run it: `site approve STUDY --config site.toml --yes`, the hash from
    the config (or MEDFED_SITE_STUDY_SHA256)."""
    study, other = _study(), _study(rounds=1)
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(other))
    config = tmp_path / "site.toml"
    config.write_text(f'site = "alpha"\ncoordinator = "127.0.0.1:9"\npki = "{tmp_path}"\n'
                      f'state = "{tmp_path / "state"}"\n[privacy]\n'
                      f"delta = {study.privacy.delta}\n")
    monkeypatch.setenv("MEDFED_SITE_STUDY_SHA256", study_sha256(study))
    code, _, err = _approve(str(path), "--config", str(config), "--yes", capsys=capsys)
    assert code == 2 and "not the approved" in err
    code, _, err = _approve(str(path), "--config", str(config), "--yes",
                            "--sha256", study_sha256(other), capsys=capsys)
    assert code == 2 and "names study_sha256" in err  # the agent would refuse the pin
    path.write_text(render_study_toml(study))
    code, _, _ = _approve(str(path), "--config", str(config), "--yes", capsys=capsys)
    assert code == 0
    assert Approvals(tmp_path / "state").study() == study


def test_approve_with_the_config_refuses_a_study_its_policy_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A study the agent would refuse at enrolment (here: epsilon above the site's
    budget) is not pinned, naming the policy's reason."""
    study = _study()
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(study))
    config = tmp_path / "site.toml"
    config.write_text(f'site = "alpha"\ncoordinator = "127.0.0.1:9"\npki = "{tmp_path}"\n'
                      f'state = "{tmp_path / "state"}"\n[privacy]\n'
                      f"budget_epsilon = {study.privacy.epsilon / 2}\n")
    code, _, err = _approve(str(path), "--config", str(config), "--yes", capsys=capsys)
    assert code == 2 and "not pinned" in err and "privacy.epsilon" in err, err
    assert Approvals(tmp_path / "state").study() is None
