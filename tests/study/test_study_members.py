"""A study's [[members]]: each hospital's site id and public-key SHA-256, validated,
part of the study's canonical bytes and digest, drafted by `study init`, shown by
`study check`; a site refuses a round naming anyone else, or a member under another key,
and the coordinator refuses to enrol them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.commands.cli import main_with
from common.commands.study import register, render_study_toml
from common.core.errors import ConfigError
from common.protocol import pki
from common.study import (
    Study,
    load_study,
    study_bytes,
    study_from_bytes,
    study_from_enrolment,
    study_from_mapping,
    study_sha256,
)
from tests.study.helpers import study_mapping

A = "a" * 64
B = "0123456789abcdef" * 4


def with_members(*members: dict[str, Any]) -> dict[str, Any]:
    return {**study_mapping(), "members": list(members)}


def test_members_are_in_the_digest_and_a_study_without_keeps_its_own() -> None:
    plain = study_from_mapping(study_mapping())
    assert b"members" not in study_bytes(plain)  # the digest it had before members
    listed = study_from_mapping(with_members({"name": "h1", "fingerprint": A},
                                             {"name": "h2", "fingerprint": B}))
    assert json.loads(study_bytes(listed))["members"] == [
        {"name": "h1", "fingerprint": A}, {"name": "h2", "fingerprint": B}]
    assert study_sha256(listed) != study_sha256(plain)
    other_key = study_from_mapping(with_members({"name": "h1", "fingerprint": A},
                                                {"name": "h2", "fingerprint": "c" * 64}))
    assert study_sha256(other_key) != study_sha256(listed)
    assert listed.member_fingerprints() == {"h1": A, "h2": B}
    assert study_from_bytes(study_bytes(listed)) == listed
    assert study_from_mapping(json.loads(render_study_toml_json(listed))) == listed


def render_study_toml_json(study: Study) -> str:
    import tomllib

    return json.dumps(tomllib.loads(render_study_toml(study)))


def test_an_empty_members_list_sent_as_bytes_is_not_canonical() -> None:
    plain = study_from_mapping(study_mapping())
    padded = json.loads(study_bytes(plain))
    padded["members"] = []
    data = json.dumps(padded, sort_keys=True, separators=(",", ":")).encode()
    import hashlib

    with pytest.raises(Exception, match="canonical"):
        study_from_enrolment(data, announced_sha256=hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("fingerprint", [
    "A" * 64,  # upper case: not what `pki request` prints
    "a" * 63,
    "sha256:" + "a" * 64,
    "aa:" * 31 + "a",
    "g" * 64,
    64,
])
def test_fingerprint_format_is_validated(fingerprint: Any) -> None:
    with pytest.raises(ConfigError, match=r"members\[0\]\.fingerprint.*64 lower-case hex"):
        study_from_mapping(with_members({"name": "h1", "fingerprint": fingerprint}))


def test_member_names_are_site_ids_and_fields_are_closed() -> None:
    with pytest.raises(ConfigError, match=r"members\[0\]\.name"):
        study_from_mapping(with_members({"name": "St Mary's", "fingerprint": A}))
    with pytest.raises(ConfigError, match=r"members\[0\]\.key"):
        study_from_mapping(with_members({"name": "h1", "fingerprint": A, "key": "x"}))


def test_a_hospital_listed_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"listed once; repeated: \['h1'\]"):
        study_from_mapping(with_members({"name": "h1", "fingerprint": A},
                                        {"name": "h1", "fingerprint": B}))


def test_one_key_under_two_names_is_refused() -> None:
    """One hospital must not count twice towards a round's floor."""
    with pytest.raises(ConfigError, match="'h1' and 'h2' have the same key fingerprint"):
        study_from_mapping(with_members({"name": "h1", "fingerprint": A},
                                        {"name": "h2", "fingerprint": A}))


# ------------------------------------------------------------------ study init / check


def run(argv: list[str]) -> int:
    return main_with([register], argv)


def test_init_reads_members_from_requests_and_certificates_and_check_prints_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki.init_ca(tmp_path / "pki")
    request = pki.request_certificate(tmp_path / "st-marys", "st-marys")
    pki.sign_request(tmp_path / "pki", request.csr_path)
    other = pki.request_certificate(tmp_path / "north", "north")
    csr, _ = pki.load_request(other.csr_path)
    cert = pki.load_certificate(tmp_path / "pki" / "sites" / "st-marys.crt")
    out = tmp_path / "study.toml"
    assert run(["study", "init", "--out", str(out), "--features", "age,bp",
                "--label-column", "y", "--member-from", str(tmp_path / "pki" / "sites" /
                                                            "st-marys.crt"),
                "--member-from", str(other.csr_path), "--member", f"south={B}"]) == 0
    study = load_study(out)
    assert study.member_fingerprints() == {
        "st-marys": pki.public_key_fingerprint(cert),
        "north": pki.public_key_fingerprint(csr), "south": B}
    capsys.readouterr()
    assert run(["study", "check", "--study", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "members (3)" in printed and pki.public_key_fingerprint(csr) in printed
    assert run(["study", "check", "--study", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["members"]["south"] == B


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--member", "h1", "expected SITE=FINGERPRINT"),
    ("--member", "h1=sha256:abc", "64 lower-case hex"),
    ("--member-from", "junk.crt", "member-from"),
])
def test_init_refuses_a_malformed_member(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, words: str
) -> None:
    (tmp_path / "junk.crt").write_text("not a certificate")
    if flag == "--member-from":
        value = str(tmp_path / value)
    out = tmp_path / "study.toml"
    assert run(["study", "init", "--out", str(out), "--features", "age",
                "--label-column", "y", flag, value]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_site_approve_shows_the_members_and_pins_the_study(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from site_agent import approve_cli
    from site_agent.approvals import Approvals

    study = study_from_mapping(with_members({"name": "h1", "fingerprint": A},
                                            {"name": "h2", "fingerprint": B}))
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(study))

    def register_site(sub: Any) -> None:
        site = sub.add_parser("site").add_subparsers(dest="site_command", required=True)
        approve_cli.register(site)

    state = tmp_path / "state"
    assert main_with([register_site], ["site", "approve", str(path), "--state", str(state),
                                       "--yes"]) == 0
    shown = capsys.readouterr().out
    assert "members       2 hospitals" in shown
    assert "  - h1 " in shown and A in shown and B in shown
    assert Approvals(state).study() == study
