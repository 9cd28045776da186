"""What each role image carries, checked without building it.

The coordinator image copies `common/` and `coordinator/` only and installs no torch,
Opacus or MONAI; the site images copy `common/` and `site_agent/` only
(deploy/docker/*.Dockerfile). Here each role's
processes run with the other roles' packages made unimportable (a `sitecustomize` that
refuses them, as an image without those folders would): every module of the role
imports, its commands parse, the other role's command says it is not installed, and a
real coordinator with neither site agent code nor torch serves the demo study from the
initial model the site image's `medfed model init` wrote, and says what to do without
it. `make -n images` shows the build commands and tags, and compose and both
Kubernetes sets run those tags.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.core.processes import ManagedProcess, medfed_argv
from tests.e2e.harness import REPO

DOCKER = REPO / "deploy" / "docker"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
SOURCE_PACKAGES = {"common", "coordinator", "site_agent", "bench", "demo"}
ROLES = {
    # image's Dockerfile: (packages it copies, packages it must not carry)
    # No network code either: round 1's model comes from `medfed model init`.
    "coordinator.Dockerfile": ({"common", "coordinator"},
                               ("site_agent", "bench", "demo", "torch", "opacus", "monai")),
    "site_agent.Dockerfile": ({"common", "site_agent"}, ("coordinator", "bench", "demo")),
    "site_agent.cuda.Dockerfile": ({"common", "site_agent"}, ("coordinator", "bench", "demo")),
}

SITECUSTOMIZE = '''\
import importlib.abc
import os
import sys

_ABSENT = set(os.environ["MEDFED_TEST_ABSENT_PACKAGES"].split(","))


class _Absent(importlib.abc.MetaPathFinder):
    """Packages this role's image does not copy: importing them fails as it would there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def copied_packages(dockerfile: Path) -> set[str]:
    """The top-level source packages a Dockerfile's COPY instructions bring in."""
    text = dockerfile.read_text().replace("\\\n", " ")
    found = set()
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "COPY":
            continue
        sources = [w for w in words[1:-1] if not w.startswith("--")]
        for source in sources:
            top = source.strip("./").split("/")[0]
            if top in SOURCE_PACKAGES:
                found.add(top)
    return found


@pytest.mark.parametrize("name", sorted(ROLES))
def test_each_image_copies_only_its_roles_packages(name: str) -> None:
    copies, absent = ROLES[name]
    dockerfile = DOCKER / name
    assert copied_packages(dockerfile) == copies
    # The CPU images check at build time that the others are not importable.
    if "cuda" not in name:
        text = dockerfile.read_text()
        for package in absent:
            assert f"'{package}'" in text, f"{name} does not check that {package} is absent"


def role_env(tmp_path: Path, absent: tuple[str, ...]) -> dict[str, str]:
    folder = tmp_path / "role"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEDFED_")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(REPO)])
    env["MEDFED_TEST_ABSENT_PACKAGES"] = ",".join(absent)
    return env


def run_python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


IMPORT_ALL = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
for name in names:
    importlib.import_module(name)
for absent in sys.argv[2].split(","):
    try:
        importlib.import_module(absent)
    except ModuleNotFoundError:
        continue
    sys.exit(f"{absent} is importable: the blocker does not work")
