"""What a hospital approved, pinned under its state folder: its study and its queries.

`medfed site approve FILE` shows what FILE is (a study: model, privacy terms, rounds; a
query: its statistics, cohort filter, epsilon per statistic and the study it belongs
to), asks for confirmation and pins its SHA-256:

* a study: STATE/approved/study.json (its canonical bytes): the site then joins that
  study and no other, as `site run --study FILE` does;
* a query: STATE/approved/queries/<sha256>.json: the site releases that exact query
  (its canonical bytes hash to it) for its own study, at most `times` times (default
  once); each release is one "query" entry on its ledger, which counts them.

Every pin is read back strictly (StateError naming the file); a pin is never trusted
for what it says about the query beyond its hash, name and allowance.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from common.core.errors import StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.privacy.ledger import PrivacyLedger
from common.privacy.purpose import Purpose
from common.study import Study, study_bytes, study_from_bytes, study_sha256

APPROVALS_DIR: Final = "approved"
STUDY_PIN: Final = "study.json"
QUERIES_DIR: Final = "queries"
APPROVAL_FORMAT: Final = "medfed-query-approval/1"
MAX_TIMES: Final = 1000
MAX_PIN_BYTES: Final = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class QueryApproval:
    """One approved query: its name, SHA-256, study and how many times it may run."""

    name: str
    sha256: str
    study_sha256: str
    times: int
    approved_at: str

    def to_json(self) -> bytes:
        return json.dumps({
            "format": APPROVAL_FORMAT, "name": self.name, "sha256": self.sha256,
            "study_sha256": self.study_sha256, "times": self.times,
            "approved_at": self.approved_at,
        }, indent=2, sort_keys=True).encode() + b"\n"


def times_released(ledger: PrivacyLedger | None, sha256: str) -> int:
    """How many "query" entries on the ledger answered the query `sha256`."""
    if ledger is None:
        return 0
    return sum(1 for entry in ledger.entries()
               if entry.purpose == Purpose.QUERY and entry.query is not None
               and entry.query.sha256 == sha256)


class Approvals:
    """The pins under STATE/approved/ (see the module docstring)."""

    def __init__(self, state: Path) -> None:
        self.folder = Path(state) / APPROVALS_DIR

    # ------------------------------------------------------------------ study
    @property
    def study_path(self) -> Path:
        return self.folder / STUDY_PIN

    def approve_study(self, study: Study) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(self.study_path, study_bytes(study))
        return self.study_path

    def study(self) -> Study | None:
        """The approved study, or None when none is pinned."""
        data = _read(self.study_path)
        if data is None:
            return None
        try:
            return study_from_bytes(data)
        except (ValidationError, ValueError) as exc:
            raise StateError(f"{self.study_path} is not a study ({exc}); approve the study "
                             "again with `medfed site approve STUDY.toml`") from None

    # ---------------------------------------------------------------- queries
    def query_path(self, sha256: str) -> Path:
        if _HEX64.fullmatch(sha256) is None:
            raise ValidationError("a query SHA-256 is 64 lower-case hex digits")
        return self.folder / QUERIES_DIR / f"{sha256}.json"

    def approve_query(self, *, name: str, sha256: str, study: Study, times: int,
                      now: dt.datetime) -> Path:
        if not 1 <= times <= MAX_TIMES:
            raise ValidationError(f"--times must be in 1..{MAX_TIMES}, got {times}")
        approval = QueryApproval(
            name=name, sha256=sha256, study_sha256=study_sha256(study), times=times,
            approved_at=now.astimezone(dt.UTC).isoformat(timespec="seconds"))
        path = self.query_path(sha256)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(path, approval.to_json())
        return path

    def query(self, sha256: str) -> QueryApproval | None:
        """The approval of the query `sha256`, or None when it was never approved."""
        path = self.query_path(sha256)
        data = _read(path)
        if data is None:
            return None
        try:
            raw: Any = parse_json(data)
        except ValidationError:
            raise StateError(f"{path} is not JSON: approve the query again") from None
        fields = {"format", "name", "sha256", "study_sha256", "times", "approved_at"}
        if not isinstance(raw, dict) or set(raw) != fields or raw["format"] != APPROVAL_FORMAT:
            raise StateError(f"{path} is not a query approval ({APPROVAL_FORMAT}, fields "
                             f"{sorted(fields)}): approve the query again")
        times = raw["times"]
        if (raw["sha256"] != sha256 or not isinstance(raw["study_sha256"], str)
                or _HEX64.fullmatch(raw["study_sha256"]) is None
                or not isinstance(raw["name"], str) or not isinstance(raw["approved_at"], str)
                or isinstance(times, bool) or not isinstance(times, int)
                or not 1 <= times <= MAX_TIMES):
            raise StateError(f"{path}: a field is malformed or names another query; approve "
                             "the query again")
        return QueryApproval(name=raw["name"], sha256=sha256,
                             study_sha256=raw["study_sha256"], times=times,
                             approved_at=raw["approved_at"])


def _read(path: Path) -> bytes | None:
    try:
        if path.stat().st_size > MAX_PIN_BYTES:
            raise StateError(f"{path} is larger than {MAX_PIN_BYTES} bytes")
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from None
