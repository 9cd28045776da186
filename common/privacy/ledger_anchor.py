"""The anchor file beside a ledger (``<ledger>.anchor``: site, latest seq, head hash):
it makes a deleted, truncated, older or forked copy of the ledger refuse to open.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import (
    LedgerForkError,
    LedgerUnavailable,
    ValidationError,
)
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.privacy.ledger_store import ANCHOR_FORMAT, _guard, recovery_hint
from common.privacy.mechanisms import (
    canonical_json,
)
from common.privacy.signed import (
    SignedEntry,
)

# --------------------------------------------------------------------------- anchor


@dataclass(frozen=True)
class LedgerAnchor:
    """The latest head the site recorded OUTSIDE its ledger file."""

    site_id: str
    seq: int
    head_hash: str

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format": ANCHOR_FORMAT,
                "site_id": self.site_id,
                "seq": self.seq,
                "head_hash": self.head_hash,
            }
        )


def anchor_path_for(ledger_path: str | Path) -> Path:
    """``<ledger>.anchor``, in the site's state folder beside the ledger."""
    path = Path(ledger_path)
    return path.with_name(path.name + ".anchor")


def read_anchor(path: str | Path) -> LedgerAnchor | None:
    """The anchor at `path`, None if there is none; LedgerUnavailable if unreadable."""
    anchor_path = Path(path)
    try:
        data = anchor_path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerUnavailable(
            anchor_path, f"ledger anchor {anchor_path} is unreadable ({exc.strerror})"
        ) from None
    try:
        raw = parse_json(data)
        if not isinstance(raw, dict) or raw.get("format") != ANCHOR_FORMAT:
            raise ValueError("not a ledger anchor")
        seq, head, site = raw["seq"], raw["head_hash"], raw["site_id"]
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError("bad seq")
        if not (isinstance(head, str) and isinstance(site, str)):
            raise ValueError("bad head_hash or site_id")
    except (ValidationError, ValueError, KeyError) as exc:
        raise LedgerUnavailable(
            anchor_path,
            f"ledger anchor {anchor_path} is damaged ({exc}); it is the site's only record "
            "of its ledger head outside the ledger: compare the ledger with the "
            "coordinator's replica (`medfed ledger export`) before removing it",
        ) from None
    return LedgerAnchor(site_id=site, seq=seq, head_hash=head)


def write_anchor(path: str | Path, anchor: LedgerAnchor) -> None:
    """Atomic, durable replace (temp file, fsync, rename, fsync of the folder)."""
    anchor_path = Path(path)
    with _guard(anchor_path, "writing the ledger anchor"):
        atomic_write(anchor_path, anchor.to_bytes(), mode=0o600)


def _check_anchor(
    path: Path, anchor: LedgerAnchor, site_id: str, entries: Sequence[SignedEntry]
) -> None:
    if anchor.site_id != site_id:
        raise LedgerForkError(
            f"ledger anchor of {path} belongs to site {anchor.site_id!r}, not {site_id!r}"
        )
    if len(entries) < anchor.seq:
        raise LedgerForkError(
            f"privacy ledger {path} holds {len(entries)} entries but its anchor records "
            f"{anchor.seq} (head {anchor.head_hash[:16]}...): this is an older, truncated or "
            "reset copy and the site will not spend a budget it already spent; "
            + recovery_hint(path)
        )
    if anchor.seq > 0 and entries[anchor.seq - 1].entry_hash != anchor.head_hash:
        raise LedgerForkError(
            f"privacy ledger {path} entry seq={anchor.seq} differs from the head its anchor "
            "records: the history was rewritten (a fork); " + recovery_hint(path)
        )


