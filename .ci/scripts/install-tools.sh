#!/usr/bin/env bash
# Install the system tools the deploy tests use, only when missing (idempotent, quiet):
#   promtool        (Debian package prometheus)      tests/deploy/test_monitoring.py
#   docker-compose  (Debian package docker-compose)  tests/deploy/test_deploy_files.py
#   ip              (Debian package iproute2)        tests/network/test_netns.py
# Needs root (or passwordless sudo) and apt; elsewhere it says what is missing and
# exits 0, and the tests that need a tool skip with that reason.
set -euo pipefail

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ "${#missing[@]}" -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-tools: no apt-get; install ${missing[*]} by hand" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-tools: not root; install ${missing[*]} by hand" >&2
        exit 0
    fi
fi
echo "install-tools: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
# --no-install-recommends: docker-compose would otherwise pull the Docker engine.
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
