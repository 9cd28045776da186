"""Shared fixtures for the PKI tests: a real PKI directory on disk, a fixed clock."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from common.protocol import pki


@pytest.fixture
def now() -> dt.datetime:
    # The wall clock: gRPC's TLS layer checks validity against the real time, so the
    # certificates the socket tests use must be valid *now*.
    return dt.datetime.now(dt.UTC)


@pytest.fixture
def pki_dir(tmp_path: Path, now: dt.datetime) -> Path:
    """A P-256 federation: CA, coordinator for loopback, sites h1 and h2."""
    directory = tmp_path / "pki"
    # The CA dates from a month ago so tests can issue back-dated (expired) leaves.
    pki.init_ca(directory, now=now - dt.timedelta(days=30))
    pki.refresh_crl(directory, now=now)
    pki.issue_coordinator(directory, ["127.0.0.1", "localhost"], now=now)
    pki.issue_site(directory, "h1", now=now)
    pki.issue_site(directory, "h2", now=now)
    return directory


@pytest.fixture
def foreign_dir(tmp_path: Path, now: dt.datetime) -> Path:
    """Another CA that issues a site called h1 too: must never be accepted."""
    directory = tmp_path / "foreign"
    pki.init_ca(directory, name="medfed federation CA", now=now)
    pki.issue_coordinator(directory, ["127.0.0.1", "localhost"], now=now)
    pki.issue_site(directory, "h1", now=now)
    return directory
