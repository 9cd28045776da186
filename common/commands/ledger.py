"""`medfed ledger ...`: a site's privacy ledger for its privacy officer and auditors.

``medfed ledger show|verify`` read a site's ledger without changing it (a read-only copy
reads too), ``medfed ledger export`` (coordinator) writes a site's replicated signed
history, ``medfed ledger backup`` (site) its own history with a signed head receipt,
``medfed ledger restore`` (site) rebuilds a lost ledger from either (refused, unless
told to accept it, when no receipt or anchor can check its head), ``medfed ledger
carry`` moves a ledger's spend under new terms and ``medfed ledger migrate`` turns a
format-1 ledger into a signed one. The last three hold the site's state folder
(`site_stopped`): refused while its site agent runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.core.errors import ConfigError, LedgerIntegrityError, MedfedError
from common.core.state_lock import StateLock
from common.privacy.accountant import ACCOUNTANTS
from common.privacy.carry import carry_ledger
from common.privacy.hospital import guarantees, largest_intermediaries
from common.privacy.layered import charged_by_purpose
from common.privacy.ledger import (
    LedgerSigner,
    VerifyReport,
    anchor_path_for,
    export_ledger,
    ledger_notes,
    read_ledger,
    restore_ledger,
    verify_ledger,
)
from common.privacy.mechanisms import (
    describe,
    mechanism_from_json_dict,
    mechanism_to_json_dict,
)
from common.privacy.migrate import migrate_ledger
from common.privacy.purpose import Purpose
from common.privacy.receipts import (
    SUPERSEDED_SUFFIX,
    check_against,
    read_receipt_file,
    read_receipts,
    sign_receipt,
    write_receipt,
)
from common.privacy.replica import export_from_state
from common.privacy.signed import (
    CHARGE_RECORD_LEVEL,
    CHARGE_UNIT,
    CHARGES,
    LedgerTerms,
    SignedHistory,
)
from common.protocol.pki import load_certificate


@contextlib.contextmanager
def site_stopped(ledger: Path, command: str) -> Iterator[None]:
    """Hold the ledger's folder, the site's state folder, for `medfed ledger COMMAND` as
    a running site agent holds it (`common.core.state_lock`): refused (StateError naming the
    agent) while one runs there, and no agent starts there until the command is done.
    An agent running beside a carry, migrate or restore would go on recording under the
    ledger and terms it opened. A missing folder is left to the command to name."""
    folder = ledger.parent
    if not folder.is_dir():
        yield
        return
    with StateLock.acquire(
        folder, role=f"medfed ledger {command}",
        advice=f"`medfed ledger {command}` needs the site agent stopped: stop it, run the "
        "command again, then start the site",
    ):
        yield


def print_json(value: Any) -> None:
    print(json.dumps(value, sort_keys=True))


def write_new_file(out: Path, data: bytes) -> None:
    """Write `data` to `out`, which must not exist yet (an export or backup never
    overwrites an earlier one)."""
    try:
        with out.open("xb") as handle:
            handle.write(data)
    except FileExistsError:
        raise ConfigError("out", f"{out} exists; choose a new file") from None
    except OSError as exc:
        raise ConfigError("out", f"cannot write {out}: {exc.strerror}") from None


def _ledger_summary(path: Path) -> dict[str, Any]:
    header, entries = read_ledger(path)
    rows = []
    previous = 0.0
    for entry in entries:
        mechanisms = entry.mechanisms
        purpose = entry.purpose
        rows.append(
            {
                "seq": entry.seq,
                "round": entry.round,
                "purpose": purpose,
                "mechanisms": [mechanism_to_json_dict(m) for m in mechanisms],
                "segments": [list(s.as_tuple()) for s in entry.segments],
                "steps": sum(s.steps for s in entry.segments),
                # Increase of the COMPOSED epsilon, not a stand-alone per-round epsilon
                # (those must never be summed).
                "epsilon_increase": entry.epsilon_after - previous,
                "epsilon_after": entry.epsilon_after,
                "accountant_used": entry.accountant_used,
                "created_at": entry.created_at,
                "status": entry.status,
                "entry_hash": entry.entry_hash,
                "signed": bool(entry.signature),
                **({"query": entry.query.to_json_dict()} if entry.query is not None else {}),
            }
        )
        previous = entry.epsilon_after
    spent = entries[-1].epsilon_after if entries else 0.0
    return {
        "ledger": str(path),
        "format": 2,
        "site_id": header.site_id,
        "privacy_unit": header.privacy_unit,
        "budget_epsilon": header.budget_epsilon,
        "delta": header.delta,
        "accountant": header.accountant,
        # What the budget is charged with (common.privacy.signed.CHARGES).
        "charge": header.charge,
        "spent_epsilon": spent,
        "remaining_epsilon": max(0.0, header.budget_epsilon - spent),
        # Each purpose composed ALONE, as the ledger charges (DP-SGD beneath a hospital
        # round: the better path, common.privacy.layered): they do not add up to
        # spent_epsilon.
        "epsilon_by_purpose": charged_by_purpose(
            [(e.purpose, e.mechanisms) for e in entries], delta=header.delta,
            accountant=header.accountant, charge=header.charge),
        "entries": rows,
        # The approved queries answered, by name (each entry also in `entries`).
        "queries": [
            {**entry.query.to_json_dict(), "round": entry.round,
             "epsilon_increase": row["epsilon_increase"]}
            for entry, row in zip(entries, rows, strict=True) if entry.query is not None
        ],
        "head_hash": header.head_hash,
        "warnings": ledger_notes(path),
        **_guarantees(header, entries),
    }


def _guarantees(header: Any, entries: Any) -> dict[str, Any]:
    """Under hospital-level DP three figures, named plainly
    (`common.privacy.hospital.Guarantees`): hospital-level and intermediary-level (model
    updates only, add/remove one hospital / one intermediary) and per-patient (every
    release, the DDGauss rounds at 2S, or with DP-SGD beneath the better of that and the
    DP-SGD path). `spent_epsilon` is what the budget is charged with (`budget_charge`)."""
    if header.privacy_unit != "hospital":
        return {}

    pairs = [(e.purpose, e.mechanisms) for e in entries]
    figures = guarantees(pairs, delta=header.delta, accountant=header.accountant)
    out: dict[str, Any] = {
        "hospital_level_epsilon": figures.hospital,
        "intermediary_level_epsilon": figures.intermediary,
        "per_patient_epsilon": figures.per_patient,
        "intermediaries_max": figures.largest_v,
        "intermediaries_by_round": {
            str(e.round): largest_intermediaries([(Purpose.TRAINING, e.mechanisms)])
            for e in entries if e.purpose == Purpose.TRAINING
        },
        "budget_charge": (
            "the larger of the record/patient-level epsilon (the better of the DP-SGD "
            "and hospital paths) and the hospital-level composition (every release, the "
            "model updates at add/remove one hospital): the budget caps both"
            if figures.layered else
            "the per-patient epsilon (every release, the model updates at 2S, replace "
            "relation): the budget caps it, and with it the per-"
            + ("intermediary" if figures.largest_v > 1 else "hospital")
            + " composition at S"
            if header.charge == CHARGE_RECORD_LEVEL else
            "every release composed, the model updates at add/remove one "
            + ("intermediary" if figures.largest_v > 1 else "hospital")
            + " (sensitivity S; a ledger written before the per-patient charge): NOT "
            "per-patient"),
    }
    if figures.layered:
        out["record_level_epsilon"] = figures.per_patient
        out["dpsgd_path_epsilon"] = figures.dpsgd_path
        out["hospital_path_epsilon"] = figures.hospital_path
    return out


def _print_hospital_figures(summary: dict[str, Any]) -> None:
    """The three hospital-mode figures, each with the relation it holds for."""
    v = summary.get("intermediaries_max", 1)
    by_round = summary.get("intermediaries_by_round", {})
    print(f"  charged with: {summary['budget_charge']}")
    print(f"hospital-level epsilon     {summary['hospital_level_epsilon']:.4f}: add/remove one "
          "hospital, MODEL UPDATES ONLY" + (
              f" (each round v-fold group privacy at its own v, largest v {v})" if v > 1
              else ""))
    print(f"intermediary-level epsilon {summary['intermediary_level_epsilon']:.4f}: add/remove "
          "one intermediary (clip S), MODEL UPDATES ONLY" + (
              "" if v > 1 else "; v = 1, so the same unit as the hospital"))
    if v > 1 and by_round:
        print("  v per round               " + ", ".join(
            f"{number}:{n}" for number, n in by_round.items()))
    if "record_level_epsilon" in summary:
        print(f"per-patient epsilon        {summary['per_patient_epsilon']:.4f}: every release; "
              "the better of the DP-SGD path "
              f"{summary['dpsgd_path_epsilon']:.4f} and the hospital path (replace relation, "
              f"2S) {summary['hospital_path_epsilon']:.4f} (per record when the study's "
              "record_level is 'record')")
    else:
        print(f"per-patient epsilon        {summary['per_patient_epsilon']:.4f}: every release, "
              "a patient added or removed inside a unit that stays in the round (model "
              "updates at 2S, replace relation)")


def _integrity(path: Path, *, check_budget: bool = True) -> VerifyReport:
    """What `show` checks before printing figures: `ledger verify --hashes-only` plus
    the anchor beside the ledger (header, hash chain, entry count and head, every
    signature, no spend above the budget), so a deleted or edited entry never shows as
    a smaller spend. Linear in the entries; recomposing every epsilon (quadratic) is
    left to `verify`."""
    return verify_ledger(path, recompose=False, anchor_path=anchor_path_for(path),
                         check_budget=check_budget)


def _integrity_json(report: VerifyReport) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "checked": "header, hash chain, entry count and head, signatures, spend within "
                   "the budget, anchor (epsilons are recomposed by `medfed ledger verify`)",
        "problems": [str(p) for p in report.problems],
    }


def _integrity_banner(report: VerifyReport) -> str:
    more = f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
    return (f"INTEGRITY FAILURE: {report.problems[0]}{more}. The figures below are NOT "
            "trustworthy (an entry deleted or edited understates the spend): run "
            f"`medfed ledger verify --ledger {report.path}`")


def _cmd_ledger_show(args: argparse.Namespace) -> int:
    path = Path(args.ledger)
    report = _integrity(path)
    try:
        summary = _ledger_summary(path)
    except MedfedError:
        if report.ok:
            raise
        summary = None  # too damaged to summarise: the integrity failure says why
    if args.json:
        print_json({**(summary or {"ledger": str(path)}), "integrity": _integrity_json(report)})
    else:
        if not report.ok:
            print(_integrity_banner(report))
            print()
        if summary is None:
            print(f"ledger {path}: an entry is unreadable; nothing else can be shown")
        else:
            _print_ledger(summary)
    if report.ok:
        return 0
    print(f"ledger {report.path}: {_integrity_banner(report)}", file=sys.stderr)
    for problem in report.problems[1:]:
        print(f"  also: {problem}", file=sys.stderr)
    return 1


def _print_ledger(summary: dict[str, Any]) -> None:
    unit = summary["privacy_unit"]
    level = {"patient": "patient-level", "hospital": "hospital-level"}.get(unit, "record-level")
    for warning in summary.get("warnings", []):
        print(f"WARNING: {warning}")
    print(f"ledger        {summary['ledger']} (format {summary['format']})")
    print(f"site          {summary['site_id']}")
    print(f"privacy unit  {unit} ({level} DP)")
    print(
        f"budget        epsilon={summary['budget_epsilon']:g} at delta={summary['delta']:g} "
        f"({summary['accountant']} accountant)"
    )
    print(
        f"spent         {summary['spent_epsilon']:.4f}   "
        f"remaining {summary['remaining_epsilon']:.4f}"
    )
    for purpose, epsilon in summary["epsilon_by_purpose"].items():
        print(f"  {purpose:<11} {epsilon:.4f} (alone; purposes compose, they do not add)")
    if "hospital_level_epsilon" in summary:
        _print_hospital_figures(summary)
    if summary["queries"]:
        print("queries answered")
        for query in summary["queries"]:
            print(f"  {query['name']} (round {query['round']}, +epsilon "
                  f"{query['epsilon_increase']:.4f}, sha256 {query['sha256'][:16]}...)")
    print(f"head hash     {summary['head_hash']}")
    print()
    print(
        f"{'seq':>4} {'round':>6} {'purpose':<10} {'+epsilon':>9} {'epsilon':>9}  "
        "created_at / mechanisms"
    )
    for row in summary["entries"]:
        print(
            f"{row['seq']:>4} {row['round']:>6} {row['purpose']:<10} "
            f"{row['epsilon_increase']:>9.4f} {row['epsilon_after']:>9.4f}  {row['created_at']}"
        )
        if "query" in row:
            print(f"{'':>33}query {row['query']['name']} (sha256 {row['query']['sha256']})")
        for raw in row["mechanisms"]:
            print(f"{'':>33}{describe(mechanism_from_json_dict(raw))}")


def _load_ca(path: str | None) -> Any:
    if path is None:
        return None

    return load_certificate(path)


def _cmd_ledger_verify(args: argparse.Namespace) -> int:
    report = verify_ledger(
        args.ledger, recompose=not args.hashes_only, ca_certificate=_load_ca(args.ca),
        anchor_path=anchor_path_for(args.ledger),
    )
    if report.ok:
        checked = "hash chain and epsilons" if report.epsilons_recomposed else "hash chain"
        signatures = f"{report.signatures_checked} signatures verified" + (
            " against the CA" if report.ca_checked else " (certificates not checked "
            "against a CA: give --ca)"
        )
        print(
            f"ledger {report.path}: OK ({report.entries_checked} entries; {checked} verified; "
            f"{signatures}; head {report.head_hash})"
        )
        for warning in ledger_notes(args.ledger):
            print(f"WARNING: {warning}")
        return 0
    print(f"ledger {report.path}: INTEGRITY FAILURE", file=sys.stderr)
    print(f"first problem: {report.problems[0]}", file=sys.stderr)
    for problem in report.problems[1:]:
        print(f"  also: {problem}", file=sys.stderr)
    return 1


def _cmd_ledger_export(args: argparse.Namespace) -> int:
    data = export_from_state(args.site, state=args.state, database_url=args.database_url)
    if args.out is None:
        sys.stdout.write(data.decode("ascii") + "\n")
        return 0
    out = Path(args.out)
    write_new_file(out, data)
    print(f"wrote the signed ledger history of {args.site} to {out}")
    return 0


def _cmd_ledger_restore(args: argparse.Namespace) -> int:
    source = Path(args.source)
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise ConfigError("from", f"cannot read {source}: {exc.strerror}") from None
    try:
        history = SignedHistory.from_bytes(data)
    except LedgerIntegrityError as exc:
        raise LedgerIntegrityError(f"{source}: {exc}") from None
    if args.min_seq < 0:
        raise ConfigError("min_seq", "must be >= 0")
    ca = _load_ca(args.ca)
    site = history.terms.site_id
    found = []
    for folder in args.receipts:
        receipt = read_receipts(folder, site, ca_certificate=ca)
        if receipt is not None:
            found.append(receipt)
    for file in args.receipt:
        receipt = read_receipt_file(file, site, ca_certificate=ca)
        if receipt is None:
            raise ConfigError("receipt", f"no head receipt at {file}")
        found.append(receipt)
    ledger = Path(args.ledger)
    with site_stopped(ledger, "restore"):
        result = restore_ledger(
            history,
            ledger,
            anchor_path=args.anchor,
            min_seq=args.min_seq,
            ca_certificate=ca,
            site_id=args.site,
            receipts=found,
            accept_lower_bound=args.accept_lower_bound,
            accept_unverified_head=args.accept_unverified_head,
        )
        for lowered in result.lowered:
            _supersede(Path(lowered.where))
    for note in result.notes:
        print(f"WARNING: {note}", file=sys.stderr)
    anchor = anchor_path_for(ledger) if args.anchor is None else args.anchor
    proof = (
        f"; checked against the signed head receipt {result.best_receipt.where} "
        f"({result.best_receipt.receipt.entries} entries)"
        if result.best_receipt is not None and not result.lowered
        else "" if result.lowered else
        f"; checked against its anchor {anchor}" if result.anchored else
        "; its completeness was NOT verified (no signed head receipt, no anchor; "
        "accepted with --accept-unverified-head)"
    )
    print(
        f"restored {result.seq} signed entries of site {result.site_id} into {args.ledger} "
        f"(head {result.head_hash}){proof}; this is a LOWER bound on the site's spend: "
        "anything recorded after the newest receipt is not in it"
    )
    return 0


def _supersede(path: Path) -> None:
    """A receipt an accepted lower restore fell short of: kept beside, no longer read
    (the site would otherwise refuse its restored ledger)."""
    if not path.is_file():
        return  # the receipt carried by the export itself
    target = path.with_name(path.name + SUPERSEDED_SUFFIX)
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}{SUPERSEDED_SUFFIX}.{number}")
    try:
        path.rename(target)
    except OSError as exc:
        raise ConfigError("receipts", f"cannot move the superseded receipt {path} aside "
                          f"({exc.strerror}); the site will refuse the restored ledger "
                          "until it is moved") from None
    print(f"WARNING: the receipt {path} is kept as {target}", file=sys.stderr)


def _cmd_ledger_backup(args: argparse.Namespace) -> int:
    """The site's own backup: its whole signed history plus a signed head receipt."""
    path = Path(args.ledger)
    # A spend above the budget does not stop a backup: the backup is the evidence.
    report = _integrity(path, check_budget=False)
    report.raise_if_broken()
    signer = LedgerSigner.from_files(args.cert, args.key)
    history = export_ledger(path)
    _, entries = read_ledger(path)
    receipt = sign_receipt(signer, history.terms, entries)
    data = dataclasses.replace(history, head_receipt=receipt.to_json_dict()).to_bytes()
    out = Path(args.out)
    write_new_file(out, data)
    print(f"wrote {len(entries)} signed entries of {history.terms.site_id} and a signed head "
          f"receipt (head {receipt.head_hash[:16]}..., epsilon {receipt.epsilon_spent:.4f}) "
          f"to {out}")
    return 0


