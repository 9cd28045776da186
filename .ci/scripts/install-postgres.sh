#!/usr/bin/env bash
# Installs the PostgreSQL server binaries (Debian package `postgresql`) that the
# state-database tests (tests/db) start a private, throwaway server from.
# Idempotent and quiet: does nothing when initdb and pg_ctl are already there.
# The tests never use the package's default cluster; they run their own as the
# `postgres` user on a free 127.0.0.1 port with a data folder under /tmp.
set -euo pipefail

have_server() {
    if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
        return 0
    fi
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

if have_server; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-postgres: no apt-get here; install the PostgreSQL server yourself" \
        "(tests/db will skip its PostgreSQL tests)" >&2
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install-postgres: not root and no sudo; PostgreSQL tests will be skipped" >&2
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends postgresql >/dev/null

if ! have_server; then
    echo "install-postgres: postgresql installed but initdb/pg_ctl not found" >&2
    exit 1
fi
