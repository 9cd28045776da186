"""`medfed query run`: the operator submits an approved query to the running
coordinator and waits for its answer.

The query is checked against the study the coordinator's state runs (STATE/study.json),
put in the coordinator's inbox as its canonical bytes (`coordinator.queries`), and run
by the coordinator as a release round of its own before the study's next round. The
answer (each statistic with its noise std and confidence interval) is printed and
written to --out as answer.json, answer.csv and a PNG per histogram and survival curve.
The answer is recomputed here from the noisy sum the coordinator kept: post-processing
of a DP release, which costs no privacy.

Run it on the coordinator's machine (its state folder is local); without a running
coordinator the query waits in the inbox until one runs the study.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from common.commands.cli import main_with
from common.core.errors import ConfigError, MedfedError, StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.releases.analytics.answer import answer_query
from common.releases.analytics.query import load_query, query_bytes
from common.releases.plugins.query import QueryRelease
from common.study import Study, study_from_bytes
from coordinator import queries

POLL_SECONDS = 0.2


class QueryFailed(MedfedError):
    """The coordinator could not run the query (why is in the message)."""


def register_run(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="run an approved query on the running coordinator (operator) and wait for "
        "the answer",
        description="Puts the query in the coordinator's inbox (under its state folder); "
        "the coordinator runs it as a round of its own before the study's next round. "
        "Every site answers only a query it approved, and pays for it on its ledger.",
    )
    run.add_argument("--query", required=True, type=Path, help="query.toml")
    run.add_argument("--coordinator-state", required=True, type=Path,
                     help="the coordinator's state folder (its --state)")
    run.add_argument("--out", type=Path, help="folder for answer.json, answer.csv and plots")
    run.add_argument("--timeout", type=float, default=600.0,
                     help="seconds to wait for the answer (default 600)")
    run.set_defaults(func=_run)


def coordinator_study(state: Path) -> Study:
    """The study the coordinator's state folder runs (STATE/study.json)."""
    path = state / "study.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("--coordinator-state", f"{path} does not exist: give the state "
                          "folder of a coordinator that runs a study") from None
    except OSError as exc:
        raise ConfigError("--coordinator-state", f"cannot read {path}: {exc.strerror}") from None
    try:
        return study_from_bytes(data)
    except ValidationError as exc:
        raise StateError(f"{path}: {exc}") from None


def wait_for(state: Path, sha256: str, *, timeout: float) -> Path:
    """The answer file of the query `sha256` once the coordinator wrote it;
    QueryFailed with the coordinator's reason, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    answer, failed = queries.answer_path(state, sha256), queries.failed_path(state, sha256)
    while True:
        if answer.exists():
            return answer
        closed = queries.closed_reason(state)
        if closed is not None and queries.inbox_path(state, sha256).exists():
            queries.fail(state, sha256, closed)
        if failed.exists():
            try:
                reason = parse_json(failed.read_bytes()).get("error", "")
            except (OSError, ValidationError, AttributeError):
                reason = f"see {failed}"
            raise QueryFailed(f"the coordinator did not run the query: {reason}")
        if time.monotonic() >= deadline:
            raise QueryFailed(
                f"no answer after {timeout:g} s: the query waits in "
                f"{queries.inbox_path(state, sha256)} for the coordinator to run it before "
                f"its next round; its answer will be {answer}")
        time.sleep(POLL_SECONDS)


def _run(args: argparse.Namespace) -> int:
    if not 0 < args.timeout <= 86_400:
        raise ConfigError("--timeout", "must be in (0, 86400] seconds")
    state: Path = args.coordinator_state
    study = coordinator_study(state)
    try:
        query = load_query(args.query, study=study)
    except ValidationError as exc:
        raise ConfigError("--query", str(exc)) from None
    payload = query_bytes(query)
    closed = queries.closed_reason(state)
    if closed is not None:
        raise QueryFailed(f"the coordinator cannot run the query: {closed}")
    sha256 = queries.submit(state, payload)
    print(f"query {query.name} (sha256 {sha256}) submitted; waiting for the coordinator",
          file=sys.stderr, flush=True)
    path = wait_for(state, sha256, timeout=args.timeout)
    release = QueryRelease(study, query)
    record = queries.read_answer(path, release=release)
    answer = answer_query(query, np.asarray(record["total"], dtype=np.int64), study=study,
                          noise_sigmas=[float(s) for s in record["noise_sigmas"]],
                          contributors=int(record["contributors"]))
    print(answer.render())
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "answer.json", json.dumps(
            {"query": query.name, "query_sha256": sha256, "round": record["round"],
             "contributors": record["contributors"], "answer": answer.to_json()},
            indent=2, sort_keys=True).encode() + b"\n")
        answer.write_csv(out / "answer.csv")
        answer.write_plots(out)
        print(f"written to {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinator.query_cli run ...`` (`medfed query run` without the
    plug-in registry)."""
    def register(sub: Any) -> None:
        parser = sub.add_parser("query")
        register_run(parser.add_subparsers(dest="query_command", required=True))

    return main_with([register], ["query", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
