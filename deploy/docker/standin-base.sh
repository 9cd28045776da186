#!/bin/sh
# Builds a STAND-IN for the python:3.11-slim base image where no container registry can
# be reached (air-gapped hosts, CI sandboxes): Debian bookworm's own Python 3.11
# (mmdebstrap --variant=minbase, from the Debian archive) imported under the same tags.
# The images built on it behave the same (Python 3.11 at `python`, a venv in
# /opt/medfed). Like Debian's slim images it installs no manual pages, translations or
# documentation besides the copyright files (dpkg path-exclude); Debian's python3 and
# its libraries still make it larger than the official base.
#   deploy/docker/standin-base.sh [TAG]      (default: python:3.11-slim; needs root)
set -eu
TAG="${1:-python:3.11-slim}"
ENGINE="${ENGINE:-podman}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "standin-base: building a stand-in for $TAG with mmdebstrap (Debian bookworm python3)" >&2
mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$work/rootfs.tar"
"$ENGINE" import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    "$work/rootfs.tar" "docker.io/library/$TAG" >/dev/null
echo "standin-base: $TAG is a local stand-in (not the official image)" >&2