print(len(names))
"""


def subcommands(help_text: str) -> set[str]:
    return set(re.findall(r"^    (\w[\w-]*)\s", help_text, re.M))


def test_the_blocker_refuses_what_it_names(tmp_path: Path) -> None:
    env = role_env(tmp_path, ("site_agent",))
    refused = run_python(env, "-c", "import site_agent.cli")
    assert refused.returncode != 0 and "No module named 'site_agent'" in refused.stderr
    assert run_python(env, "-c", "import coordinator.cli").returncode == 0


@pytest.mark.parametrize("role", ["coordinator", "site_agent"])
def test_every_module_of_a_role_imports_without_the_other_roles(
    role: str, tmp_path: Path
) -> None:
    absent = ROLES["coordinator.Dockerfile" if role == "coordinator" else
                  "site_agent.Dockerfile"][1]
    env = role_env(tmp_path, absent)
    done = run_python(env, "-c", IMPORT_ALL, role, ",".join(absent))
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 5


def test_the_coordinator_images_commands_work_without_site_agent(tmp_path: Path) -> None:
    env = role_env(tmp_path, ROLES["coordinator.Dockerfile"][1])
    listed = run_python(env, "-m", "common.commands.cli", "--help")
    assert listed.returncode == 0, listed.stderr
    commands = subcommands(listed.stdout)
    assert {"coordinator", "pki", "privacy", "ledger", "study", "query", "status"} <= commands
    assert not commands & {"site", "bench", "demo", "predict", "model", "data"}
    # The same commands the image's build checks, and those medfed-bootstrap runs.
    helps = {}
    for argv in (["coordinator", "serve", "--help"], ["privacy", "--help"],
                 ["query", "run", "--help"], ["pki", "--help"], ["ledger", "--help"]):
        done = run_python(env, "-m", "common.commands.cli", *argv)
        assert done.returncode == 0, f"{argv}: {done.stderr[-2000:]}"
        helps[argv[0]] = done.stdout
    # site_agent's plug-in: absent, not broken
    assert "audit" not in subcommands(helps["privacy"])
    missing = run_python(env, "-m", "common.commands.cli", "site", "run", "--help")
    assert missing.returncode == 2
    assert "'site' is not installed here (no site_agent package)" in missing.stderr


def test_the_site_images_commands_work_without_the_coordinator(tmp_path: Path) -> None:
    env = role_env(tmp_path, ROLES["site_agent.Dockerfile"][1])
    listed = run_python(env, "-m", "common.commands.cli", "--help")
    assert listed.returncode == 0, listed.stderr
    commands = subcommands(listed.stdout)
    assert {"site", "pki", "privacy", "data", "model", "predict", "query"} <= commands
    assert not commands & {"coordinator", "bench", "demo"}
    for argv in (["site", "run", "--help"], ["privacy", "audit", "--help"],
                 ["query", "check", "--help"], ["data", "--help"]):
        done = run_python(env, "-m", "common.commands.cli", *argv)
        assert done.returncode == 0, f"{argv}: {done.stderr[-2000:]}"
    missing = run_python(env, "-m", "common.commands.cli", "coordinator", "serve", "--help")
    assert missing.returncode == 2
    assert "'coordinator' is not installed here (no coordinator package)" in missing.stderr


PROBE_WITHOUT_TORCH = """
import sys
import numpy as np
from common.study import load_study
from coordinator.training_round import first_edges, probe
study = load_study(sys.argv[1])
flat = np.zeros(int(sys.argv[2]), dtype=np.float32)
print(probe(study, flat), first_edges(study, flat, bins=10))
"""


def test_without_torch_evaluation_buckets_follow_the_releases_alone(tmp_path: Path) -> None:
    """The public probe of the model needs torch: without it the first evaluated round
    counts with the default layout and later ones follow the release (no crash)."""
    env = role_env(tmp_path, ROLES["coordinator.Dockerfile"][1])
    done = run_python(env, "-c", PROBE_WITHOUT_TORCH, str(REPO / "deploy/demo/study.toml"), "81")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "()"]


def _serve_argv(tmp_path: Path, pki: Path, *extra: str) -> list[str]:
    return medfed_argv("coordinator", "serve",
                       "--config", str(REPO / "deploy/config/coordinator.toml"),
                       "--study", str(REPO / "deploy/demo/study.toml"),
                       "--pki", str(pki), "--state", str(tmp_path / "state"),
                       "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *extra)


@pytest.mark.e2e
def test_a_coordinator_without_site_agent_or_torch_serves_the_demo_study(
    tmp_path: Path,
) -> None:
    """The compose demo's coordinator command with the image's packages: without torch it
    refuses to start with what to run instead; with the initial model the site image's
    `medfed model init` wrote it listens."""
    env = role_env(tmp_path, ROLES["coordinator.Dockerfile"][1])
    site_env = role_env(tmp_path / "site", ROLES["site_agent.Dockerfile"][1])
    pki = tmp_path / "pki"
    for argv in (["pki", "init", "--dir", str(pki)],
                 ["pki", "issue", "--dir", str(pki), "--coordinator", "coordinator"]):
        done = subprocess.run(medfed_argv(*argv), env=env, capture_output=True, text=True,
                              timeout=180, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    refused = subprocess.run(_serve_argv(tmp_path, pki), env=env, capture_output=True,
                             text=True, timeout=180, cwd=tmp_path)
    assert refused.returncode != 0
    assert "no torch" in refused.stderr and "medfed model init" in refused.stderr, (
        refused.stderr[-2000:])
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]

    initial = tmp_path / "initial-model.safetensors"
    made = subprocess.run(medfed_argv("model", "init", "--study",
                                      str(REPO / "deploy/demo/study.toml"), "--out",
                                      str(initial)),
                          env=site_env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    coordinator = ManagedProcess(
        "coordinator", _serve_argv(tmp_path, pki, "--initial-model", str(initial)),
        log_dir=tmp_path / "logs", cwd=tmp_path, env=env,
    )
    try:
        ports = coordinator.wait_event("listening", timeout=120)
        assert ports["port"] > 0
    finally:
        coordinator.stop()
    log = "".join(p.read_text() for p in (tmp_path / "logs").iterdir())
    assert "site_agent" not in log and "round 1 starts from" in log, log[-3000:]


# --------------------------------------------------------------------------- tags


def make_images(*overrides: str) -> list[list[str]]:
    """The engine commands `make images` would run (make -n: nothing is built)."""
    done = subprocess.run(["make", "-n", "--no-print-directory", "images", "ENGINE=podman",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    builds = []
    for line in done.stdout.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:2] == ["podman", "build"]:
            builds.append(words)
    return builds


def build_args(words: list[str]) -> dict[str, str]:
    return dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--build-arg")


def option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def test_make_images_builds_both_roles_with_the_build_args() -> None:
    builds = make_images()
    assert {option(b, "-f"): option(b, "-t") for b in builds} == {
        "deploy/docker/site_agent.Dockerfile": f"medfed-site-agent:{VERSION}",
        "deploy/docker/coordinator.Dockerfile": f"medfed-coordinator:{VERSION}",
    }
    for words in builds:
        assert words[-1] == "."  # the repository root is the build context
        assert "--format" in words and option(words, "--format") == "docker"
        assert build_args(words) == {"BASE_IMAGE": "python:3.11-slim",
                                     "TORCH_INDEX": "https://download.pytorch.org/whl/cpu",
                                     "VERSION": VERSION}
    # A mirror, another base and another tag reach every build.
    overridden = make_images("BASE_IMAGE=registry.hospital.example/python:3.11-slim",
                             "TORCH_INDEX=https://mirror.hospital.example/torch",
                             "VERSION=9.9.9")
    assert len(overridden) == 2
    for words in overridden:
        assert build_args(words) == {
            "BASE_IMAGE": "registry.hospital.example/python:3.11-slim",
            "TORCH_INDEX": "https://mirror.hospital.example/torch", "VERSION": "9.9.9"}
        assert option(words, "-t").endswith(":9.9.9")


def test_every_deployment_runs_the_tags_make_images_builds() -> None:
    built = {option(b, "-t") for b in make_images()}
    used: dict[str, str] = {}
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        image = service["image"]
        if image.startswith("medfed-"):
            # ${MEDFED_VERSION:-X}: X unless the operator picks another built tag.
            used[f"compose {name}"] = re.sub(r"\$\{MEDFED_VERSION:-([^}]+)\}", r"\1", image)

    def containers(folder: Path) -> list[dict[str, Any]]:
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        found = []
        for resource in kustomization["resources"]:
            for doc in yaml.safe_load_all((folder / resource).read_text()):
                if doc and doc["kind"] == "Deployment":
                    found += doc["spec"]["template"]["spec"]["containers"]
        return found

    for container in containers(REPO / "deploy/k8s"):
        used[f"k8s coordinator {container['name']}"] = container["image"]
    for container in containers(REPO / "deploy/k8s/site/base"):
        used[f"k8s site base {container['name']}"] = container["image"]
    overlay = yaml.safe_load(
        (REPO / "deploy/k8s/site/overlays/example/kustomization.yaml").read_text())
    for image in overlay.get("images", []):
        used[f"k8s site overlay {image['name']}"] = f"{image['name']}:{image['newTag']}"
    assert {"compose coordinator", "compose site-rural", "k8s site overlay medfed-site-agent"
            } <= set(used)
    assert any(k.startswith("k8s coordinator") for k in used)
    wrong = {where: image for where, image in used.items() if image not in built}
    assert not wrong, f"not built by `make images` ({sorted(built)}): {wrong}"
