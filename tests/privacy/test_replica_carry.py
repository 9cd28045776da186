"""The coordinator's replica accepts a carried ledger (`medfed ledger carry`: new terms,
the whole old history re-recorded) and nothing else under new terms. Real SQLite state
database, real signed ledgers, real site keys under a real federation CA."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from common.core.errors import LedgerForkError, LedgerIntegrityError
from common.privacy.accountant import Segment
from common.privacy.carry import carried_history, carry_ledger
from common.privacy.ledger import PrivacyLedger
from common.privacy.replica import LedgerReplica
from common.privacy.signed import LedgerSigner, LedgerTerms, SignedEntry, SignedHistory
from common.protocol.pki import load_certificate
from tests.privacy.conftest import Pki

DELTA = 1e-5
SEGMENT = Segment(1.0, 0.01, 50)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
SITE = "hospital-a"
NEW_TERMS = LedgerTerms(SITE, 9.0, DELTA, "prv", "patient")


def site_ledger(path: Path, signer: LedgerSigner, *, budget: float = 5.0) -> PrivacyLedger:
    return PrivacyLedger(path, site_id=SITE, budget_epsilon=budget, delta=DELTA,
                         privacy_unit="patient", signer=signer)


def grow(ledger: PrivacyLedger, rounds: range, segment: Segment = SEGMENT) -> None:
    for number in rounds:
        ledger.reserve(number, [segment], now=T0 + timedelta(hours=number))


@pytest.fixture
def replica(tmp_path: Path, pki_material: Pki) -> LedgerReplica:
    return LedgerReplica.sqlite(tmp_path / "coordinator.db",
                                ca_certificate=load_certificate(pki_material.ca))


@pytest.fixture
def replicated(tmp_path: Path, replica: LedgerReplica, pki_material: Pki) -> SignedHistory:
    """A site ledger of three training rounds, all held by the replica."""
    (tmp_path / "site").mkdir()
    ledger = site_ledger(tmp_path / "site" / "privacy-ledger.db", pki_material.signer_a)
    grow(ledger, range(1, 4))
    assert replica.extend(SITE, ledger.export().to_bytes(), now=T0).entries == 3
    return ledger.export()


def forged_carry(old: SignedHistory, entries: list[SignedEntry], signer: LedgerSigner, *,
                 terms: LedgerTerms = NEW_TERMS) -> SignedHistory:
    """What a site holding its own key can make: `entries` (edited releases) re-recorded
    under `terms`, chained and signed exactly as `medfed ledger carry` does."""
    return carried_history(replace(old.terms, privacy_unit=terms.privacy_unit),
                           tuple(entries), terms, signer, now=T0)


def carries(replica: LedgerReplica, site_id: str) -> list[tuple[str, int, str]]:
    """The carries the replica's database recorded for `site_id`, oldest first: (old
    head hash, old entry count, new head hash)."""
    with replica.database.transaction(write=False) as cur:
        rows = cur.execute(
            "SELECT old_head_hash, old_entry_count, new_head_hash, carried_at FROM "
            "privacy_replica_carried WHERE site_id = ? ORDER BY carried_at, old_entry_count",
            (site_id,),
        ).fetchall()
    return [(str(r[0]), int(r[1]), str(r[2])) for r in rows]


def assert_unchanged(replica: LedgerReplica, old: SignedHistory) -> None:
    head = replica.head(SITE)
    assert head is not None and (head.entries, head.head_hash) == (3, old.head_hash)
    assert replica.export(SITE) == old.to_bytes()
    assert carries(replica, SITE) == []


def test_a_real_carry_is_accepted_archived_and_extended(
    tmp_path: Path, replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    path = tmp_path / "site" / "privacy-ledger.db"
    done = carry_ledger(path, tmp_path / "site" / "carried.db", terms=NEW_TERMS,
                        signer=pki_material.signer_a_renewed, now=T0 + timedelta(days=1))
    carried = site_ledger(done.path, pki_material.signer_a_renewed, budget=9.0)
    status = carried.status()
    # What the coordinator saw before this change: the same count, another head.
    with pytest.raises(LedgerForkError, match="forked"):
        replica.check_head(SITE, entries=status.ledger_entries, head_hash=status.ledger_head)
    # Only the whole history can show a carry: a suffix under new terms is refused.
    with pytest.raises(LedgerForkError, match="send it from seq 1"):
        replica.extend(SITE, carried.export(after_seq=1), now=T0)

    head = replica.extend(SITE, carried.export().to_bytes(), now=T0 + timedelta(days=1))
    assert (head.entries, head.head_hash) == (3, carried.head_hash())
    assert head.carried is not None
    assert head.carried.old_head_hash == replicated.head_hash
    assert head.carried.old_spent == pytest.approx(replicated.entries[-1].epsilon_after)
    assert head.carried.new_spent == pytest.approx(carried.spent())
    assert replica.check_head(SITE, entries=3, head_hash=carried.head_hash())
    assert carries(replica, SITE) == [(replicated.head_hash, 3, carried.head_hash())]
    assert replica.history(SITE).terms == NEW_TERMS
    # The old signed entries are kept for audit, byte for byte.
    with replica.database.transaction(write=False) as cur:
        kept = [str(r[0]) for r in cur.execute(
            "SELECT entry_json FROM privacy_replica_carried_entries WHERE site_id = ? "
            "ORDER BY seq", (SITE,)).fetchall()]
    assert [SignedEntry.from_json_dict(json.loads(k)).entry_hash
            for k in kept] == [e.entry_hash for e in replicated.entries]

    # The carried ledger trains on: its new entries extend the replica as usual.
    grow(carried, range(4, 6))
    head = replica.extend(SITE, carried.export(after_seq=3), now=T0 + timedelta(days=2))
    assert (head.entries, head.head_hash, head.carried) == (5, carried.head_hash(), None)
    # Sending the carry again changes nothing; the OLD ledger is now refused.
    assert replica.extend(SITE, carried.export(), now=T0).entries == 5
    with pytest.raises(LedgerForkError, match="holding 3 entries, but the replica holds 5"):
        replica.extend(SITE, replicated, now=T0)


def test_attack_reset_disguised_as_carry_is_refused(
    replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    """New terms, validly signed, as long as the replica, but round 2's release dropped
    (a later round in its place): composing it would forget a release."""
    first, _, third = replicated.entries
    disguised = [first, replace(third, seq=2), replace(third, seq=3, round=9)]
    history = forged_carry(replicated, disguised, pki_material.signer_a)
    with pytest.raises(LedgerForkError, match=r"entry seq=2 has another round.*not a carry"):
        replica.extend(SITE, history, now=T0)
    # Dropping it outright leaves a shorter history: refused as well.
    shorter = forged_carry(replicated, [first, replace(third, seq=2)], pki_material.signer_a)
    with pytest.raises(LedgerForkError, match="holding 2 entries, but the replica holds 3"):
        replica.extend(SITE, shorter, now=T0)
    assert_unchanged(replica, replicated)


def test_attack_carry_with_a_weaker_mechanism_is_refused(
    replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    """Round 2 re-recorded with ten times the noise it really had (a smaller charge)."""
    first, second, third = replicated.entries
    weaker = replace(second, mechanisms=(Segment(10.0, 0.01, 50),))
    history = forged_carry(replicated, [first, weaker, third], pki_material.signer_a)
    with pytest.raises(LedgerForkError, match="entry seq=2 has another mechanisms"):
        replica.extend(SITE, history, now=T0)
    assert_unchanged(replica, replicated)


def test_attack_carry_signed_by_another_site_is_refused(
    replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    """A faithful copy of hospital-a's releases signed with hospital-b's key (another
    federation member), and one signed with a look-alike hospital-a certificate from
    another CA: neither may replace hospital-a's history."""
    honest = forged_carry(replicated, list(replicated.entries), pki_material.signer_a)
    other = pki_material.signer_b
    by_b = tuple(other.sign(replace(e, cert_sha256=other.cert_sha256)) for e in honest.entries)
    history = SignedHistory(NEW_TERMS, by_b, {other.cert_sha256: other.certificate_der})
    with pytest.raises(LedgerIntegrityError, match="certificate for site 'hospital-b'"):
        replica.extend(SITE, history, now=T0)
    impostor = forged_carry(replicated, list(replicated.entries), pki_material.impostor_a)
    with pytest.raises(LedgerIntegrityError, match="federation CA"):
        replica.extend(SITE, impostor, now=T0)
    assert_unchanged(replica, replicated)


