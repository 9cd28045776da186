"""Fixtures for the state-database tests: a private, throwaway PostgreSQL server.

`postgres_server` starts a real server (Debian package `postgresql`, installed by
`.ci/scripts/install-postgres.sh`) on a free 127.0.0.1 port with its data folder under
/tmp, once per test session; every test then gets its own fresh database from
`postgres_url`, so tests cannot see each other's rows. Without the server binaries or
psycopg the PostgreSQL tests are skipped with the reason; SQLite tests always run.
`MEDFED_TEST_POSTGRES_URL` points the tests at an existing server instead.

The fixtures of the networked tests (PKI, in-process coordinator, honest sites) are
re-exported for the restart and selection tests.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.network.conftest import coordinator, honest_sites, pki_layout

__all__ = ["coordinator", "honest_sites", "pki_layout"]

PG_SUPERUSER = "medfed"
SYSTEM_USER = "postgres"  # the server refuses to run as root; Debian creates this user


def _server_binaries() -> Path | None:
    """Folder holding initdb and pg_ctl: PATH first, then Debian's versioned folders."""
    initdb = shutil.which("initdb")
    if initdb is not None and shutil.which("pg_ctl") is not None:
        return Path(initdb).resolve().parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Server:
    """initdb + pg_ctl start/stop, as the `postgres` user when the tests run as root."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.as_root = os.geteuid() == 0
        self.base = Path(tempfile.mkdtemp(prefix="medfed-pg-"))
        self.data = self.base / "data"
        self.port = 0
        if self.as_root:
            account = pwd.getpwnam(SYSTEM_USER)
            os.chown(self.base, account.pw_uid, account.pw_gid)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", SYSTEM_USER, "--", *command]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=120, check=False
        )

    def start(self) -> None:
        result = self._run(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", PG_SUPERUSER,
            "-E", "UTF8", "--no-sync",
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr.strip()}")
        errors = []
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = _free_port()
            result = self._pg_ctl("start")
            if result.returncode == 0:
                return
            errors.append(result.stderr.strip() or result.stdout.strip())
        raise RuntimeError(f"pg_ctl start failed: {errors}")

    def _pg_ctl(self, action: str, *args: str) -> subprocess.CompletedProcess[str]:
        # Throwaway server: durability settings off (the tests check logic, not disks).
        options = (
            "-c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
            f"-c full_page_writes=off -k {self.base}"
        )
        return self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.base / "server.log"), "-w",
            "-t", "60", "-o", f"-p {self.port} {options}", *args, action,
        )

    def control(self, action: str, *args: str) -> None:
        """`pg_ctl ACTION` on the running server's port (restart, stop, start); raises
        when it fails."""
        result = self._pg_ctl(action, *args)
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl {action} failed: {result.stderr.strip()}")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.base, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql://{PG_SUPERUSER}@127.0.0.1:{self.port}/postgres"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of the maintenance database of a running PostgreSQL server."""
    if importlib.util.find_spec("psycopg") is None:
        pytest.skip("psycopg is not installed (pip install 'psycopg[binary]')")
    existing = os.environ.get("MEDFED_TEST_POSTGRES_URL")
    if existing:
        yield existing
        return
    bindir = _server_binaries()
    if bindir is None:
        pytest.skip(
            "PostgreSQL server binaries (initdb, pg_ctl) not found: "
            "run .ci/scripts/install-postgres.sh"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SYSTEM_USER)
        except KeyError:
            pytest.skip(f"running as root and there is no {SYSTEM_USER!r} user to run the server")
    server = _Server(bindir)
    try:
        server.start()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        server.stop()
        pytest.skip(f"could not start a private PostgreSQL server: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def private_postgres(postgres_server: str) -> Iterator[_Server]:
    """A PostgreSQL server of this test alone, which it may restart or stop
    (`_Server.control`); its URL is `.url`."""
    if os.environ.get("MEDFED_TEST_POSTGRES_URL"):
        pytest.skip("restarting a server needs one the tests start (not MEDFED_TEST_POSTGRES_URL)")
    bindir = _server_binaries()
    assert bindir is not None  # postgres_server skipped otherwise
    server = _Server(bindir)
    try:
        server.start()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        server.stop()
        pytest.skip(f"could not start a private PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the test server; dropped afterwards."""
    import psycopg

    name = f"medfed_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")  # name is ours: hex digits only
    base, _, _ = postgres_server.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on the default SQLite file and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'coordinator.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url
