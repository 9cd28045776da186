"""CI runs on a fresh machine: every system tool a test drives must be installed by
.ci/scripts/install-*.sh (a machine that had one by hand once hid `podman kube play`'s
need for catatonit). Each `shutil.which("TOOL")` in the tests is either a console script
of the project's own environment (requirements/dev.lock) or a Debian package the CI
scripts install; podman's helpers that the container tests need are named too."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.harness import REPO

SCRIPTS = sorted((REPO / ".ci" / "scripts").glob("install-*.sh"))

DEBIAN_PACKAGE = {
    "podman": "podman",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "docker-compose": "docker-compose",
    "initdb": "postgresql",
    "pg_ctl": "postgresql",
    "ip": "iproute2",
    "make": None,  # build-essential's, on every machine that runs `make test`
}
"""Where each tool the tests look up comes from (None: the machine's own)."""

FROM_THE_LOCK = {"podman-compose": "podman-compose", "kubernetes-validate": "kubernetes-validate"}
"""Tools the tests look up that requirements/dev.lock installs into .venv."""

CONTAINER_HELPERS = {
    # `podman kube play` starts each pod's infra container with catatonit.
    "kube": "catatonit",
    # deploy/docker/standin-base.sh builds the stand-in base image with it.
    "standin-base.sh": "mmdebstrap",
    # `make images` builds with podman's build backend.
    "images": "buildah",
}


def installed_packages() -> set[str]:
    """Debian packages the CI scripts install when missing."""
    names: set[str] = set()
    for script in SCRIPTS:
        text = script.read_text()
        names.update(re.findall(r"missing\+=\((\S+?)\)", text))
        for line in re.findall(r"apt-get install[^\n]*", text):
            names.update(w for w in line.split() if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w)
                         and w not in {"apt-get", "install"})
    return names


def tools_the_tests_look_up() -> set[str]:
    found: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        if path == Path(__file__):
            continue
        found.update(re.findall(r"shutil\.which\(\s*\"([\w.-]+)\"", path.read_text()))
    return found


def test_every_tool_a_test_looks_up_is_installed_by_ci() -> None:
    packages = installed_packages()
    lock = (REPO / "requirements" / "dev.lock").read_text()
    for tool in sorted(tools_the_tests_look_up()):
        if tool in FROM_THE_LOCK:
            assert re.search(rf"^{re.escape(FROM_THE_LOCK[tool])}==", lock, re.M), tool
            continue
        assert tool in DEBIAN_PACKAGE, (
            f"tests look up {tool!r}: say where it comes from (DEBIAN_PACKAGE here, and an "
            ".ci/scripts/install-*.sh that installs it)")
        package = DEBIAN_PACKAGE[tool]
        if package is not None:
            assert package in packages, f"{tool}: no .ci script installs {package}"


def test_the_container_tests_helpers_are_installed() -> None:
    containers = (REPO / "tests" / "deploy" / "test_containers.py").read_text()
    assert '"kube", "play"' in containers
    packages = installed_packages()
    for needed in CONTAINER_HELPERS.values():
        assert needed in packages, f"the container tests need {needed}"
    engine = (REPO / ".ci" / "scripts" / "install-container-engine.sh").read_text()
    # Checked by the binary podman looks for, not only by package: installed even where
    # podman came without its recommends.
    assert "command -v catatonit" in engine


def test_ci_runs_every_install_script_then_make_test() -> None:
    run = (REPO / ".ci" / "run").read_text()
    assert "for script in .ci/scripts/install-*.sh" in run
    assert run.rstrip().endswith("make test")
    assert SCRIPTS
