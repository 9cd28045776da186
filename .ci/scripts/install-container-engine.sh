#!/usr/bin/env bash
# Installs the container engine that tests/deploy/test_containers.py builds and runs the
# images with: Debian's podman (+ buildah, and mmdebstrap for a stand-in base image where
# python:3.11-slim cannot be pulled). Idempotent and quiet; .ci/run runs it (an
# install-*.sh), so `make test` builds the images and runs a study in containers.
# Sandboxes without CAP_SYS_RESOURCE cannot raise a container's rlimits past the
# defaults podman asks for, so a containers.conf sets limits inside the hard limits
# here (written only when no containers.conf exists). Without apt or root it says what
# is missing and exits 0; the container test then skips with that reason.
# `podman kube play` starts each pod's infra container with catatonit ("finding pause
# binary: exec: catatonit"): podman only recommends it, so it is installed explicitly.
# On cgroup v1 / hybrid hosts Debian's crun refuses to start containers ("cgroups in
# hybrid mode not supported"): there runc is installed and made the runtime.
set -euo pipefail

missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
command -v catatonit >/dev/null 2>&1 || [ -x /usr/libexec/podman/catatonit ] \
    || missing+=(catatonit)
unified=1
[ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] || unified=0
if [ "$unified" = 0 ]; then
    command -v runc >/dev/null 2>&1 || [ -x /usr/sbin/runc ] || missing+=(runc)
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    elif [ "${#missing[@]}" -gt 0 ]; then
        echo "container-engine: not root; install ${missing[*]} by hand" >&2
        exit 0
    fi
fi

if [ "${#missing[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "container-engine: no apt-get; install ${missing[*]} by hand" >&2
        exit 0
    fi
    echo "container-engine: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

conf=/etc/containers/containers.conf
if [ ! -e "$conf" ]; then
    # nofile/nproc within this machine's hard limits (podman's defaults exceed them
    # where the sandbox cannot raise rlimits).
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [ "$nofile" = unlimited ] && nofile=1048576
    [ "$nproc" = unlimited ] && nproc=32768
    [ "$nofile" -gt 20000 ] && nofile=20000
    [ "$nproc" -gt 32768 ] && nproc=32768
    $SUDO mkdir -p /etc/containers
    {
        printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
            "$nofile" "$nofile" "$nproc" "$nproc"
        if [ "$unified" = 0 ]; then
            printf '[engine]\nruntime = "runc"\n'
        fi
    } | $SUDO tee "$conf" >/dev/null
fi
