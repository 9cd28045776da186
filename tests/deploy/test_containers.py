"""The shipped images, built and run for real with a container engine (podman).

`make images` builds both images from the unmodified Dockerfiles; then a study runs in
containers: the coordinator (`--study`, the study mounted read-only) and three site
agents on an internal network, each site mounting only its own key folder and its own
data read-only. The healthchecks baked into the images run (`podman healthcheck run`),
/metrics is scraped over that network, every site ends with `model/final.safetensors`
(the coordinator's final model, byte for byte), and the coordinator stops cleanly
(exit 0) on SIGTERM. The coordinator image has no torch: the site image's `medfed model
init` writes the study's untrained network (compose's model-init), which the coordinator
serves round 1 from. Then the Kubernetes Deployment runs under `podman kube play`.

Part of `make test`: the images build in about two minutes on two cores where pip's
package index and wheel folders are local (they are mounted into the build). Skipped,
with the reason, where no engine can run a container (.ci/run installs Debian's podman
with .ci/scripts/install-container-engine.sh), or with MEDFED_CONTAINER_TESTS=0. Where
python:3.11-slim cannot be pulled, deploy/docker/standin-base.sh builds a stand-in base
under that tag (Debian bookworm's own Python 3.11), and the test says so.
"""

from __future__ import annotations

import configparser
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess
from tests.e2e.harness import REPO

OPT_OUT = "MEDFED_CONTAINER_TESTS"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.environ.get(OPT_OUT) == "0",
                       reason=f"container tests turned off ({OPT_OUT}=0)"),
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
        return "podman not installed (.ci/scripts/install-container-engine.sh)"
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
            path = word.removeprefix("file://").rstrip("/")
            if path.startswith("/") and Path(path).exists():
                # A file:// index's pages link to files beside its simple/ folder
                # (../../files/...): mount the index's root.
                paths.add(str(Path(path).parent) if Path(path).name == "simple" else path)
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
def images() -> dict[str, int]:
    problem = _engine_problem()
    if problem:
        pytest.skip(problem)
    return _built_images()


@functools.cache
def _built_images() -> dict[str, int]:
    """Both images, built once per process: under xdist a worker may tear the module
    fixture down between this file's tests (seen: three builds in one CI run)."""
    _ensure_base()
    with tempfile.TemporaryDirectory() as pip_folder:
        return _build(Path(pip_folder))


def _build(pip_folder: Path) -> dict[str, int]:
    flags, torch_local = _pip_mounts(pip_folder)
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


def _study_sha256_of(path: Path) -> str:
    from common.study import load_study, study_sha256

    return study_sha256(load_study(path))


def _python_in(container: str, code: str) -> str:
    return engine("exec", container, "python", "-c", code, timeout=120).stdout


# Inside the coordinator's container: GET /metrics from 127.0.0.1:9464 over TLS with the
# health probe's monitor pair, verifying the server as a name in coordinator.crt.
_HTTPS_SCRAPE = (
    "import socket, ssl; "
    "c = ssl.create_default_context(cafile='/pki/ca.crt'); "
    "c.load_cert_chain('/pki/monitors/healthcheck.crt', '/pki/monitors/healthcheck.key'); "
    "s = c.wrap_socket(socket.create_connection(('127.0.0.1', 9464), timeout=10), "
    "server_hostname='{server_name}'); "
    "s.sendall(b'GET /metrics HTTP/1.0\\r\\nHost: metrics\\r\\n\\r\\n'); "
    "reply = b''.join(iter(lambda: s.recv(65536), b'')).decode(); "
    "assert reply.startswith('HTTP/1.0 200'), reply[:200]; "
    "print(reply.split('\\r\\n\\r\\n', 1)[1])"
)