def test_attack_carry_that_changes_the_privacy_unit_is_refused(
    replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    """Every release re-recorded faithfully, but under record-level terms: a patient's
    history would then be bounded per record."""
    record_terms = replace(NEW_TERMS, privacy_unit="record")
    history = forged_carry(replicated, list(replicated.entries), pki_material.signer_a,
                           terms=record_terms)
    with pytest.raises(LedgerForkError, match=r"privacy unit changed \(patient -> record\)"):
        replica.extend(SITE, history, now=T0)
    assert_unchanged(replica, replicated)


def test_a_carried_ledger_ahead_of_the_replica_is_accepted_whole(
    tmp_path: Path, replica: LedgerReplica, replicated: SignedHistory, pki_material: Pki
) -> None:
    """The site carried and recorded a round the replica never received: the suffix the
    site would send after the replica's head cannot show the carry, the whole can."""
    path = tmp_path / "site" / "privacy-ledger.db"
    done = carry_ledger(path, tmp_path / "site" / "carried.db", terms=NEW_TERMS,
                        signer=pki_material.signer_a, now=T0)
    carried = site_ledger(done.path, pki_material.signer_a, budget=9.0)
    grow(carried, range(4, 5))
    assert not replica.check_head(SITE, entries=4, head_hash=carried.head_hash())  # ahead
    with pytest.raises(LedgerForkError, match="send it from seq 1"):
        replica.extend(SITE, carried.export(after_seq=3), now=T0)
    head = replica.extend(SITE, carried.export(), now=T0)
    assert (head.entries, head.head_hash) == (4, carried.head_hash())
    assert head.carried is not None and head.carried.old_entries == 3
