"""Suite-wide collection rules for running on several pytest-xdist workers.

`make test` runs `pytest -n 3 --dist loadgroup` (pyproject.toml): a test goes to whichever
worker is free, except that the tests of one file that share a module- or class-scoped
fixture (a federation, a trained model) form one xdist group and run on the same worker,
so the fixture is built once, not once per worker (xdist schedules by the group suffix it
puts on node ids, which pytest 9 does not take: dev.in pins pytest 8, and
tests/unit/test_xdist_groups.py fails the day groups are ignored again). Files with
real-process tests (`e2e` or `slow` marks) are handed out first: the long tests start
early and the many short ones fill in around them, instead of one long test starting
last on an otherwise idle machine.
xdist hands the work out in this order because pyproject.toml passes
`--no-loadscope-reorder` (by default it re-sorts groups by their number of tests, which
put fifteen groups of short tests ahead of every single real-process test).

Hundreds of tests start `medfed` processes. With PYTHONDONTWRITEBYTECODE set (as on the
CI machines), each of them compiled this checkout's modules from source again (about
0.6 s of CPU per process on two busy cores); the suite lets them write and reuse
`__pycache__` (git- and docker-ignored) instead.

torch and NumPy's BLAS run one thread per test process (OMP_NUM_THREADS and
MKL_NUM_THREADS default to 1, for the workers and every process they start, as the
e2e harness already asked of its site processes): with three workers on two cores, a
second intra-op thread per process buys no time and its OpenMP spin-waiting burns CPU
(tests/privacy/test_privacy_audit_run.py: 54 s of CPU with two threads, 15 s with one).
A caller's own setting wins.

The `python -m` processes the tests start (coordinators, sites) are forked from one
interpreter per worker that has imported torch and Opacus already (tests/zygote.py says
what that does and does not exercise); MEDFED_TEST_FRESH_INTERPRETERS=1 turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from common.core.processes import launched_by
from tests import zygote

SHARED_SCOPES = frozenset({"module", "class", "package"})
LONG_MARKS = ("e2e", "slow")


def pytest_configure(config: pytest.Config) -> None:
    # Before pytest-xdist starts its workers, which inherit this environment, as do the
    # processes they start.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    for threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(threads, "1")


def _shares_a_fixture(item: pytest.Item) -> bool:
    # pytest keeps the fixtures a test resolves to in `_fixtureinfo` (read-only here).
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope in SHARED_SCOPES
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long_files: set[str] = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if any(item.get_closest_marker(mark) for mark in LONG_MARKS):
            long_files.add(path)
        if _shares_a_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(path))
    # Stable: a file's tests stay together and in their order.
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in long_files)


@pytest.fixture(scope="session")
def zygote_server() -> Iterator[zygote.Zygote]:
    """This worker's zygote (it starts on its first launch)."""
    forks = zygote.Zygote()
    yield forks
    forks.close()


@pytest.fixture(scope="session", autouse=True)
def forked_processes(zygote_server: zygote.Zygote) -> Iterator[None]:
    """ManagedProcess starts `python -m` processes from this worker's zygote."""
    if not zygote.enabled():
        yield
        return
    with launched_by(zygote_server.launch):
        yield
