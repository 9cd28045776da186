"""The site's ledger on real SQLite files with real certificate keys: write-ahead reserve,
budget, restart, signed entries, tampering (including a forger who recomputes every hash),
certificate replacement."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import (
    BudgetExhausted,
    ConfigError,
    LedgerIntegrityError,
    LedgerUnavailable,
    StateError,
)
from common.crypto.encoding import encode_fields
from common.privacy import layered
from common.privacy.accountant import Segment, compose_epsilon
from common.privacy.ledger import PrivacyLedger, read_ledger, verify_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian, canonical_json
from common.privacy.signed import LedgerSigner, LedgerTerms, SignedEntry
from common.protocol.pki import load_certificate
from tests.privacy.conftest import Pki

DELTA = 1e-5
ROUND_SEGMENT = Segment(1.0, 0.01, 100)  # cheap for PRV, ~0.73 epsilon for one round
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def open_ledger(path: Path, signer: LedgerSigner | None, **overrides: object) -> PrivacyLedger:
    options: dict[str, object] = {
        "site_id": "hospital-a",
        "budget_epsilon": 3.0,
        "delta": DELTA,
        "accountant": "prv",
        "privacy_unit": "patient",
        "signer": signer,
    }
    options.update(overrides)
    return PrivacyLedger(path, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def four_round_ledger(tmp_path_factory: pytest.TempPathFactory, pki_material: Pki) -> Path:
    """A ledger with rounds 0..3 committed (built once, copied per test)."""
    path = tmp_path_factory.mktemp("ledger") / "site.ledger"
    ledger = open_ledger(path, pki_material.signer_a)
    for round_number in range(4):
        ledger.reserve(round_number, [ROUND_SEGMENT], now=T0 + timedelta(hours=round_number))
    return path


def copy_ledger(source: Path, target: Path) -> Path:
    for suffix in ("", "-wal", ".anchor"):
        origin = Path(f"{source}{suffix}")
        if origin.exists():
            shutil.copyfile(origin, Path(f"{target}{suffix}"))
    return target


@pytest.fixture
def ledger_copy(four_round_ledger: Path, tmp_path: Path) -> Path:
    return copy_ledger(four_round_ledger, tmp_path / "copy.ledger")


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def count_entries(path: Path) -> int:
    with raw(path) as connection:
        return int(connection.execute("SELECT COUNT(*) FROM ledger_entries").fetchone()[0])


def test_reserve_is_write_ahead_durable_and_signed(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "site.ledger"
    ledger = open_ledger(path, pki_material.signer_a)
    entry = ledger.reserve(7, [ROUND_SEGMENT], now=T0)
    # Committed to disk before reserve() returned: a fresh connection sees it.
    assert count_entries(path) == 1
    header, entries = read_ledger(path)
    assert entries == [entry] and header.head_hash == entry.entry_hash
    assert entry.purpose == "training" and entry.mechanisms == (ROUND_SEGMENT,)
    # The signature is over the domain-separated canonical body, with the site's key.
    message = encode_fields("medfed/v1/ledger-entry", canonical_json(entry.body()))
    pki_material.signer_a.signing_key.verifying_key.verify(message, entry.signature)
    assert entry.cert_sha256 == hashlib.sha256(pki_material.signer_a.certificate_der).hexdigest()
    assert entry.entry_hash == hashlib.sha256(canonical_json(entry.body())).hexdigest()


def test_entries_of_every_kind_and_purpose(tmp_path: Path, pki_material: Pki) -> None:
    ledger = open_ledger(tmp_path / "l", pki_material.signer_a, budget_epsilon=40.0)
    count = Gaussian(noise_std=20.0, l2_sensitivity=1.0)
    ddg = DistributedDiscreteGaussian(
        noise_variance_per_site=400.0, contributors=4, l2_sensitivity=30.0, dimension=1024
    )
    ledger.reserve(0, [count], now=T0, purpose="count")
    ledger.reserve(0, [Gaussian(noise_std=8.0, l2_sensitivity=2.0, count=3)], now=T0,
                   purpose="statistics")
    ledger.reserve(1, [ROUND_SEGMENT, ddg], now=T0, purpose="training")
    ledger.reserve(1, [Gaussian(noise_std=6.0, l2_sensitivity=1.0)], now=T0, purpose="evaluation")
    entries = ledger.entries()
    assert [e.purpose for e in entries] == ["count", "statistics", "training", "evaluation"]
    assert entries[2].mechanisms == (ROUND_SEGMENT, ddg)
    # DP-SGD beneath a DDGauss round: the entry is charged with the larger of
    # the record-level figure and the hospital-level composition (common.privacy.layered).
    pairs = [(e.purpose, e.mechanisms) for e in entries]
    for k in range(1, 5):
        assert entries[k - 1].epsilon_after == pytest.approx(
            layered.charged(pairs[:k], delta=DELTA, accountant="prv").epsilon, rel=1e-9)
    assert entries[1].accountant_used == "prv"
    by_purpose = layered.charged_by_purpose(pairs, delta=DELTA, accountant="prv")
    assert set(by_purpose) == {"count", "statistics", "training", "evaluation"}
    assert all(eps > 0 for eps in by_purpose.values())
    assert by_purpose["count"] < ledger.spent()
    report = verify_ledger(ledger.path)
    assert report.ok and report.epsilons_recomposed and report.signatures_checked == 4


def test_spent_composes_the_whole_history_not_the_sum(ledger_copy: Path, pki_material: Pki) -> None:
    ledger = open_ledger(ledger_copy, pki_material.signer_a)
    whole = compose_epsilon([ROUND_SEGMENT] * 4, delta=DELTA)
    assert ledger.spent() == pytest.approx(whole, rel=1e-9)
    assert ledger.spent() < 4 * compose_epsilon([ROUND_SEGMENT], delta=DELTA)


def test_over_budget_round_raises_and_writes_nothing(ledger_copy: Path, pki_material: Pki) -> None:
    ledger = open_ledger(ledger_copy, pki_material.signer_a)
    head = ledger.head_hash()
    with pytest.raises(BudgetExhausted):
        ledger.reserve(99, [Segment(0.5, 0.05, 2000)], now=T0)
    assert count_entries(ledger_copy) == 4 and ledger.head_hash() == head


def test_reserving_a_round_twice(ledger_copy: Path, pki_material: Pki) -> None:
    ledger = open_ledger(ledger_copy, pki_material.signer_a)
    again = ledger.reserve(2, [ROUND_SEGMENT], now=T0 + timedelta(days=9))
    assert again.seq == 3 and count_entries(ledger_copy) == 4
    with pytest.raises(StateError):
        ledger.reserve(2, [Segment(2.0, 0.01, 100)], now=T0)
    # The same round may carry another purpose (e.g. its DP evaluation).
    ledger.reserve(2, [Gaussian(50.0, 1.0)], now=T0, purpose="evaluation")
    assert count_entries(ledger_copy) == 5


def test_restart_resumes_history_and_refuses_changed_terms(
    ledger_copy: Path, pki_material: Pki
) -> None:
    assert len(open_ledger(ledger_copy, pki_material.signer_a).entries()) == 4
    for field, value in [
        ("budget_epsilon", 30.0),
        ("delta", 1e-6),
        ("accountant", "rdp"),
        ("privacy_unit", "record"),
    ]:
        with pytest.raises(ConfigError) as info:
            open_ledger(ledger_copy, pki_material.signer_a, **{field: value})
        assert info.value.field == field
    assert verify_ledger(ledger_copy).ok


def test_bad_arguments_are_refused(tmp_path: Path, pki_material: Pki) -> None:
    with pytest.raises(ConfigError) as info:
        open_ledger(tmp_path / "a.ledger", pki_material.signer_a, privacy_unit="encounter")
    assert info.value.field == "privacy_unit"
    with pytest.raises(ConfigError) as info:
        open_ledger(tmp_path / "a.ledger", pki_material.signer_b)
    assert info.value.field == "signer"  # hospital-b's certificate cannot sign for a
    ledger = open_ledger(tmp_path / "b.ledger", pki_material.signer_a)
    with pytest.raises(ConfigError) as info:
        ledger.reserve(1, [ROUND_SEGMENT], now=datetime(2026, 1, 1))
    assert info.value.field == "now"
    with pytest.raises(ConfigError) as info:
        ledger.reserve(1, [], now=T0)
    assert info.value.field == "mechanisms"
    with pytest.raises(ConfigError) as info:
        ledger.reserve(1, [ROUND_SEGMENT], now=T0, purpose="marketing")
    assert info.value.field == "purpose"
    read_only = open_ledger(tmp_path / "b.ledger", None)
    with pytest.raises(ConfigError) as info:
        read_only.reserve(1, [ROUND_SEGMENT], now=T0)
    assert info.value.field == "signer"


def test_history_verifies_across_a_certificate_replacement(
    tmp_path: Path, pki_material: Pki
) -> None:
    path = tmp_path / "rotated.ledger"
    first = open_ledger(path, pki_material.signer_a)
    first.reserve(1, [ROUND_SEGMENT], now=T0)
    renewed = open_ledger(path, pki_material.signer_a_renewed)
    renewed.reserve(2, [ROUND_SEGMENT], now=T0)
    entries = renewed.entries()
    assert entries[0].cert_sha256 != entries[1].cert_sha256
    report = verify_ledger(path, ca_certificate=load_certificate(pki_material.ca))
    assert report.ok and report.signatures_checked == 2 and report.ca_checked


# --- tampering -------------------------------------------------------------------------


def rows(connection: sqlite3.Connection) -> list[tuple[int, dict[str, object]]]:
    return [
        (int(seq), json.loads(body))
        for seq, body in connection.execute("SELECT seq, body FROM ledger_entries ORDER BY seq")
    ]


def rewrite_chain(path: Path, edit: Callable[[int, dict[str, object]], None],
                  signer: LedgerSigner | None = None) -> None:
    """A careful forger: edits bodies, then recomputes every prev_hash, entry_hash and
    the header's head_hash (and, given a key, re-signs)."""
    with raw(path) as connection:
        previous = connection.execute("SELECT header_hash FROM ledger_header").fetchone()[0]
        for seq, body in rows(connection):
            edit(seq, body)
            body["prev_hash"] = previous
            if signer is not None:
                body["cert_sha256"] = signer.cert_sha256
            text = canonical_json(body).decode()
            digest = hashlib.sha256(text.encode()).hexdigest()
            signature = b""
            if signer is not None:
                signature = signer.signing_key.sign(encode_fields("medfed/v1/ledger-entry",
                                                                  text.encode()))
            connection.execute(
                "UPDATE ledger_entries SET body = ?, entry_hash = ?"
                + (", signature = ?" if signer is not None else "") + " WHERE seq = ?",
                (text, digest, signature, seq) if signer is not None else (text, digest, seq),
            )
            previous = digest
        if signer is not None:
            connection.execute(
                "INSERT OR IGNORE INTO ledger_certificates VALUES (?, ?)",
                (signer.cert_sha256, signer.certificate_der),
            )
        connection.execute("UPDATE ledger_header SET head_hash = ?", (previous,))


