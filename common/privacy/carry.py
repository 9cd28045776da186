"""Carrying a site's spend into a ledger with new terms (budget, delta, accountant).

A ledger's terms are fixed (its header hash starts the chain), so new terms mean a new
ledger. It must not start at zero: the data already paid for every release on the old
one. The new ledger therefore OPENS with the old history: each old entry is re-recorded,
in order, as a signed entry of the new ledger with the same round, purpose and
mechanisms, its `epsilon_after` recomposed under the new terms; the budget refusal of
the new ledger composes them with everything after (`PrivacyLedger.reserve`).

Why the mechanisms and not an (epsilon, delta) opening charge: the old releases and the
new ones are an adaptive composition over the same data and the same neighbour relation,
whose privacy loss is exactly what composing all mechanisms gives (RDP: Mironov 2017,
Proposition 1; PLD/PRV: Koskela et al. 2020, Gopi et al. 2021). An (eps0, delta0) charge
would only compose by the basic theorem (eps0 + eps, delta0 + delta; Dwork & Roth 2014,
Theorem 3.16), looser, and cannot enter an RDP or PLD composition at all (an
(eps, delta)-DP mechanism with delta > 0 has no finite Renyi divergence bound). Entry by
entry rather than one merged opening entry because the hospital-level charge reads each
entry's purpose and whether DP-SGD ran beneath that round (`common.privacy.layered`):
merging entries could drop a round's DDGauss bound from one path, which would be
unsound.

The privacy unit cannot change: a record-level history says nothing sound about a
patient (group privacy over an unknown number of records), so that carry is refused.

The old ledger is kept (the operator moves it aside; `medfed ledger carry` does, in
place); the new ledger records the old head hash, entry count and spend in its notes,
and its opening entries are byte-for-byte the old mechanisms, so `verify` of both shows
the carry is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from common.errors import ConfigError, LedgerUnavailable
from common.privacy.layered import charged
from common.privacy.ledger_anchor import LedgerAnchor, anchor_path_for, write_anchor
from common.privacy.ledger_verify import read_ledger, verify_ledger, write_new_ledger
from common.privacy.mechanisms import Mechanism
from common.privacy.signed import (
    LedgerSigner,
    LedgerTerms,
    SignedEntry,
    SignedHistory,
    utc_timestamp,
)


@dataclass(frozen=True)
class Carried:
    """What `carry_ledger` wrote."""

    path: Path
    entries: int
    old_head_hash: str
    old_spent: float
    spent: float
    note: str


def carried_history(
    old_terms: LedgerTerms,
    old_entries: tuple[SignedEntry, ...],
    terms: LedgerTerms,
    signer: LedgerSigner,
    *,
    now: datetime,
) -> SignedHistory:
    """The new ledger's opening: every old entry re-recorded under `terms`, signed."""
    if terms.site_id != old_terms.site_id:
        raise ConfigError("site_id", f"the old ledger is site {old_terms.site_id!r}, not "
                          f"{terms.site_id!r}")
    if terms.privacy_unit != old_terms.privacy_unit:
        raise ConfigError(
            "privacy_unit",
            f"the old ledger is {old_terms.privacy_unit}-level, the new terms "
            f"{terms.privacy_unit}-level: its guarantees bound another neighbour relation "
            "and cannot be carried soundly (no group size is known); keep the old ledger's "
            "unit",
        )
    if signer.site_id != terms.site_id:
        raise ConfigError("signer", f"certificate names {signer.site_id!r}, not "
                          f"{terms.site_id!r}")
    created_at = utc_timestamp(now)
    pairs: list[tuple[str, Sequence[Mechanism]]] = []
    entries: list[SignedEntry] = []
    previous = terms.header_hash
    for old in old_entries:
        pairs.append((old.purpose, old.mechanisms))
        report = charged(pairs, delta=terms.delta, accountant=terms.accountant,
                         charge=terms.charge)
        entry = signer.sign(SignedEntry(
            site_id=terms.site_id,
            seq=old.seq,
            round=old.round,
            purpose=old.purpose,
            mechanisms=old.mechanisms,
            epsilon_after=report.epsilon,
            accountant_used=report.accountant,
            created_at=created_at,
            prev_hash=previous,
            cert_sha256=signer.cert_sha256,
        ))
        entries.append(entry)
        previous = entry.entry_hash
    return SignedHistory(terms, tuple(entries), {signer.cert_sha256: signer.certificate_der})


def carry_ledger(
    old_path: str | Path,
    new_path: str | Path,
    *,
    terms: LedgerTerms,
    signer: LedgerSigner,
    now: datetime,
    old_anchor: str | Path | None = None,
) -> Carried:
    """Write a new ledger at `new_path` (must not exist) under `terms`, opening with the
    whole history of the ledger at `old_path`, which must verify completely (chain,
    signatures, recomposed epsilons, its anchor) and is left unchanged."""
    old, new = Path(old_path), Path(new_path)
    if new.exists():
        raise LedgerUnavailable(new, f"{new} exists; a carry never overwrites a ledger")
    if not new.parent.is_dir():
        raise LedgerUnavailable(new, f"the folder {new.parent} for the new ledger does not "
                                "exist (a carry creates no folder)")
    report = verify_ledger(old, anchor_path=anchor_path_for(old) if old_anchor is None
                           else old_anchor)
    report.raise_if_broken()
    header, old_entries = read_ledger(old)
    old_terms = LedgerTerms(header.site_id, header.budget_epsilon, header.delta,
                            header.accountant, header.privacy_unit, header.charge)
    if old_terms == terms:
        raise ConfigError("terms", f"{old} already has these terms; nothing to carry")
    history = carried_history(old_terms, tuple(old_entries), terms, signer, now=now)
    old_spent = old_entries[-1].epsilon_after if old_entries else 0.0
    spent = history.entries[-1].epsilon_after if history.entries else 0.0
    note = (
        f"CARRIED: opens with the {len(old_entries)} entries of the ledger {old} (terms "
        f"budget={old_terms.budget_epsilon:g}, delta={old_terms.delta:g}, accountant="
        f"{old_terms.accountant}, charge={old_terms.charge}; head {header.head_hash}; "
        f"epsilon spent {old_spent:.4f}), "
        f"recomposed under the new terms to {spent:.4f}"
    )
    write_new_ledger(new, history, notes=[note])
    write_anchor(anchor_path_for(new), LedgerAnchor(terms.site_id, history.head_seq,
                                                    history.head_hash))
    return Carried(new, len(old_entries), header.head_hash, old_spent, spent, note)