def test_role_images_carry_only_their_own_code(images: dict[str, int]) -> None:
    probe = ("import importlib.util as u; "
             "print(sorted(m for m in ('coordinator', 'site_agent', 'bench', 'torch') "
             "if u.find_spec(m)))")
    site = engine("run", "--rm", "--entrypoint", "python", SITE_IMAGE, "-c", probe).stdout
    assert site.strip() == "['site_agent', 'torch']"
    coordinator = engine("run", "--rm", "--entrypoint", "python", COORDINATOR_IMAGE,
                         "-c", probe).stdout
    # No torch: round 1's network comes from the site image's `medfed model init`.
    assert coordinator.strip() == "['coordinator']"
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
            engine("rm", "-f", "-v", "-t", "5", name, check=False, timeout=120)
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
    coordinator_study = _own(tmp_path / "coordinator-study")
    hospitals = {site: _own(tmp_path / "hospitals" / site) for site in SITES}
    mounts = ["-v", f"{operator}:/pki", "-v", f"{coordinator_pki}:/coordinator-pki",
              "-v", f"{coordinator_study}:/coordinator-study"]
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
           "-e", "STUDY_IN=/config/study.toml", "-e", "STUDY_OUT=/coordinator-study/study.toml",
           "--entrypoint", "medfed-bootstrap", COORDINATOR_IMAGE, timeout=600)
    for site, folder in hospitals.items():
        assert sorted(p.name for p in (folder / "sites").iterdir()) == [
            f"{site}.crt", f"{site}.key"]
    served = (coordinator_study / "study.toml").read_text()
    assert served.startswith(study)
    assert served.splitlines().count("[[members]]") == len(SITES)
    # As model-init: the site image writes the served study's untrained network, seeing
    # that folder only (the coordinator image has no torch to build it).
    engine("run", "--rm", "--network", "none", *HARDENING,
           "-v", f"{coordinator_study}:/study", "--entrypoint", "medfed", SITE_IMAGE,
           "model", "init", "--study", "/study/study.toml",
           "--out", "/study/initial-model.safetensors", timeout=600)
    assert (coordinator_study / "initial-model.safetensors").stat().st_size > 0

    name = f"coordinator-{suffix}"
    coordinator_state = _own(tmp_path / "coordinator-state")
    coordinator = _start_with_command(run, name, COORDINATOR_IMAGE, [
        "-v", f"{coordinator_pki}:/pki:ro", "-v", f"{config}:/config:ro",
        "-v", f"{coordinator_study}:/study:ro", "-v", f"{coordinator_state}:/state",
        "-e", "MEDFED_COORDINATOR_METRICS_LISTEN=0.0.0.0:9464",
        "-e", f"MEDFED_HEALTH_SERVER_NAME={name}",
    ], ["--config", "/config/coordinator.toml", "--study", "/study/study.toml",
        "--initial-model", "/study/initial-model.safetensors",
        "--selection-seconds", "1"], logs)
    coordinator.wait_event("listening", timeout=600)
    assert engine("healthcheck", "run", name, check=False).returncode == 0, "coordinator unhealthy"

    sites: dict[str, ManagedProcess] = {}
    site_states: dict[str, Path] = {}
    served_sha256 = _study_sha256_of(coordinator_study / "study.toml")
    for site in SITES:
        site_states[site] = _own(tmp_path / "site-state" / site)
        identity = ["-e", f"MEDFED_SITE_SITE={site}", "-e", f"MEDFED_SITE_COORDINATOR={name}:7443",
                    "-e", "MEDFED_SITE_PKI=/pki", "-e", f"MEDFED_SITE_STUDY_SHA256={served_sha256}"]
        # As compose's approve-SITE job: the hospital's privacy officer pins the study it
        # received from pki-init (its own folder), checked against the SHA-256 read out.
        approved = engine("run", "--rm", "--network", "none", *HARDENING,
                          "-v", f"{hospitals[site]}:/pki:ro", "-v", f"{config}:/config:ro",
                          "-v", f"{site_states[site]}:/state", *identity,
                          "--entrypoint", "medfed", SITE_IMAGE, "site", "approve",
                          "/pki/study.toml", "--config", "/config/site.toml", "--yes",
                          timeout=600)
        assert json.loads(approved.stdout.splitlines()[-1])["sha256"] == served_sha256
        sites[site] = _start_with_command(run, f"site-{site}-{suffix}", SITE_IMAGE, [
            # Its own key folder and its own records, both read-only.
            "-v", f"{hospitals[site]}:/pki:ro",
            "-v", f"{REPO / 'deploy/demo/data' / site}:/data:ro",
            "-v", f"{config}:/config:ro", "-v", f"{site_states[site]}:/state", *identity,
            "-e", "MEDFED_SITE_DATA__PATH=/data/records.csv",
            "-e", "OMP_NUM_THREADS=1",
        # Not --once: a site stays up after the study (as in compose), so each check
        # below finds it running however fast the one round is.
        ], ["--config", "/config/site.toml"], logs)

    for site, proc in sites.items():
        proc.wait_event("started", timeout=600)
        container = f"site-{site}-{suffix}"
        assert engine("healthcheck", "run", container, check=False).returncode == 0, site
        # The hospital's own view (its Prometheus on its own network): the site's
        # /metrics on the container's loopback, as site.toml binds it; the coordinator's
        # container on the shared network cannot read a hospital's counts.
        scraped = _python_in(container, "import urllib.request as r; print(r.urlopen("
                             "'http://127.0.0.1:9465/metrics', timeout=10).read().decode())")
        assert "medfed_site_epsilon_budget" in scraped
        unreachable = engine("exec", name, "python", "-c", "import urllib.request as r; "
                             f"r.urlopen('http://{container}:9465/metrics', timeout=10)",
                             check=False, timeout=120)
        assert unreachable.returncode != 0, unreachable.stdout
        mounts_of = {m["Destination"]: m for m in json.loads(
            engine("inspect", container).stdout)[0]["Mounts"]}
        assert mounts_of["/pki"]["Source"] == str(hospitals[site]) and not mounts_of["/pki"]["RW"]
        assert not mounts_of["/data"]["RW"]
        # Only this hospital's key is inside its container.
        keys = engine("exec", container, "find", "/pki", "/data", "/config", "-name", "*.key")
        assert keys.stdout.split() == [f"/pki/sites/{site}.key"]

    for proc in sites.values():
        proc.wait_event("final_model", timeout=1800)
    final = (coordinator_state / "model" / "final.safetensors").read_bytes()
    for site, proc in sites.items():
        assert (site_states[site] / "model" / "final.safetensors").read_bytes() == final
        # SIGTERM ends a site cleanly too.
        engine("stop", "-t", "60", f"site-{site}-{suffix}", timeout=180)
        assert proc.proc.wait(timeout=120) == 0, f"{site}:\n{proc.tail(30)}"
    coordinator_log = "".join(path.read_text(errors="replace") for path in logs.iterdir())
    assert "round 1 starts from /study/initial-model.safetensors" in coordinator_log
    assert "evaluation_probe_unavailable" in coordinator_log

    # Opened beyond loopback, /metrics is HTTPS for monitor certificates only: the probe's.
    metrics = _python_in(name, _HTTPS_SCRAPE.format(server_name=name))
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