def lower_epsilon(seq: int, body: dict[str, object]) -> None:
    if seq == 2:
        body["epsilon_after"] = 0.5


def edit_epsilon_and_rehash(path: Path) -> None:
    rewrite_chain(path, lower_epsilon)


def edit_epsilon_only(path: Path) -> None:
    with raw(path) as connection:
        body = dict(rows(connection))[3]
        body["epsilon_after"] = 0.1
        connection.execute("UPDATE ledger_entries SET body = ? WHERE seq = 3",
                           (canonical_json(body).decode(),))


def drop_mechanism_and_rehash(path: Path) -> None:
    """Makes round 1 look cheaper (fewer steps) with a fully recomputed chain."""

    def edit(seq: int, body: dict[str, object]) -> None:
        if seq == 1:
            body["mechanisms"] = [
                {"kind": "sampled_gaussian", "noise_multiplier": 1.0, "sample_rate": 0.01,
                 "steps": 1}
            ]

    rewrite_chain(path, edit)


def delete_middle(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("DELETE FROM ledger_entries WHERE seq = 2")


def delete_last(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("DELETE FROM ledger_entries WHERE seq = 4")


def edit_budget(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("UPDATE ledger_header SET budget_epsilon = 100.0")


def drop_certificate(path: Path) -> None:
    with raw(path) as connection:
        connection.execute("DELETE FROM ledger_certificates")


TAMPERINGS: dict[str, tuple[Callable[[Path], None], str]] = {
    "edit_epsilon_only": (edit_epsilon_only, "entry seq=3"),
    "edit_epsilon_and_rehash": (edit_epsilon_and_rehash, "entry seq=2"),
    "drop_mechanism_and_rehash": (drop_mechanism_and_rehash, "entry seq=1"),
    "delete_middle": (delete_middle, "entry seq=3"),
    "delete_last": (delete_last, "header"),
    "edit_budget": (edit_budget, "header"),
    "drop_certificate": (drop_certificate, "entry seq=1"),
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_untouched_ledger_verifies_including_recomposed_epsilons(
    ledger_copy: Path, pki_material: Pki
) -> None:
    report = verify_ledger(ledger_copy)
    assert report.ok and report.epsilons_recomposed and report.signatures_checked == 4
    assert report.entries_checked == 4
    assert report.head_hash == open_ledger(ledger_copy, pki_material.signer_a).head_hash()
    result = run_cli("ledger", "verify", "--ledger", str(ledger_copy), "--hashes-only",
                     "--ca", str(pki_material.ca))
    assert result.returncode == 0, result.stderr
    assert "OK (4 entries" in result.stdout and "4 signatures verified against the CA" in (
        result.stdout
    )


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_tampering_is_detected(name: str, ledger_copy: Path, pki_material: Pki) -> None:
    tamper, first_problem = TAMPERINGS[name]
    tamper(ledger_copy)
    report = verify_ledger(ledger_copy)
    assert not report.ok
    assert str(report.problems[0]).startswith(first_problem), report.problems
    with pytest.raises(LedgerIntegrityError):
        report.raise_if_broken()
    # The site itself refuses to go on with a broken ledger (chain + signatures on open).
    with pytest.raises(LedgerIntegrityError):
        open_ledger(ledger_copy, pki_material.signer_a)
    result = run_cli("ledger", "verify", "--ledger", str(ledger_copy))
    assert result.returncode != 0
    assert "INTEGRITY FAILURE" in result.stderr
    assert f"first problem: {first_problem}" in result.stderr


def test_rewritten_history_with_recomputed_hashes_fails_on_signatures(
    ledger_copy: Path,
) -> None:
    """The attack format 1 could not stop: every hash is consistent again, only the
    signatures (which need the site's key) give the rewrite away."""
    edit_epsilon_and_rehash(ledger_copy)
    report = verify_ledger(ledger_copy, recompose=False)
    messages = [str(p) for p in report.problems]
    assert messages and all("signature does not verify" in m for m in messages)
    assert [p.seq for p in report.problems] == [2, 3, 4]  # the edited entry and every later


def test_a_forger_with_an_own_ca_is_caught_by_the_ca_check(
    ledger_copy: Path, pki_material: Pki
) -> None:
    """Re-signing a lowered history with a look-alike certificate from another CA
    verifies signature-wise, but not against the federation CA."""
    rewrite_chain(ledger_copy, lower_epsilon, signer=pki_material.impostor_a)
    assert verify_ledger(ledger_copy, recompose=False).ok  # consistent, self-certified
    report = verify_ledger(ledger_copy, recompose=False,
                           ca_certificate=load_certificate(pki_material.ca))
    assert not report.ok and "not signed by the federation CA" in str(report.problems[0])
    result = run_cli("ledger", "verify", "--ledger", str(ledger_copy), "--ca",
                     str(pki_material.ca))
    assert result.returncode == 1 and "federation CA" in result.stderr


def test_read_and_verify_refuse_missing_or_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(StateError):
        verify_ledger(tmp_path / "missing.ledger")
    foreign = tmp_path / "foreign.db"
    with raw(foreign) as connection:
        connection.execute("CREATE TABLE t (x INTEGER)")
    with pytest.raises(LedgerUnavailable) as info:
        read_ledger(foreign)
    assert str(foreign) in str(info.value)


VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "privacy_ledger_hashes.json"


def test_format2_encoding_and_signed_bytes_are_pinned() -> None:
    """The format-2 header hash, entry body, entry hash and signed message, spelled out
    independently of the product code (a change would orphan every signed ledger)."""
    vector = json.loads(VECTORS.read_text())["format2"]
    terms = LedgerTerms(**vector["terms"])
    documented_header = json.dumps({"format": "medfed-privacy-ledger/2", **vector["terms"]},
                                   sort_keys=True, separators=(",", ":"))
    assert terms.header_hash == hashlib.sha256(documented_header.encode()).hexdigest()
    assert terms.header_hash == vector["header_hash"]
    entry = SignedEntry.from_json_dict(vector["entry"])
    body = json.dumps({k: v for k, v in vector["entry"].items()
                       if k not in ("entry_hash", "signature")},
                      sort_keys=True, separators=(",", ":"))
    assert entry.body_bytes() == body.encode()
    assert entry.entry_hash == hashlib.sha256(body.encode()).hexdigest() == vector["entry"][
        "entry_hash"]
    label = b"medfed/v1/ledger-entry"
    expected_message = (b"\x02" + len(label).to_bytes(4, "big") + label
                        + b"\x01" + len(body).to_bytes(4, "big") + body.encode())
    assert entry.signed_message() == expected_message
