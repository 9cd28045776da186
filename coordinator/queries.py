"""The operator's query inbox and the answers, under the coordinator's state folder.

The operator owns the coordinator's machine: `medfed query run` puts an approved query
in STATE/queries/inbox/<sha256>.query (its canonical bytes, `query_bytes`), and the
round engine runs it as a release round of its own before the study's next round
(`coordinator.round_kinds.query`); the decoded answer is written to
STATE/queries/answers/<sha256>.json (and kept per round as
<sha256>-round-<n>.json), or why it could not run to
STATE/queries/failed/<sha256>.json. Every inbox file is validated here: its name, its
size, that it parses as a query of the study being run, that its bytes are canonical
and hash to its name; anything else is moved to failed/ with the reason, never run.
A study with no round left can run no query: when it finishes, the engine writes why
to STATE/queries/closed and fails what waits in the inbox; `medfed query run` reads the
same file before it submits and while it waits, so no query waits for a round that
will never come. A coordinator that runs the study's rounds again removes it.
The coordinator learns only the noisy sum (and keeps it, with each statistic's noise
std, so the answer can be recomputed: post-processing costs no privacy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from common.core.errors import ConfigError, StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.releases.plugins.query import QueryRelease
from common.releases.seam import DpRelease, check_plans

log = logging.getLogger("medfed.coordinator")

QUERIES_DIR: Final = "queries"
INBOX: Final = "inbox"
ANSWERS: Final = "answers"
FAILED: Final = "failed"
CLOSED: Final = "closed"
SUFFIX: Final = ".query"
ANSWER_FORMAT: Final = "medfed-query-answer/1"
MAX_QUERY_BYTES: Final = 1 << 20
_NAME = re.compile(r"([0-9a-f]{64})\.query")


def folder(state: Path, which: str) -> Path:
    return Path(state) / QUERIES_DIR / which


def inbox_path(state: Path, sha256: str) -> Path:
    return folder(state, INBOX) / f"{sha256}{SUFFIX}"


def answer_path(state: Path, sha256: str) -> Path:
    return folder(state, ANSWERS) / f"{sha256}.json"


def failed_path(state: Path, sha256: str) -> Path:
    return folder(state, FAILED) / f"{sha256}.json"


def closed_path(state: Path) -> Path:
    return Path(state) / QUERIES_DIR / CLOSED


def closed_reason(state: Path) -> str | None:
    """Why this coordinator's study can run no query now, or None while it can."""
    try:
        return closed_path(state).read_text(encoding="utf-8").strip() or "closed"
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {closed_path(state)}: {exc.strerror}") from None


def close(state: Path, reason: str) -> list[str]:
    """No query can run any more (`reason`): say so, and fail each query in the inbox;
    the SHA-256s failed."""
    path = closed_path(state)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, reason.encode() + b"\n")
    failed = []
    box = folder(state, INBOX)
    for item in sorted(box.glob(f"*{SUFFIX}")) if box.is_dir() else []:
        match = _NAME.fullmatch(item.name)
        if match is not None:
            fail(state, match.group(1), reason)
            failed.append(match.group(1))
    return failed


def reopen(state: Path) -> None:
    """The study's rounds run (again): queries may wait for the next one."""
    closed_path(state).unlink(missing_ok=True)


@dataclass(frozen=True)
class PendingQuery:
    """A query from the inbox, validated: its release and its exact bytes."""

    sha256: str
    name: str
    payload: bytes
    release: DpRelease
    path: Path


def submit(state: Path, payload: bytes) -> str:
    """Put a query's canonical bytes in the inbox (the operator's side); its SHA-256.
    A previous answer or failure of the same query is moved aside first, so that what
    appears next is this run's."""
    sha256 = hashlib.sha256(payload).hexdigest()
    for old in (answer_path(state, sha256), failed_path(state, sha256)):
        old.unlink(missing_ok=True)
    path = inbox_path(state, sha256)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, payload)
    return sha256


def fail(state: Path, sha256: str, reason: str, *, round_number: int | None = None) -> Path:
    """Record why the query `sha256` did not run, and take it out of the inbox."""
    path = failed_path(state, sha256)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, json.dumps({"format": ANSWER_FORMAT, "query_sha256": sha256,
                                   "round": round_number, "error": reason},
                                  indent=2, sort_keys=True).encode() + b"\n")
    inbox_path(state, sha256).unlink(missing_ok=True)
    log.warning("query %s... did not run: %s", sha256[:12], reason,
                extra={"event": "query_failed", "query_sha256": sha256,
                       "round_number": round_number, "reason": reason})
    return path


