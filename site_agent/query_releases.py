"""How many times a site that keeps no privacy ledger answered each approved query.

A query's approval allows it `times` runs (`site_agent.approvals`). With a ledger, its
"query" entries are the count (write-ahead, before the answer leaves). A site without
one (a non-private trainer, `--trainer nonprivate`) has no entries to count, and would
answer an approved query for ever: every run a freshly noised answer of the same cells,
whose noise the coordinator could average away. So such a site keeps the count here,
beside its approvals (STATE/approved/released/<sha256>.json: the round of every
release), and records each release durably (written, fsynced, renamed) BEFORE the
answer leaves: a crash after the record costs one run of the allowance, never a free
one. The file is read strictly: a damaged or missing-field record is an error naming
it, never "not run yet".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Final

from common.core.errors import StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from site_agent.approvals import Approvals

RELEASED_DIR: Final = "released"
RELEASES_FORMAT: Final = "medfed-query-releases/1"
MAX_RECORD_BYTES: Final = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


class QueryReleases:
    """The release counts of approved queries at a site without a ledger."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def beside(cls, approvals: Approvals) -> QueryReleases:
        """The counts kept with the site's approvals (STATE/approved/released/)."""
        return cls(approvals.folder / RELEASED_DIR)

    def path(self, sha256: str) -> Path:
        if _HEX64.fullmatch(sha256) is None:
            raise ValidationError("a query SHA-256 is 64 lower-case hex digits")
        return self.folder / f"{sha256}.json"

    def rounds(self, sha256: str) -> list[int]:
        """The rounds in which the query `sha256` was answered ([] when never)."""
        path = self.path(sha256)
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise StateError(f"{path} is larger than {MAX_RECORD_BYTES} bytes")
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StateError(f"cannot read {path}: {exc.strerror}") from None
        try:
            raw: Any = parse_json(data)
        except ValidationError as exc:
            raise self._damaged(path, str(exc)) from None
        if (not isinstance(raw, dict) or set(raw) != {"format", "sha256", "rounds"}
                or raw["format"] != RELEASES_FORMAT or raw["sha256"] != sha256
                or not isinstance(raw["rounds"], list)
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                           for r in raw["rounds"])):
            raise self._damaged(path, f"not a {RELEASES_FORMAT} record of this query")
        return list(raw["rounds"])

    def count(self, sha256: str) -> int:
        return len(self.rounds(sha256))

    def record(self, sha256: str, round_number: int) -> None:
        """One more release of `sha256` (in round `round_number`), on disk before the
        caller lets the answer leave."""
        rounds = [*self.rounds(sha256), round_number]
        path = self.path(sha256)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write(path, _record_bytes(sha256, rounds), mode=0o600)
        except OSError as exc:
            raise StateError(f"cannot record the query release in {path} "
                             f"({exc.strerror or exc}): nothing was released") from None

    @staticmethod
    def _damaged(path: Path, why: str) -> StateError:
        return StateError(
            f"{path} is damaged ({why}): it counts the runs of an approved query at this "
            "site, which keeps no privacy ledger; restore it from a backup of the state "
            "folder (deleting it would let the query run again)")


def _record_bytes(sha256: str, rounds: list[int]) -> bytes:
    return json.dumps({"format": RELEASES_FORMAT, "sha256": sha256, "rounds": rounds},
                      indent=2, sort_keys=True).encode() + b"\n"
