"""Checking, exporting and restoring a ledger without opening it for writing: the hash
chain and signatures (`common.privacy.signed`), the recomposed epsilons, the anchor;
export as a `SignedHistory` and restore from one.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509

from common.core.errors import (
    ConfigError,
    LedgerForkError,
    LedgerIntegrityError,
    LedgerUnavailable,
)
from common.core.fileio import replace_durably
from common.privacy.ledger_anchor import (
    LedgerAnchor,
    _check_anchor,
    anchor_path_for,
    read_anchor,
    write_anchor,
)
from common.privacy.ledger_store import (
    _ENTRY_COLUMNS,
    EPSILON_RELATIVE_TOLERANCE,
    LedgerHeader,
    _check_format,
    _connect,
    _create_schema,
    _guard,
    _insert_entry,
    _parse_row,
    _read_certificates,
    _read_entries,
    _read_header,
    _terms,
    _transaction,
    add_note,
    read_notes,
)
from common.privacy.receipts import FoundReceipt, HeadReceipt, best, check_against
from common.privacy.recompose import RecordedSpend, recompose_mismatches
from common.privacy.signed import (
    HistoryProblem,
    LedgerTerms,
    SignedEntry,
    SignedHistory,
    check_entries,
    verify_history,
)

# One integrity failure in either a ledger file or a signed history: one type for both.
LedgerProblem = HistoryProblem


@dataclass(frozen=True)
class VerifyReport:
    """Result of `verify_ledger`; `problems[0]` is the first bad entry."""

    path: str
    entries_checked: int
    head_hash: str
    problems: tuple[LedgerProblem, ...] = field(default_factory=tuple)
    epsilons_recomposed: bool = False
    format: int = 2
    signatures_checked: int = 0
    ca_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_broken(self) -> None:
        if self.problems:
            raise LedgerIntegrityError(
                f"ledger {self.path} does not verify: {self.problems[0]}"
                + (f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else "")
            )


def _check_v2(
    connection: sqlite3.Connection,
    *,
    path: Path,
    recompose: bool,
    ca_certificate: x509.Certificate | None = None,
) -> VerifyReport:
    """Header, chain, signatures (and epsilons if `recompose`): every problem found."""
    header = _read_header(connection)
    terms = _terms(header)
    problems: list[LedgerProblem] = []
    if terms.header_hash != header.header_hash:
        problems.append(LedgerProblem(None, "header fields do not match header_hash"))
    rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    entries: list[SignedEntry] = []
    unreadable = False
    for row in rows:
        try:
            entries.append(_parse_row(row))
        except ConfigError as exc:
            problems.append(LedgerProblem(int(row[0]), f"unreadable entry ({exc})"))
            unreadable = True
    if not unreadable:
        found = check_entries(
            terms, entries, _read_certificates(connection), ca_certificate=ca_certificate
        )
        problems.extend(found)
    head = entries[-1].entry_hash if entries else terms.header_hash
    problems.extend(header_problems(header, rows=len(rows), head=head))
    recomposed = recompose and not problems
    if recomposed:
        problems.extend(_recompose_problems(terms, entries))
    return VerifyReport(
        str(path),
        len(rows),
        head,
        tuple(problems),
        epsilons_recomposed=recomposed,
        format=2,
        signatures_checked=len(entries) if not unreadable else 0,
        ca_checked=ca_certificate is not None,
    )


def header_problems(header: LedgerHeader, *, rows: int, head: str) -> list[LedgerProblem]:
    """The header's entry count and head hash against the rows actually present (a
    deleted last entry or an inserted one shows here), in either ledger format."""
    problems = []
    if header.entry_count != rows:
        problems.append(
            LedgerProblem(
                None,
                f"header records {header.entry_count} entries but {rows} are present"
                " (last entry deleted or entry inserted?)",
            )
        )
    if header.head_hash != head:
        problems.append(LedgerProblem(None, "head_hash does not match the last entry"))
    return problems


def _recompose_problems(terms: LedgerTerms, entries: Sequence[SignedEntry]) -> list[LedgerProblem]:
    recorded = (
        RecordedSpend(e.seq, e.mechanisms, e.epsilon_after, e.accountant_used, e.purpose)
        for e in entries
    )
    found = recompose_mismatches(
        recorded,
        delta=terms.delta,
        accountant=terms.accountant,
        charge=terms.charge,
        relative_tolerance=EPSILON_RELATIVE_TOLERANCE,
    )
    return [LedgerProblem(seq, message) for seq, message in found]


def history_problems(
    history: SignedHistory,
    *,
    recompose: bool = True,
    ca_certificate: x509.Certificate | None = None,
) -> list[LedgerProblem]:
    """Every problem of a whole exported history (signatures, chain, epsilons)."""
    problems = list(verify_history(history, ca_certificate=ca_certificate))
    if recompose and not problems:
        problems.extend(_recompose_problems(history.terms, history.entries))
    return problems


# ----------------------------------------------------------------- read-only access


def read_ledger(path: str | Path) -> tuple[LedgerHeader, list[SignedEntry]]:
    """Header and entries of a ledger, read-only and WITHOUT verifying signatures."""
    ledger_path = Path(path)
    with _guard(ledger_path, "reading the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        return _read_header(conn), list(_read_entries(conn))


def ledger_notes(path: str | Path) -> list[str]:
    """The warnings recorded in a ledger (e.g. a restore accepted below a receipt)."""
    ledger_path = Path(path)
    with _guard(ledger_path, "reading the ledger"), _connect(ledger_path, mode="ro") as conn:
        return read_notes(conn)


def verify_ledger(
    path: str | Path,
    *,
    recompose: bool = True,
    ca_certificate: x509.Certificate | None = None,
    anchor_path: str | Path | None = None,
    check_budget: bool = True,
) -> VerifyReport:
    """Re-walk a ledger (read-only): header, hash chain, every signature with the
    certificate it names (issued by `ca_certificate` if given) and, when the rest is
    intact and `recompose` is set, every `epsilon_after`. With `anchor_path` (format 2),
    also the anchor file there, if any: it catches what the file alone cannot, a last
    entry deleted together with a header made to match (as the site does on open).
    With `check_budget`, an entry whose spend is above the ledger's budget is a
    problem too (`budget_problems`).

    LedgerUnavailable if the file is missing, is not a ledger or is a format-1 one (the
    message names `medfed ledger migrate`)."""
    ledger_path = Path(path)
    with _guard(ledger_path, "verifying the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        report = _check_v2(conn, path=ledger_path, recompose=recompose,
                           ca_certificate=ca_certificate)
        found: list[LedgerProblem] = []
        if check_budget and report.ok:
            found.extend(budget_problems(_terms(_read_header(conn)), _read_entries(conn)))
        if anchor_path is not None:
            found.extend(_anchor_problems(conn, ledger_path, Path(anchor_path)))
    return dataclasses.replace(report, problems=report.problems + tuple(found))


def budget_problems(terms: LedgerTerms, entries: Sequence[SignedEntry]) -> list[LedgerProblem]:
    """The first entry whose composed spend is above the ledger's budget. `reserve`
    refuses such an entry in the transaction that would write it, so one on file was
    written under other terms (a site agent that went on running beside `medfed ledger
    carry` with its old budget) or by someone holding the site's key: either way the
    budget did not hold."""
    for entry in entries:
        if entry.epsilon_after > terms.budget_epsilon:
            return [LedgerProblem(
                entry.seq,
                f"the spend after it, epsilon {entry.epsilon_after:.4f}, is above the "
                f"ledger's budget {terms.budget_epsilon:g}: a release the budget did not "
                "allow (recorded by a process under other terms, e.g. a site agent that "
                "kept running beside `medfed ledger carry`)")]
    return []


def _anchor_problems(
    connection: sqlite3.Connection, path: Path, anchor_file: Path
) -> list[LedgerProblem]:
    """The anchor check the site runs when it opens its ledger, as problems."""
    try:
        anchor = read_anchor(anchor_file)
        if anchor is None:
            return []
        entries = list(_read_entries(connection))
    except LedgerUnavailable as exc:
        return [LedgerProblem(None, str(exc))]
    except LedgerIntegrityError:
        return []  # an unreadable entry: _check_v2 already reported it
    try:
        _check_anchor(path, anchor, _read_header(connection).site_id, entries)
    except LedgerForkError as exc:
        return [LedgerProblem(None, f"anchor {anchor_file}: {exc}")]
    return []


def export_ledger(path: str | Path, *, after_seq: int = 0) -> SignedHistory:
    """The ledger's signed history (entries after `after_seq`) and certificates."""
    ledger_path = Path(path)
    with _guard(ledger_path, "exporting the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        header = _read_header(conn)
        entries = [e for e in _read_entries(conn) if e.seq > after_seq]
        certificates = _read_certificates(conn)
    used = {e.cert_sha256 for e in entries}
    return SignedHistory(
        _terms(header),
        tuple(entries),
        {digest: der for digest, der in certificates.items() if digest in used},
    )


def restore_ledger(
    history: SignedHistory,
    path: str | Path,
    *,
    anchor_path: str | Path | None = None,
    min_seq: int = 0,
    ca_certificate: x509.Certificate | None = None,
    site_id: str | None = None,
    receipts: Sequence[FoundReceipt] = (),
    accept_lower_bound: bool = False,
    accept_unverified_head: bool = False,
) -> RestoreResult:
    """Write `history` as a new ledger at `path` after verifying all of it.

    Refuses (LedgerIntegrityError / LedgerForkError, nothing written) a history whose
    signatures, chain or epsilons do not verify, that is for another site, that is
    shorter than `min_seq` or than the anchor's head, or that does not contain the
    anchor's head. It also refuses one shorter than, or forked from, any signed head
    receipt: `receipts` (from the site's receipts folders) and the one the export itself
    carries (a site's own backup); the error names the receipt that proved it. With
    `accept_lower_bound` such a history is restored anyway and the receipts it falls
    short of are recorded in the ledger as a warning (`RestoreResult.lowered`).

    A history checked against no head at all (no receipt, no anchor: a state folder lost
    with no receipts kept) is refused too, saying what cannot be verified: every entry
    in it verifies, but nothing shows that none were dropped after its last one. With
    `accept_unverified_head` it is restored, and the ledger records for good that its
    completeness was not verified (`RestoreResult.notes`). Never overwrites an existing
    ledger. Even a restore matching every receipt proves a LOWER bound only: entries
    after the newest receipt cannot be known."""
    ledger_path = Path(path)
    anchor_file = anchor_path_for(ledger_path) if anchor_path is None else Path(anchor_path)
    if ledger_path.exists():
        raise LedgerUnavailable(
            ledger_path, f"{ledger_path} exists; a restore never overwrites a ledger "
            "(move it aside first if it is damaged)"
        )
    for target, what in ((ledger_path, "ledger"), (anchor_file, "anchor")):
        # Never created here: a mistyped --ledger would put the restored ledger where
        # the site agent never reads it, which then starts from an empty one elsewhere.
        if not target.parent.is_dir():
            raise LedgerUnavailable(
                ledger_path, f"the folder {target.parent} for the restored {what} "
                f"{target} does not exist. A restore creates no folder: name the site's "
                "state folder (the one `site run --state` uses; the ledger is "
                "STATE/privacy-ledger.db), or create it first if this is a new machine "
                f"(`mkdir -m 700 {target.parent}`)"
            )
    if site_id is not None and history.terms.site_id != site_id:
        raise LedgerIntegrityError(
            f"the export is for site {history.terms.site_id!r}, not {site_id!r}"
        )
    problems = history_problems(history, ca_certificate=ca_certificate)
    if problems:
        raise LedgerIntegrityError(f"the export does not verify: {problems[0]}"
                                   + (f" (+{len(problems) - 1} more)" if len(problems) > 1
                                      else ""))
    anchor = read_anchor(anchor_file)
    floor = max(min_seq, anchor.seq if anchor is not None else 0)
    if history.head_seq < floor:
        raise LedgerForkError(
            f"the export ends at seq {history.head_seq}, but this site is known to have "
            f"reached seq {floor}: restoring it would forget spent budget"
        )
    if anchor is not None:
        _check_anchor(ledger_path, anchor, history.terms.site_id, history.entries)
    found = [*receipts, *_embedded_receipt(history, ca_certificate)]
    lowered: list[tuple[FoundReceipt, str]] = []
    for receipt in sorted(found, key=lambda f: -f.receipt.entries):
        if receipt.receipt.site_id != history.terms.site_id:
            raise LedgerIntegrityError(
                f"head receipt {receipt.where} is for site {receipt.receipt.site_id!r}, not "
                f"{history.terms.site_id!r}")
        try:
            check_against(receipt, history.terms, history.entries, what="the export")
        except LedgerForkError as exc:
            if not accept_lower_bound:
                raise LedgerForkError(
                    f"{exc}. Find a complete copy (a later backup, the coordinator's "
                    "replica); only if none exists, restore this one with "
                    "--accept-lower-bound (the ledger then records that it is lower than "
                    "the site's own receipt)") from None
            lowered.append((receipt, str(exc)))
    unverified = anchor is None and not found
    if unverified and not accept_unverified_head:
        raise LedgerIntegrityError(unverified_refusal(history, anchor_file))
    notes = [
        f"LOWER THAN A SIGNED HEAD RECEIPT: restored {history.head_seq} entries (head "
        f"{history.head_hash[:16]}...), but the receipt {r.where} records {r.receipt.entries} "
        f"entries and epsilon {r.receipt.epsilon_spent:.4f}; accepted with "
        f"--accept-lower-bound. The spend shown UNDERSTATES the site's real spend by the "
        f"entries lost ({why})"
        for r, why in lowered
    ]
    if unverified:
        notes.append(unverified_note(history))
    write_new_ledger(ledger_path, history, notes=notes)
    restored = LedgerAnchor(history.terms.site_id, history.head_seq, history.head_hash)
    write_anchor(anchor_file, restored)
    return RestoreResult(restored, tuple(r for r, _ in lowered), tuple(notes),
                         best(found), anchored=anchor is not None)


UNVERIFIED_NOTE_PREFIX = "COMPLETENESS NOT VERIFIED: "
"""How the note of a restore accepted with no head to check it against starts."""


def unverified_refusal(history: SignedHistory, anchor_file: Path) -> str:
    """Why a restore with nothing to check the export's head against is refused, and
    what to do (the CLI's flags are named: this is what an operator reads)."""
    return (
        f"nothing shows that this export of site {history.terms.site_id} is complete: "
        f"its {history.head_seq} entries verify, but a signed history cannot show that "
        "no entries were dropped after its last one (anyone holding it, the coordinator "
        "included, can cut it short and the rest still verifies), and there is no signed "
        "head receipt to check it against (none given with --receipts DIR or --receipt "
        f"FILE, none inside the export) and no anchor at {anchor_file}. Give the site's "
        "receipts folder (privacy.receipts_dir, or a copy of it), or restore from the "
        "site's own `medfed ledger backup` (it carries a receipt). Only if no receipt "
        "exists anywhere, restore it with --accept-unverified-head: the ledger then "
        "records for good that its completeness was not verified, and what is left to "
        "catch a cut-short export is the coordinator's replica (an honest coordinator "
        "refuses a ledger shorter than it holds when the site enrols) and your own "
        "records of how far the ledger went (--min-seq N)")


def unverified_note(history: SignedHistory) -> str:
    return (
        f"{UNVERIFIED_NOTE_PREFIX}restored {history.head_seq} entries (head "
        f"{history.head_hash[:16]}..., epsilon "
        f"{history.entries[-1].epsilon_after if history.entries else 0.0:.4f}) with no "
        "signed head receipt and no anchor to check them against; accepted with "
        "--accept-unverified-head. Entries recorded after this head, if any, are not in "
        "this ledger: the spend shown may UNDERSTATE the site's real spend")


@dataclass(frozen=True)
class RestoreResult:
    """What `restore_ledger` wrote: the new anchor, the receipts it was accepted below
    (empty unless `accept_lower_bound`), the warnings recorded, the best receipt seen,
    and whether an anchor checked it (`anchored`)."""

    anchor: LedgerAnchor
    lowered: tuple[FoundReceipt, ...]
    notes: tuple[str, ...]
    best_receipt: FoundReceipt | None
    anchored: bool = False

    # The anchor's fields, so callers that only need the head read it directly.
    @property
    def seq(self) -> int:
        return self.anchor.seq

    @property
    def site_id(self) -> str:
        return self.anchor.site_id

    @property
    def head_hash(self) -> str:
        return self.anchor.head_hash


def _embedded_receipt(
    history: SignedHistory, ca_certificate: x509.Certificate | None
) -> list[FoundReceipt]:
    """The head receipt a site's own backup carries (verified; none in a coordinator's
    export)."""
    if history.head_receipt is None:
        return []
    try:
        receipt = HeadReceipt.from_json_dict(dict(history.head_receipt))
    except ConfigError as exc:
        raise LedgerIntegrityError(f"the export's head receipt is damaged ({exc})") from None
    problem = receipt.problem(ca_certificate=ca_certificate)
    if problem is not None:
        raise LedgerIntegrityError(f"the export's head receipt does not verify: {problem}")
    return [FoundReceipt(receipt, "carried by the export itself")]


def write_new_ledger(path: Path, history: SignedHistory, *, notes: Sequence[str] = ()) -> None:
    """Write `history` (already verified or freshly signed by the caller) as the ledger
    at `path`: built in a temporary file, checked, then renamed over `path` in one step."""
    temporary = path.with_name(path.name + ".restoring")
    with _guard(path, "writing the ledger"):
        for leftover in (temporary, Path(f"{temporary}-wal"), Path(f"{temporary}-shm")):
            leftover.unlink(missing_ok=True)
        with _connect(temporary, mode="rwc") as conn:
            with _transaction(conn):
                _create_schema(conn, history.terms)
                for digest, der in history.certificates.items():
                    conn.execute(
                        "INSERT INTO ledger_certificates (sha256, der) VALUES (?, ?)",
                        (digest, der),
                    )
                for entry in history.entries:
                    _insert_entry(conn, entry)
                for note in notes:
                    add_note(conn, note)
            _check_v2(conn, path=path, recompose=False).raise_if_broken()
        replace_durably(temporary, path)


