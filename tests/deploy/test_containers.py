"""The shipped images, built and run for real with a container engine (podman).

`make images` builds both images from the unmodified Dockerfiles; then a study runs in
containers: the coordinator (`--study`, the study mounted read-only) and three site
agents on an internal network, each site mounting only its own key folder and its own
data read-only. The healthchecks baked into the images run (`podman healthcheck run`),
/metrics is scraped over that network, every site ends with `model/final.safetensors`
(the coordinator's final model, byte for byte), and the coordinator stops cleanly
(exit 0) on SIGTERM.

Opt-in: runs only with MEDFED_CONTAINER_TESTS=1 (`make test-containers` sets it and runs
this file), because building both images from scratch takes about 28 minutes on two
cores; `make test` skips it and says so. Skipped, with the reason, where no engine can run
a container (.ci/scripts/container-engine.sh installs Debian's podman). Where
python:3.11-slim cannot be pulled, deploy/docker/standin-base.sh builds a stand-in base
under that tag (Debian bookworm's own Python 3.11), and the test says so.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.processes import ManagedProcess
from tests.e2e.harness import REPO

OPT_IN = "MEDFED_CONTAINER_TESTS"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get(OPT_IN) != "1",
        reason=f"container tests are opt-in: set {OPT_IN}=1 or run `make test-containers` "
        "(the image builds take about 28 minutes on two cores)",
    ),
]

ENGINE = shutil.which("podman")
BASE = "python:3.11-slim"
VERSION = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M)
TAG = VERSION.group(1) if VERSION else "0.1.0"
COORDINATOR_IMAGE = f"medfed-coordinator:{TAG}"
SITE_IMAGE = f"medfed-site-agent:{TAG}"
SITES = ("paediatric", "geriatric", "rural")
UID = 10001


def engine(
    *args: str, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess[str]:
    assert ENGINE is not None
    done = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr[-3000:]}")
    return done


def _engine_problem() -> str:
    """Why no container can run here ("" when one can)."""
    if ENGINE is None:
        return "podman not installed (.ci/scripts/container-engine.sh)"
    info = subprocess.run([ENGINE, "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                          capture_output=True, text=True, timeout=120)
    if info.returncode != 0:
        return f"podman cannot start here: {info.stderr.strip()[-300:]}"
    return ""


def _ensure_base() -> None:
    if engine("image", "exists", BASE, check=False).returncode == 0:
        return
    if engine("pull", "-q", f"docker.io/library/{BASE}", timeout=300, check=False).returncode == 0:
        return
    done = subprocess.run(["sh", str(REPO / "deploy/docker/standin-base.sh"), BASE],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings.warn(f"{BASE} could not be pulled: the images were built on a stand-in base "
                  "(deploy/docker/standin-base.sh: Debian bookworm's python3)", stacklevel=1)


def _pip_mounts(tmp: Path) -> tuple[list[str], bool]:
    """Build flags that give pip inside the build what it has here (index configuration,
    local wheel folders and file:// indexes, the CA bundle), and whether torch's CPU
    wheel is found locally (then the PyTorch index need not be reachable)."""
    merged = configparser.ConfigParser(interpolation=None)
    for path in ("/etc/pip.conf", "/etc/xdg/pip/pip.conf",
                 str(Path.home() / ".config/pip/pip.conf"), str(Path.home() / ".pip/pip.conf"),
                 os.environ.get("PIP_CONFIG_FILE", "")):
        if path and Path(path).is_file():
            merged.read(path)
    if not merged.has_section("global"):
        merged.add_section("global")
    for key, value in os.environ.items():
        if key.startswith("PIP_") and key not in {"PIP_CONFIG_FILE"}:
            merged.set("global", key[4:].lower().replace("_", "-"), value)
    paths: set[str] = set()
    torch_local = False
    for _key, value in merged.items("global"):
        for word in value.split():
            path = word.removeprefix("file://")
            if path.startswith("/") and Path(path).exists():
                paths.add(path)
    for key in ("find-links",):
        for word in merged.get("global", key, fallback="").split():
            if list(Path(word.removeprefix("file://")).glob("torch-2.13.0+cpu-*.whl")):
                torch_local = True
    conf = tmp / "pip.conf"
    with conf.open("w") as handle:
        merged.write(handle)
    flags = ["--network", "host", "-v", f"{conf}:/etc/pip.conf:ro"]
    for path in sorted(paths):
        flags += ["-v", f"{path}:{path}:ro"]
    return flags, torch_local


def _own(path: Path) -> Path:
    """A host folder the containers' user (uid 10001) can write."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, UID, UID)
    else:
        engine("unshare", "chown", f"{UID}:{UID}", str(path))
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    problem = _engine_problem()
    if problem:
        pytest.skip(problem)
    _ensure_base()
    flags, torch_local = _pip_mounts(tmp_path_factory.mktemp("pip"))
    command = ["make", "--no-print-directory", "images", f"ENGINE={ENGINE}",
               f"IMAGE_BUILD_FLAGS={' '.join(flags)}"]
    if torch_local:
        command.append("TORCH_INDEX=")
    built = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    sizes = {}
    for image in (COORDINATOR_IMAGE, SITE_IMAGE):
        inspected = json.loads(engine("image", "inspect", image).stdout)[0]
        sizes[image] = int(inspected["Size"])
        # HEALTHCHECK survives the build (podman needs --format docker for it).
        healthcheck = inspected.get("Healthcheck") or inspected["Config"].get("Healthcheck")
        assert healthcheck and healthcheck.get("Test"), image
        assert inspected["Config"]["User"] == "medfed", image
    print(f"image sizes: {sizes}")
    return sizes


def _python_in(container: str, code: str) -> str:
    return engine("exec", container, "python", "-c", code, timeout=120).stdout


def test_role_images_carry_only_their_own_code(images: dict[str, int]) -> None:
    probe = ("import importlib.util as u; "
             "print(sorted(m for m in ('coordinator', 'site_agent', 'bench', 'torch') "
             "if u.find_spec(m)))")
    site = engine("run", "--rm", "--entrypoint", "python", SITE_IMAGE, "-c", probe).stdout
    assert site.strip() == "['site_agent', 'torch']"
    coordinator = engine("run", "--rm", "--entrypoint", "python", COORDINATOR_IMAGE,
                         "-c", probe).stdout
    # torch: the coordinator builds a study's initial model (common.models.build).
    assert coordinator.strip() == "['coordinator', 'torch']"
    helped = engine("run", "--rm", "--entrypoint", "medfed", COORDINATOR_IMAGE,
                    "--help").stdout
    commands = re.findall(r"^    (\w+)\s", helped, re.M)
    assert "coordinator" in commands and "pki" in commands and "privacy" in commands
    assert "site" not in commands and "bench" not in commands
    # `medfed` in the site image lists the site's commands, not the coordinator's.
    helped = engine("run", "--rm", "--entrypoint", "medfed", SITE_IMAGE, "--help").stdout
    commands = re.findall(r"^    (\w+)\s", helped, re.M)
    assert "site" in commands and "pki" in commands
    assert "coordinator" not in commands and "bench" not in commands


@pytest.fixture
def run(tmp_path: Path) -> Iterator[dict[str, object]]:
    """An internal network and the names of the containers started on it; everything
    is removed afterwards, whatever happened."""
    suffix = uuid.uuid4().hex[:8]
    network = f"medfed-test-{suffix}"
    engine("network", "create", "--internal", network)
    started: list[str] = []
    procs: list[ManagedProcess] = []
    try:
        yield {"network": network, "suffix": suffix, "started": started, "procs": procs}
    finally:
        for name in started:
            engine("rm", "-f", "-t", "5", name, check=False, timeout=120)
        for proc in procs:
            if proc.alive:
                proc.proc.kill()
        engine("network", "rm", "-f", network, check=False)


HARDENING = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges"]


def test_a_study_in_containers(images: dict[str, int], run: dict[str, object],
                               tmp_path: Path) -> None:
    suffix = run["suffix"]
    logs = tmp_path / "logs"
    # PKI as the compose demo makes it: the coordinator image's medfed-bootstrap, as the
    # image's user, in folders it owns (operator CA, coordinator, one per hospital).
    operator, coordinator_pki = _own(tmp_path / "pki"), _own(tmp_path / "coordinator-pki")
    hospitals = {site: _own(tmp_path / "hospitals" / site) for site in SITES}
    mounts = ["-v", f"{operator}:/pki", "-v", f"{coordinator_pki}:/coordinator-pki"]
    for site, folder in hospitals.items():
        mounts += ["-v", f"{folder}:/hospitals/{site}"]
    # A tiny study: the demo study, one training round, no final evaluation round.
    config = tmp_path / "config"
    config.mkdir()
    study = (REPO / "deploy/demo/study.toml").read_text()
    study = study.replace("rounds = 5", "rounds = 1") + "\n[training]\nfinal_evaluation = false\n"
    (config / "study.toml").write_text(study)
    shutil.copy(REPO / "deploy/config/coordinator.toml", config / "coordinator.toml")
    shutil.copy(REPO / "deploy/config/site.toml", config / "site.toml")
    config.chmod(0o755)
    # As pki-init in docker-compose.yml: the study the coordinator serves names the
    # hospitals it signed, so the sites join with their default policy.
    engine("run", "--rm", "--network", "none", *HARDENING, *mounts,
           "-v", f"{config}:/config:ro",
           "-e", f"COORDINATOR_HOSTS=coordinator-{suffix}", "-e", f"SITES={' '.join(SITES)}",
           "-e", "STUDY_IN=/config/study.toml", "-e", "STUDY_OUT=/coordinator-pki/study.toml",
           "--entrypoint", "medfed-bootstrap", COORDINATOR_IMAGE, timeout=600)
    for site, folder in hospitals.items():
        assert sorted(p.name for p in (folder / "sites").iterdir()) == [
            f"{site}.crt", f"{site}.key"]
    served = (coordinator_pki / "study.toml").read_text()
    assert served.startswith(study)
    assert served.splitlines().count("[[members]]") == len(SITES)

    name = f"coordinator-{suffix}"
    coordinator_state = _own(tmp_path / "coordinator-state")
    coordinator = _start_with_command(run, name, COORDINATOR_IMAGE, [
        "-v", f"{coordinator_pki}:/pki:ro", "-v", f"{config}:/config:ro",
        "-v", f"{coordinator_state}:/state",
        "-e", "MEDFED_COORDINATOR_METRICS_LISTEN=0.0.0.0:9464",
        "-e", f"MEDFED_HEALTH_SERVER_NAME={name}",
    ], ["--config", "/config/coordinator.toml", "--study", "/pki/study.toml",
        "--selection-seconds", "1"], logs)
    coordinator.wait_event("listening", timeout=600)
    assert engine("healthcheck", "run", name, check=False).returncode == 0, "coordinator unhealthy"

    sites: dict[str, ManagedProcess] = {}
    site_states: dict[str, Path] = {}
    for site in SITES:
        site_states[site] = _own(tmp_path / "site-state" / site)
        sites[site] = _start_with_command(run, f"site-{site}-{suffix}", SITE_IMAGE, [
            # Its own key folder and its own records, both read-only.
            "-v", f"{hospitals[site]}:/pki:ro",
            "-v", f"{REPO / 'deploy/demo/data' / site}:/data:ro",
            "-v", f"{config}:/config:ro", "-v", f"{site_states[site]}:/state",
            "-e", f"MEDFED_SITE_SITE={site}", "-e", f"MEDFED_SITE_COORDINATOR={name}:7443",
            "-e", "MEDFED_SITE_PKI=/pki", "-e", "MEDFED_SITE_METRICS_LISTEN=0.0.0.0:9465",
            "-e", "MEDFED_SITE_DATA__PATH=/data/records.csv",
            "-e", "OMP_NUM_THREADS=1",
        ], ["--config", "/config/site.toml", "--once"], logs)

    for site, proc in sites.items():
        proc.wait_event("started", timeout=600)
        container = f"site-{site}-{suffix}"
        assert engine("healthcheck", "run", container, check=False).returncode == 0, site
        # Prometheus's view: the site's /metrics over the internal network.
        scraped = _python_in(name, "import urllib.request as r; print(r.urlopen("
                             f"'http://{container}:9465/metrics', timeout=10).read().decode())")
        assert "medfed_site_epsilon_budget" in scraped
        mounts_of = {m["Destination"]: m for m in json.loads(
            engine("inspect", container).stdout)[0]["Mounts"]}
        assert mounts_of["/pki"]["Source"] == str(hospitals[site]) and not mounts_of["/pki"]["RW"]
        assert not mounts_of["/data"]["RW"]
        # Only this hospital's key is inside its container.
        keys = engine("exec", container, "find", "/pki", "/data", "/config", "-name", "*.key")
        assert keys.stdout.split() == [f"/pki/sites/{site}.key"]

    for site, proc in sites.items():
        assert proc.proc.wait(timeout=1800) == 0, f"{site}:\n{proc.tail(30)}"
    final = (coordinator_state / "model" / "final.safetensors").read_bytes()
    for site in SITES:
        assert (site_states[site] / "model" / "final.safetensors").read_bytes() == final

    metrics = _python_in(name, "import urllib.request as r; print(r.urlopen("
                         "'http://127.0.0.1:9464/metrics', timeout=10).read().decode())")
    assert re.search(r"^medfed_coordinator_study_finished 1\.0$", metrics, re.M)
    assert re.search(r'^medfed_coordinator_rounds_total\{outcome="completed"\} [1-9]', metrics,
                     re.M)
    # Three sites that each refuse a sum of two: threshold 3, margin 0 with no dropout
    # (why MedfedQuorumMarginLow also asks for dropouts).
    assert re.search(r"^medfed_coordinator_quorum_margin_sites 0\.0$", metrics, re.M)
    assert not re.search(r"^medfed_coordinator_dropouts_total\{[^}]*\} [1-9]", metrics, re.M)

    # SIGTERM (podman stop) ends the coordinator cleanly well before the SIGKILL timeout.
    engine("stop", "-t", "60", name, timeout=180)
    assert coordinator.proc.wait(timeout=120) == 0, coordinator.tail(20)
    state = json.loads(engine("inspect", name).stdout)[0]["State"]
    assert state["ExitCode"] == 0


def _start_with_command(run: dict[str, object], name: str, image: str, args: list[str],
                        command: list[str], log_dir: Path) -> ManagedProcess:
    started = run["started"]
    procs = run["procs"]
    assert isinstance(started, list) and isinstance(procs, list)
    started.append(name)
    proc = ManagedProcess(name, [str(ENGINE), "run", "--name", name,
                                 "--network", str(run["network"]), *HARDENING, *args, image,
                                 *command], log_dir=log_dir)
    procs.append(proc)
    return proc
