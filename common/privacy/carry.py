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
Nor can the new budget be below the spend carried into it: the new ledger would record
more than its budget allows (`ledger verify` fails such a ledger).

The old ledger is kept (the operator moves it aside; `medfed ledger carry` does, in
place); the new ledger records the old head hash, entry count and spend in its notes,
and its opening entries are byte-for-byte the old mechanisms, so `verify` of both shows
the carry is complete.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Final

from common.core.errors import ConfigError, LedgerForkError, LedgerUnavailable
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

CARRY_NOTE_PREFIX: Final = "CARRIED: "
"""How a carried ledger's note starts (`ledger_notes`). Notes are not signed: a site
reads it only to decide to send its whole history to the coordinator's replica, which
checks the carry itself from the signed entries (`check_carry`)."""

CARRY_KEPT_FIELDS: Final = ("site_id", "seq", "round", "purpose", "mechanisms", "query")
"""What a carry re-records unchanged from each old entry: the release itself."""
CARRY_RENEWED_FIELDS: Final = (
    "epsilon_after", "accountant_used", "created_at", "prev_hash", "cert_sha256", "signature",
)
"""What a carry may change in each re-recorded entry: the figures composed under the
new terms (`epsilon_after`, `accountant_used`), when and by which certificate it was
re-signed (`created_at`, `cert_sha256`, `signature`), and the chain that now starts at
the new header (`prev_hash`). `SignedEntry` has no other field."""


def is_carried(notes: Sequence[str]) -> bool:
    """Whether a ledger's notes say it opens with a carried history."""
    return any(note.startswith(CARRY_NOTE_PREFIX) for note in notes)


def check_carry(
    old_terms: LedgerTerms,
    old_entries: Sequence[SignedEntry],
    history: SignedHistory,
) -> None:
    """Refuse (LedgerForkError, naming what differs) a `history` under other terms
    than `old_terms` unless it is a carry of `old_entries` (a ledger's whole history
    from seq 1, as a replica holds it): same site and privacy unit, starting at seq 1,
    at least as long, and its first len(old_entries) entries re-recording the old ones
    one to one (`CARRY_KEPT_FIELDS` equal; only `CARRY_RENEWED_FIELDS` may differ).
    The chain and signatures of `history` are its verifier's to check (`check_entries`
    from its header): this function compares releases only.

    Why accepting such a history keeps the guarantee: its entries hold every mechanism
    the old ledger released, in the same order, and the new ledger's budget refusal
    composes them with every later release; the old and new releases are one adaptive
    composition over the same data and neighbour relation (RDP: Mironov 2017,
    Proposition 1; PLD/PRV: Koskela et al. 2020, Gopi et al. 2021), which is exactly
    what composing all mechanisms gives (module docstring). A history that drops,
    reorders or alters a release would compose less than was released (a reset in
    disguise); a privacy-unit change would bound another neighbour relation."""
    site = old_terms.site_id
    if history.terms.site_id != site:
        raise LedgerForkError(f"a carry of site {site}'s ledger names site "
                              f"{history.terms.site_id!r}")
    if history.terms.privacy_unit != old_terms.privacy_unit:
        raise LedgerForkError(
            f"site {site} reports a ledger with other terms whose privacy unit changed "
            f"({old_terms.privacy_unit} -> {history.terms.privacy_unit}): not a carry (its "
            "history bounds another neighbour relation), a reset ledger"
        )
    entries = history.entries
    if entries and entries[0].seq != 1:
        raise LedgerForkError(
            f"site {site} reports a ledger with other terms from seq {entries[0].seq}: a "
            "carry is checked from its whole history (send it from seq 1)"
        )
    if len(entries) < len(old_entries):
        raise LedgerForkError(
            f"site {site} reports a ledger with other terms holding {len(entries)} entries, "
            f"but the replica holds {len(old_entries)}: not a carry (a carry re-records "
            "every old entry), a reset ledger"
        )
    for old, new in zip(old_entries, entries, strict=False):
        for name in CARRY_KEPT_FIELDS:
            if getattr(old, name) != getattr(new, name):
                raise LedgerForkError(
                    f"site {site} reports a ledger with other terms whose entry seq="
                    f"{old.seq} has another {name} than the replica's entry seq={old.seq}: "
                    "not a carry (a carry re-records every old release unchanged, in "
                    "order), a reset ledger"
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
            query=old.query,
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
    # Its spend may be above its own budget (a site that ran on beside an earlier carry):
    # carrying it into a budget that covers that spend is the way forward.
    report = verify_ledger(old, anchor_path=anchor_path_for(old) if old_anchor is None
                           else old_anchor, check_budget=False)
    report.raise_if_broken()
    header, old_entries = read_ledger(old)
    old_terms = LedgerTerms(header.site_id, header.budget_epsilon, header.delta,
                            header.accountant, header.privacy_unit, header.charge)
    if old_terms == terms:
        raise ConfigError("terms", f"{old} already has these terms; nothing to carry")
    history = carried_history(old_terms, tuple(old_entries), terms, signer, now=now)
    old_spent = old_entries[-1].epsilon_after if old_entries else 0.0
    spent = history.entries[-1].epsilon_after if history.entries else 0.0
    if spent > terms.budget_epsilon:
        raise ConfigError(
            "budget_epsilon",
            f"the spend carried into the new terms, epsilon {spent:.4f}, is above the new "
            f"budget {terms.budget_epsilon:g}: the new ledger would record more spend than "
            f"its budget allows. Give a budget of at least {math.ceil(spent * 1e4) / 1e4:.4f}"
            " (one at the spend refuses every further release)")
    note = (
        f"{CARRY_NOTE_PREFIX}opens with the {len(old_entries)} entries of the ledger {old} (terms "
        f"budget={old_terms.budget_epsilon:g}, delta={old_terms.delta:g}, accountant="
        f"{old_terms.accountant}, charge={old_terms.charge}; head {header.head_hash}; "
        f"epsilon spent {old_spent:.4f}), "
        f"recomposed under the new terms to {spent:.4f}"
    )
    write_new_ledger(new, history, notes=[note])
    write_anchor(anchor_path_for(new), LedgerAnchor(terms.site_id, history.head_seq,
                                                    history.head_hash))
    return Carried(new, len(old_entries), header.head_hash, old_spent, spent, note)
