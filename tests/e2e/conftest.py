"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess
from tests.e2e.harness import Federation, run_medfed

TAIL_LINES = 8
TAIL_WIDTH = 240


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """Keeps each phase's report on the test item, so a fixture's teardown can tell
    whether the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


def process_tails(started: list[ManagedProcess]) -> str:
    """The last lines every process printed, shortened: what a failed federation was
    doing (a CI log keeps only the end of the output)."""
    parts = []
    for proc in started:
        state = "running" if proc.alive else f"exited {proc.proc.returncode}"
        parts.append(f"--- {proc.name} ({state})")
        for line in proc.tail(TAIL_LINES).splitlines():
            try:
                record = json.loads(line)
                text = record.get("msg") or line if isinstance(record, dict) else line
            except ValueError:
                text = line
            parts.append("  " + str(text)[:TAIL_WIDTH])
    return "\n".join(parts)


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[list[ManagedProcess]]:
    """Processes a test started; each is stopped when the test ends, pass or fail. When
    the test failed, the end of every process's output is printed first."""
    started: list[ManagedProcess] = []
    yield started
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed and started:
        print("\nprocess output at the failure:\n" + process_tails(started))
    for proc in started:
        proc.stop()


@pytest.fixture
def monitored_federation(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[Sequence[str]], Federation]]:
    """Makes a federation of real processes whose PKI also holds an `ops` monitor
    certificate (for `medfed status`); everything it started is stopped when the test
    ends, after printing the end of each process's output if the test failed."""
    made: list[Federation] = []

    def make(sites: Sequence[str]) -> Federation:
        fed = Federation(tmp_path, sites)
        run_medfed("pki", "issue", "--dir", str(fed.pki), "--monitor", "ops")
        made.append(fed)
        return fed

    yield make
    report = getattr(request.node, "report_call", None)
    started = [proc for fed in made for proc in fed.processes()]
    if report is not None and report.failed and started:
        print("\nprocess output at the failure:\n" + process_tails(started))
    for fed in made:
        fed.stop()