def _cmd_ledger_carry(args: argparse.Namespace) -> int:
    """New terms for a site's ledger, its spend carried (`common.privacy.carry`), with
    the site stopped."""
    ledger = Path(args.ledger)
    with site_stopped(ledger, "carry"):
        return _carry(args, ledger)


def _carry(args: argparse.Namespace, ledger: Path) -> int:
    header, entries = read_ledger(ledger)
    old_terms = LedgerTerms(header.site_id, header.budget_epsilon, header.delta,
                            header.accountant, header.privacy_unit, header.charge)
    terms = LedgerTerms(
        site_id=header.site_id,
        budget_epsilon=header.budget_epsilon if args.budget_epsilon is None
        else args.budget_epsilon,
        delta=header.delta if args.delta is None else args.delta,
        accountant=header.accountant if args.accountant is None else args.accountant,
        privacy_unit=header.privacy_unit,
        charge=header.charge if args.charge is None else args.charge,
    )
    if terms.charge == CHARGE_RECORD_LEVEL and terms.privacy_unit != "hospital":
        raise ConfigError("charge", f"{CHARGE_RECORD_LEVEL!r} is the charge of a "
                          f"hospital-unit ledger; {ledger} is {terms.privacy_unit}-level")
    if not (terms.budget_epsilon > 0 and 0 < terms.delta < 1):
        raise ConfigError("budget_epsilon", "needs budget > 0 and delta in (0, 1)")
    receipt = None if args.receipts is None else read_receipts(args.receipts, header.site_id)
    if receipt is not None:
        check_against(receipt, old_terms, entries, what=f"privacy ledger {ledger}")
    signer = LedgerSigner.from_files(args.cert, args.key)
    number = 1
    while (kept := ledger.with_name(f"{ledger.name}.terms-{number}")).exists():
        number += 1
    # Fold the write-ahead log into the file, then move the old ledger (and its anchor)
    # aside: it is kept for audit, the new one takes its place.
    with contextlib.closing(sqlite3.connect(ledger)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    anchor, kept_anchor = anchor_path_for(ledger), anchor_path_for(kept)
    ledger.rename(kept)
    if anchor.exists():
        anchor.rename(kept_anchor)
    try:
        done = carry_ledger(kept, ledger, terms=terms, signer=signer,
                            now=dt.datetime.now(dt.UTC))
    except BaseException:
        ledger.unlink(missing_ok=True)
        kept.rename(ledger)
        if kept_anchor.exists():
            kept_anchor.rename(anchor)
        raise
    if args.receipts is not None:
        write_receipt(args.receipts, sign_receipt(signer, terms, read_ledger(ledger)[1]))
    print(
        f"carried {done.entries} entries into {ledger} under budget={terms.budget_epsilon:g}, "
        f"delta={terms.delta:g}, accountant={terms.accountant}: spent {done.spent:.4f} "
        f"(was {done.old_spent:.4f} under the old terms), remaining "
        f"{max(0.0, terms.budget_epsilon - done.spent):.4f}; the old ledger is kept as {kept}"
    )
    return 0


def _cmd_ledger_migrate(args: argparse.Namespace) -> int:
    signer = LedgerSigner.from_files(args.cert, args.key)
    with site_stopped(Path(args.ledger), "migrate"):
        done = migrate_ledger(Path(args.ledger), signer, anchor_path=args.anchor)
    if done is None:
        print(f"ledger {args.ledger}: already format 2 (signed); nothing to migrate")
        return 0
    print(
        f"migrated {done.path} to format 2: {done.entries} entries signed by "
        f"{signer.site_id}, epsilon spent {done.spent_epsilon:.4f} (unchanged), head "
        f"{done.head_hash}; the format-1 original is kept as {done.backup_path}"
    )
    return 0


def register_ledger(subparsers: Any) -> None:
    """Entry point ``ledger``: adds `medfed ledger show|verify|export|restore|migrate`."""
    parser = subparsers.add_parser("ledger", help="read and verify a site's privacy ledger")
    commands = parser.add_subparsers(dest="ledger_command", metavar="SUBCOMMAND")
    commands.required = True

    show = commands.add_parser(
        "show", help="per-round and cumulative epsilon, budget left; checks the hash chain, "
        "entry count, signatures and anchor first (exit 1, INTEGRITY FAILURE, if broken)")
    show.add_argument("--ledger", required=True, help="path of the site's ledger file")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=_cmd_ledger_show)

    verify = commands.add_parser(
        "verify", help="check the hash chain, recompose every epsilon and check that no "
        "entry's spend is above the budget (exit 1 if broken)"
    )
    verify.add_argument("--ledger", required=True, help="path of the site's ledger file")
    verify.add_argument(
        "--hashes-only", action="store_true", help="skip recomposing epsilons (faster)"
    )
    verify.add_argument(
        "--ca", help="federation CA certificate (PEM): signing certificates must be its"
    )
    verify.set_defaults(func=_cmd_ledger_verify)

    export = commands.add_parser(
        "export", help="(coordinator) a site's replicated signed ledger history, for restore"
    )
    export.add_argument("--site", required=True, help="site id")
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument("--state", help="the coordinator's state folder (coordinator.db)")
    where.add_argument("--database-url", help="the coordinator's state database URL")
    export.add_argument("--out", help="write to this new file instead of stdout")
    export.set_defaults(func=_cmd_ledger_export)

    restore = commands.add_parser(
        "restore",
        help="(site) rebuild a lost ledger from an export, verifying every signature",
    )
    restore.add_argument("--from", dest="source", required=True, help="the export file")
    restore.add_argument("--ledger", required=True, help="where the ledger goes (must not exist)")
    restore.add_argument(
        "--anchor", help="the ledger's anchor file (default: LEDGER.anchor beside it)"
    )
    restore.add_argument(
        "--min-seq", type=int, default=0,
        help="refuse a history with fewer entries (e.g. the last head the site reported)",
    )
    restore.add_argument("--ca", help="federation CA certificate (PEM) the signers must chain to")
    restore.add_argument("--site", help="refuse an export for another site")
    restore.add_argument(
        "--receipts", action="append", default=[], metavar="DIR",
        help="a receipts folder (the site's privacy.receipts_dir, a copy of it): refuse a "
        "history shorter than, or forked from, the signed head receipt there (repeatable)")
    restore.add_argument(
        "--receipt", action="append", default=[], metavar="FILE",
        help="one head receipt file (repeatable)")
    restore.add_argument(
        "--accept-lower-bound", action="store_true",
        help="restore a history shorter than a signed head receipt anyway (when no "
        "complete copy exists); the ledger records the warning for good")
    restore.add_argument(
        "--accept-unverified-head", action="store_true",
        help="restore a history with no signed head receipt and no anchor to check its "
        "head against (refused otherwise: nothing shows no entries were dropped from its "
        "end); only when no receipt exists anywhere. Logged, and the ledger records the "
        "warning for good")
    restore.set_defaults(func=_cmd_ledger_restore)

    backup = commands.add_parser(
        "backup", help="(site) the ledger's signed history plus a signed head receipt, "
        "to a new file (restore refuses a truncated copy of it)")
    backup.add_argument("--ledger", required=True, help="path of the site's ledger file")
    backup.add_argument("--cert", required=True, help="the site's certificate (PEM)")
    backup.add_argument("--key", required=True, help="the site's private key (PEM)")
    backup.add_argument("--out", required=True, help="the new backup file")
    backup.set_defaults(func=_cmd_ledger_backup)

    carry = commands.add_parser(
        "carry",
        help="(site, stopped) new budget, delta, accountant or charge for a ledger: a new "
        "ledger "
        "that opens with the whole old history (its spend counts); the old one is kept "
        "as LEDGER.terms-N")
    carry.add_argument("--ledger", required=True, help="the site's ledger file")
    carry.add_argument("--budget-epsilon", type=float, help="the new budget (default: kept)")
    carry.add_argument("--delta", type=float, help="the new delta (default: kept)")
    carry.add_argument("--accountant", choices=ACCOUNTANTS, help="(default: kept)")
    carry.add_argument(
        "--charge", choices=CHARGES,
        help="what the budget is charged with (default: kept); a hospital-unit ledger "
        f"written before the term existed is '{CHARGE_UNIT}' and a site now opens it only "
        f"as '{CHARGE_RECORD_LEVEL}' (the per-patient figure)")
    carry.add_argument("--cert", required=True, help="the site's certificate (PEM)")
    carry.add_argument("--key", required=True, help="the site's private key (PEM)")
    carry.add_argument("--receipts", help="the site's receipts folder (privacy.receipts_dir): "
                       "checked before, rewritten after")
    carry.set_defaults(func=_cmd_ledger_carry)

    migrate = commands.add_parser(
        "migrate",
        help="(site, stopped) sign a format-1 ledger into format 2, once; keeps the "
        "original as LEDGER.format1",
    )
    migrate.add_argument("--ledger", required=True, help="the format-1 ledger file")
    migrate.add_argument("--cert", required=True, help="the site's certificate (PEM)")
    migrate.add_argument("--key", required=True, help="the site's private key (PEM)")
    migrate.add_argument(
        "--anchor", help="the ledger's anchor file (default: LEDGER.anchor beside it)"
    )
    migrate.set_defaults(func=_cmd_ledger_migrate)