# --------------------------------------------------------------------------- compose


def _anonymous_volumes(*containers: str) -> list[str]:
    """The unnamed volumes podman made for the images' VOLUME /state where a container
    mounts nothing there (compose's one-off jobs, the kube init container): `down` and
    `kube down` leave them behind."""
    names = []
    for name in containers:
        done = engine("inspect", name, check=False)
        if done.returncode != 0:
            continue
        for mount in json.loads(done.stdout)[0].get("Mounts", []):
            if mount.get("Type") == "volume" and re.fullmatch(r"[0-9a-f]{64}",
                                                              mount.get("Name", "")):
                names.append(mount["Name"])
    return names


COMPOSE_SERVICES = ("pki-init", "model-init", "coordinator",
                    *(f"approve-{site}" for site in SITES),
                    *(f"site-{site}" for site in SITES))


def _compose_tool() -> list[str] | None:
    found = shutil.which("podman-compose", path=str(Path(sys.executable).parent))
    return [found] if found else None


def test_the_compose_demo_runs_with_podman_compose(images: dict[str, int],
                                                   tmp_path: Path) -> None:
    """docker-compose.yml as shipped, run by podman-compose from the repository root as
    docs/deploy.md says (`up`), all but Prometheus and Grafana (their images come from a
    registry this machine cannot reach): pki-init, model-init, the coordinator and the
    three sites finish the demo study, each site with the coordinator's final model and
    only its own key. podman 4.3 keeps no health status without systemd, so
    podman-compose starts the sites without waiting for `service_healthy` (it says so);
    they wait for the coordinator themselves."""
    tool = _compose_tool()
    if tool is None:
        pytest.skip("podman-compose not installed (requirements/dev.lock has it)")
    project = f"medfed{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "GRAFANA_ADMIN_PASSWORD": uuid.uuid4().hex}
    compose = [*tool, "-p", project]

    def container(service: str) -> str:
        return f"{project}_{service}_1"

    try:
        up = subprocess.run([*compose, "up", "-d", *COMPOSE_SERVICES], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        follow = {name: ManagedProcess(name, [str(ENGINE), "logs", "-f", container(name)],
                                       log_dir=tmp_path / "logs")
                  for name in ("coordinator", *(f"site-{site}" for site in SITES))}
        for site in SITES:
            follow[f"site-{site}"].wait_event("final_model", timeout=900)
        digests = {}
        for name in follow:
            digests[name] = engine(
                "exec", container(name), "python", "-c",
                "import hashlib; print(hashlib.sha256(open("
                "'/state/model/final.safetensors', 'rb').read()).hexdigest())").stdout.strip()
        assert len(set(digests.values())) == 1 and len(digests["coordinator"]) == 64, digests
        for site in SITES:
            keys = engine("exec", container(f"site-{site}"), "find", "/pki", "/data", "/config",
                          "-name", "*.key").stdout.split()
            assert keys == [f"/pki/sites/{site}.key"]
        assert engine("healthcheck", "run", container("coordinator"),
                      check=False).returncode == 0
        for one_off in ("pki-init", "model-init", *(f"approve-{site}" for site in SITES)):
            state = json.loads(engine("inspect", container(one_off)).stdout)[0]["State"]
            assert state["ExitCode"] == 0, one_off
        served = engine("exec", container("coordinator"), "cat", "/study/study.toml").stdout
        for site in SITES:
            # Each hospital's approval pinned the study the coordinator served, and its
            # summary (members with their key fingerprints) is in the job's log.
            approval = engine("logs", container(f"approve-{site}")).stdout
            assert '"approved": "study"' in approval and "members       3 hospitals" in approval
            received = engine("exec", container(f"site-{site}"), "cat",
                              "/pki/study.toml").stdout
            assert received == served
        text = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir())
        assert "round 1 starts from /study/initial-model.safetensors" in text
        assert "study finished" in text
    finally:
        anonymous = _anonymous_volumes(*(container(s) for s in COMPOSE_SERVICES))
        subprocess.run([*compose, "down", "-v", "-t", "10"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
        if anonymous:
            engine("volume", "rm", "-f", *anonymous, check=False)


# --------------------------------------------------------------------------- Kubernetes


def _owned_by_root_group_medfed(path: Path, mode: int) -> None:
    """As the kubelet mounts a Secret with fsGroup 10001 and defaultMode 0440."""
    if os.geteuid() == 0:
        os.chown(path, 0, UID)
    else:
        engine("unshare", "chown", f"0:{UID}", str(path))
    path.chmod(mode)


def test_the_kubernetes_deployment_runs_under_podman_kube_play(
    images: dict[str, int], tmp_path: Path
) -> None:
    """deploy/k8s's Deployment (after kubernetes-validate --strict, tests/deploy/
    test_k8s_site.py) as `podman kube play` runs it, with the ConfigMap and the PVC as
    shipped: the init container (site image) writes the study's untrained network into
    the emptyDir, the coordinator (non-root, read-only root file system, no capability)
    serves round 1 from it, the manifest's probe command passes, and SIGTERM stops it
    cleanly. Two deviations, both for podman 4.3 and said here: its kube play mounts a
    Secret volume's `data` still base64-encoded, ignoring `items` paths and
    `defaultMode`, so the TLS volume is a hostPath folder laid out and owned as the
    kubelet would mount that Secret (root:10001, 0440); and it cannot remove an init
    container of a pod whose restartPolicy is Always, so the played copy says Never."""
    import yaml  # type: ignore[import-untyped]

    from common.core.processes import medfed_argv

    suffix = uuid.uuid4().hex[:8]
    pki = tmp_path / "pki"
    for argv in (["pki", "init", "--dir", str(pki)],
                 ["pki", "issue", "--dir", str(pki), "--coordinator", "fl.example.org"],
                 ["pki", "issue", "--dir", str(pki), "--monitor", "healthcheck"]):
        subprocess.run(medfed_argv(*argv), check=True, capture_output=True, timeout=180)
    tls = tmp_path / "tls"
    (tls / "monitors").mkdir(parents=True)
    for name in ("ca.crt", "crl.pem", "coordinator.crt", "coordinator.key",
                 "monitors/healthcheck.crt", "monitors/healthcheck.key"):
        shutil.copy(pki / name, tls / name)
        _owned_by_root_group_medfed(tls / name, 0o440)
    for folder in (tls / "monitors", tls):
        _owned_by_root_group_medfed(folder, 0o750)

    k8s = REPO / "deploy/k8s"
    (pvc,) = yaml.safe_load_all((k8s / "pvc.yaml").read_text())
    (deployment,) = yaml.safe_load_all((k8s / "deployment.yaml").read_text())
    name = f"medfed-coordinator-{suffix}"
    pvc["metadata"]["name"] = f"{name}-state"
    deployment["metadata"]["name"] = name
    pod = deployment["spec"]["template"]["spec"]
    pod["restartPolicy"] = "Never"
    for volume in pod["volumes"]:
        if volume["name"] == "tls":
            assert volume["secret"]["defaultMode"] == 0o440
            volume.clear()
            volume.update({"name": "tls", "hostPath": {"path": str(tls), "type": "Directory"}})
        if volume["name"] == "state":
            volume["persistentVolumeClaim"]["claimName"] = f"{name}-state"
    played = tmp_path / "coordinator.yaml"
    played.write_text(yaml.safe_dump_all([pvc, deployment]))

    container = f"{name}-pod-0-coordinator"
    volumes_before = set(engine("volume", "ls", "-q").stdout.split())
    try:
        engine("kube", "play", "--configmap", str(k8s / "configmap.yaml"), str(played),
               timeout=600)
        logs = ManagedProcess("kube-coordinator", [str(ENGINE), "logs", "-f", container],
                              log_dir=tmp_path / "logs")
        logs.wait_event("listening", timeout=300)
        (coordinator,) = pod["containers"]
        probe = coordinator["readinessProbe"]["exec"]["command"]
        checked = engine("exec", container, *probe, check=False, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        inspected = json.loads(engine("inspect", container).stdout)[0]
        assert inspected["Config"]["User"].split(":")[0] == str(UID)
        assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        written = engine("exec", container, "ls", "/model").stdout.split()
        assert written == ["initial-model.safetensors"]
        engine("pod", "stop", "-t", "30", f"{name}-pod-0", timeout=120)
        state = json.loads(engine("inspect", container).stdout)[0]["State"]
        assert state["ExitCode"] == 0, logs.tail(20)
        text = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir())
        assert "round 1 starts from /model/initial-model.safetensors" in text, text[-3000:]
    finally:
        engine("kube", "down", str(played), check=False, timeout=180)
        # The PVC's volume, the one kube play made for the ConfigMap, and the unnamed
        # ones podman made for the images' VOLUME /state (the init container, removed
        # once it ran, can no longer be asked for its own): those no container uses.
        engine("volume", "rm", "-f", f"{name}-state", "medfed-coordinator-config",
               check=False)
        made = {v for v in engine("volume", "ls", "-q").stdout.split()
                if v not in volumes_before and re.fullmatch(r"[0-9a-f]{64}", v)}
        for volume in made:
            engine("volume", "rm", volume, check=False)  # not -f: never one in use


def test_the_kubernetes_site_kit_approves_then_joins_under_podman_kube_play(
    images: dict[str, int], tmp_path: Path
) -> None:
    """deploy/k8s/site's rendered example overlay as `podman kube play` runs it: the init
    container `approve-study` pins the study ConfigMap in the state volume under the
    SHA-256 the overlay sets (the one the hospital's privacy officer read out), then the
    agent container (UID 10001, read-only root file system) enrols with a coordinator
    serving that study and joins it. The same deviations as the coordinator's pod
    (restartPolicy Never, the TLS Secret as a hostPath folder laid out as the kubelet
    mounts it), and three more for this machine: the pod on the host's network (the
    coordinator is a process here, on 127.0.0.1; so no port mapping), the data volume a
    hostPath folder with the hospital's records, and the metrics port at 0 (several runs
    share the host)."""
    import yaml  # type: ignore[import-untyped]

    from common.core.processes import medfed_argv
    from common.protocol import pki
    from common.study import load_study, study_bytes, study_sha256
    from tests.deploy.test_k8s_site import OVERLAY, render
    from tests.e2e.harness import list_members

    suffix = uuid.uuid4().hex[:8]
    site = "st-marys"
    pki_dir = tmp_path / "pki"
    pki.init_ca(pki_dir)
    pki.issue_coordinator(pki_dir, ["127.0.0.1", "localhost"])
    request = pki.request_certificate(tmp_path / "hospital", site)
    pki.sign_request(pki_dir, request.csr_path)
    study_path = tmp_path / "study.toml"
    shutil.copy(REPO / "deploy/demo/study.toml", study_path)
    list_members(study_path, pki_dir, [site])
    study = load_study(study_path)

    coordinator = ManagedProcess(
        "kube-site-coordinator",
        medfed_argv("coordinator", "serve", "--study", str(study_path), "--pki", str(pki_dir),
                    "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                    "--state", str(tmp_path / "coordinator-state"), "--min-sites", "3"),
        log_dir=tmp_path / "logs", cwd=REPO)
    try:
        port = int(coordinator.wait_event("listening", timeout=300)["port"])
        tls = tmp_path / "tls"
        tls.mkdir()
        for source, name in ((pki_dir / "ca.crt", "ca.crt"),
                             (pki.site_paths(pki_dir, site)[0], "site.crt"),
                             (tmp_path / "hospital" / f"{site}.key", "site.key")):
            shutil.copy(source, tls / name)
            _owned_by_root_group_medfed(tls / name, 0o440)
        _owned_by_root_group_medfed(tls, 0o750)

        docs = render(OVERLAY)
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
        (state_claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"
                          and d["metadata"]["name"] == "medfed-site-state"]
        name = f"medfed-site-{suffix}"
        for doc in (deployment, config, state_claim):
            doc["metadata"].pop("namespace", None)
        state_claim["metadata"]["name"] = f"{name}-state"
        deployment["metadata"]["name"] = name
        config["metadata"]["name"] = f"{name}-config"
        config["data"]["site.toml"] = config["data"]["site.toml"].replace(
            'metrics_listen = "0.0.0.0:9465"', 'metrics_listen = "127.0.0.1:0"')
        study_map = {"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": f"{name}-study"},
                     "data": {"study.toml": study_path.read_text()}}
        pod = deployment["spec"]["template"]["spec"]
        pod["restartPolicy"] = "Never"
        pod["hostNetwork"] = True
        for volume in pod["volumes"]:
            if volume["name"] == "tls":
                volume.clear()
                volume.update({"name": "tls", "hostPath": {"path": str(tls),
                                                           "type": "Directory"}})
            elif volume["name"] == "data":
                volume.clear()
                volume.update({"name": "data", "hostPath": {
                    "path": str(REPO / "deploy/demo/data/rural"), "type": "Directory"}})
            elif volume["name"] == "state":
                volume["persistentVolumeClaim"]["claimName"] = f"{name}-state"
            elif volume["name"] == "config":
                volume["configMap"]["name"] = f"{name}-config"
            elif volume["name"] == "study":
                assert volume["configMap"]["name"] == "medfed-site-study"
                volume["configMap"]["name"] = f"{name}-study"
        (init,) = pod["initContainers"]
        (agent,) = pod["containers"]
        agent.pop("ports")  # podman maps no port of a pod on the host's network
        for container in (init, agent):
            for item in container["env"]:
                if item["name"] == "MEDFED_SITE_COORDINATOR":
                    item["value"] = f"127.0.0.1:{port}"
                if item["name"] == "MEDFED_SITE_STUDY_SHA256":
                    # What the hospital sets in its overlay: the hash its officer read.
                    item["value"] = study_sha256(study)
        played = tmp_path / "site.yaml"
        played.write_text(yaml.safe_dump_all([state_claim, deployment]))
        maps = []
        for doc in (config, study_map):
            maps += ["--configmap", str(tmp_path / f"{doc['metadata']['name']}.yaml")]
            Path(maps[-1]).write_text(yaml.safe_dump(doc))

        container = f"{name}-pod-0-site-agent"
        volumes_before = set(engine("volume", "ls", "-q").stdout.split())
        try:
            engine("kube", "play", *maps, str(played), timeout=600)
            logs = ManagedProcess("kube-site", [str(ENGINE), "logs", "-f", container],
                                  log_dir=tmp_path / "logs")
            joined = logs.wait_event("study_joined", timeout=600)
            assert joined["records"] > 0
            pinned = engine("exec", container, "cat", "/state/approved/study.json").stdout
            assert pinned.encode() == study_bytes(study)
            inspected = json.loads(engine("inspect", container).stdout)[0]
            assert inspected["Config"]["User"].split(":")[0] == str(UID)
            assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        finally:
            engine("kube", "down", str(played), check=False, timeout=180)
            engine("volume", "rm", "-f", f"{name}-state", f"{name}-config", f"{name}-study",
                   check=False)
            made = {v for v in engine("volume", "ls", "-q").stdout.split()
                    if v not in volumes_before and re.fullmatch(r"[0-9a-f]{64}", v)}
            for volume in made:
                engine("volume", "rm", volume, check=False)
    finally:
        coordinator.stop()