def pending(state: Path, study: Any) -> PendingQuery | None:
    """The oldest valid query in the inbox (invalid ones are moved to failed/ with the
    reason), or None."""
    box = folder(state, INBOX)
    try:
        entries = sorted(box.iterdir(), key=lambda p: (p.stat().st_mtime, p.name))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read the query inbox {box}: {exc.strerror}") from None
    for path in entries:
        if path.name.startswith("."):
            continue  # an atomic write in progress
        match = _NAME.fullmatch(path.name)
        if match is None or not path.is_file() or path.is_symlink():
            log.warning("query inbox: ignoring %s (not <sha256>%s)", path, SUFFIX)
            continue
        sha256 = match.group(1)
        try:
            if path.stat().st_size > MAX_QUERY_BYTES:
                raise ValidationError(f"{path} is larger than {MAX_QUERY_BYTES} bytes")
            payload = path.read_bytes()
            if hashlib.sha256(payload).hexdigest() != sha256:
                raise ValidationError(f"{path}: its bytes do not hash to its name")
            release = QueryRelease.from_payload(study, payload)
        except (ValidationError, ConfigError) as exc:
            fail(state, sha256, f"refused from the inbox: {exc}")
            continue
        except OSError as exc:
            fail(state, sha256, f"cannot read {path}: {exc.strerror}")
            continue
        return PendingQuery(sha256=sha256, name=release.query_def.name, payload=payload,
                            release=release, path=path)
    return None


def keep_answer(state: Path, release: Any, total: np.ndarray, *, noise_sigmas: list[float],
                contributors: int, round_number: int, answer: Any) -> Path:
    """Write the decoded answer with what it was decoded from (the noisy sum, each
    statistic's noise std, the contributors); take the query out of the inbox."""
    sha256 = release.sha256
    record = {
        "format": ANSWER_FORMAT, "query_sha256": sha256, "query": release.query_def.name,
        "round": round_number, "contributors": contributors,
        "epsilon": float(release.query_def.epsilon),
        # What each answering site's ledger charged for it (the statistics composed).
        "epsilon_composed": float(answer.epsilon_composed),
        "noise_sigmas": [float(s) for s in noise_sigmas],
        "total": [int(v) for v in np.asarray(total).reshape(-1)],
        "answer": release.to_json(answer),
    }
    data = json.dumps(record, indent=2, sort_keys=True).encode() + b"\n"
    path = answer_path(state, sha256)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path.with_name(f"{sha256}-round-{round_number:06d}.json"), data)
    atomic_write(path, data)
    inbox_path(state, sha256).unlink(missing_ok=True)
    return path


def read_answer(path: Path, *, release: DpRelease) -> dict[str, Any]:
    """An answer file, validated against the query it answers (its vector length and
    noise blocks); ValidationError names the file and field."""
    try:
        raw = parse_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise ValidationError(f"{path}: not a readable answer ({exc})") from None
    fields = {"format", "query_sha256", "query", "round", "contributors", "epsilon",
              "noise_sigmas", "total", "answer"}
    # "epsilon_composed": absent from an answer kept before the figure was recorded.
    if (not isinstance(raw, dict) or not fields <= set(raw) <= fields | {"epsilon_composed"}
            or raw["format"] != ANSWER_FORMAT):
        raise ValidationError(f"{path}: not a {ANSWER_FORMAT} file")
    total, sigmas, k = raw["total"], raw["noise_sigmas"], raw["contributors"]
    if (not isinstance(total, list) or len(total) != release.length
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in total)):
        raise ValidationError(f"{path}: total: {release.length} integers expected")
    plans = check_plans(release, release.plans(n_noise=1))
    if (not isinstance(sigmas, list) or len(sigmas) != len(plans)
            or not all(isinstance(s, int | float) and s >= 0 for s in sigmas)):
        raise ValidationError(f"{path}: noise_sigmas: {len(plans)} numbers >= 0 expected")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValidationError(f"{path}: contributors: a positive integer expected")
    return raw


def answered_before(state: Path, round_number: int) -> list[dict[str, Any]]:
    """Every query answered in a round before `round_number` (one entry per run, from
    STATE/queries/answers/<sha256>-round-<n>.json), for the privacy card of the model
    after that round. A file that does not read as an answer record is skipped with a
    warning (the card is written from what the coordinator can vouch for)."""
    runs: list[dict[str, Any]] = []
    directory = folder(state, ANSWERS)
    if not directory.is_dir():
        return runs
    for path in sorted(directory.glob("*-round-*.json")):
        try:
            raw = parse_json(path.read_bytes())
            run = {"name": raw["query"], "sha256": raw["query_sha256"],
                   "round": raw["round"], "epsilon": raw["epsilon"],
                   "epsilon_composed": raw.get("epsilon_composed"),
                   "contributors": raw["contributors"]}
        except (OSError, ValidationError, KeyError, TypeError) as exc:
            log.warning("query answer %s not named on the privacy card: %s", path, exc)
            continue
        if isinstance(run["round"], int) and run["round"] < round_number:
            runs.append(run)
    return sorted(runs, key=lambda r: (r["round"], r["sha256"]))
