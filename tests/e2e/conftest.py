"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from common.processes import ManagedProcess


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    """Processes a test started; each is stopped when the test ends, pass or fail."""
    started: list[ManagedProcess] = []
    yield started
    for proc in started:
        proc.stop()
