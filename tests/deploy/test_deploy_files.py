"""Deployment files: containers, compose, Kubernetes, example configs.

There is no Docker engine on the test machines, so images are not built here; what can
be checked without one is: every YAML parses, `docker-compose config` accepts the
compose file, the Dockerfiles keep their security basics, the example configs validate
with the real settings models, and the health-check script and the bootstrap script
work against a real coordinator process.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from common.core.config import CoordinatorSettings, SiteSettings, load_settings
from common.core.processes import ManagedProcess, medfed_argv
from common.protocol import pki
from common.study import load_study
from tests.e2e.harness import REPO

DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
COMPOSE = REPO / "docker-compose.yml"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
BOOTSTRAP = DEPLOY / "docker" / "bootstrap.sh"
SITES = ("paediatric", "geriatric", "rural")


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml"), COMPOSE])


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read MEDFED_* variables: none from the developer's shell may leak in."""
    for name in list(os.environ):
        if name.startswith("MEDFED_"):
            monkeypatch.delenv(name)


# --------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_file_parses(path: Path) -> None:
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents, f"{path} is empty"
    for document in documents:
        assert isinstance(document, dict)


def test_grafana_dashboard_is_json_with_panels() -> None:
    import json

    dashboard = json.loads((DEPLOY / "grafana/dashboards/medfed-federation.json").read_text())
    assert len([p for p in dashboard["panels"] if p["type"] != "row"]) >= 9
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/medfed.yml")
    compose_grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = {v.split(":")[1] for v in compose_grafana["volumes"] if v.startswith("./")}
    assert provider["providers"][0]["options"]["path"] in mounts
    # The operator's Grafana provisions the operator's dashboard only: a hospital's
    # (deploy/grafana/site) belongs to that hospital's own Grafana.
    sources = {v.split(":")[0] for v in compose_grafana["volumes"] if v.startswith("./")}
    assert "./deploy/grafana/dashboards" in sources
    assert not any(source.startswith("./deploy/grafana/site") for source in sources)
    assert sorted(p.name for p in (DEPLOY / "grafana/dashboards").iterdir()) == [
        "medfed-federation.json"]


# --------------------------------------------------------------------------- Dockerfiles


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_the_three_dockerfiles_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "coordinator.Dockerfile", "site_agent.Dockerfile", "site_agent.cuda.Dockerfile"
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_basics(path: Path) -> None:
    steps = instructions(path)
    users = [args for keyword, args in steps if keyword == "USER"]
    assert users, "no USER: the container would run as root"
    final_user = users[-1].split(":")[0]
    assert final_user not in {"root", "0"}
    # The USER comes after the last FROM, i.e. it applies to the image that ships.
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    assert any(k == "USER" for k, _ in steps[last_from:])
    healthchecks = [args for keyword, args in steps if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "medfed-healthcheck" in healthchecks[0]
    assert any(k == "ENTRYPOINT" and "medfed" in a for k, a in steps)
    text = path.read_text()
    if "cuda" in path.name:
        # torch pinned (never a silent upgrade) and installed from an explicit index.
        assert re.search(r"torch==2\.13\.0 --index-url ", text)
        # The rest from the site lock with hashes, its CPU torch entry cut as `make` does.
        drop_torch = re.search(r"sed '(/\^torch==/[^']+)'", text)
        makefile = (REPO / "Makefile").read_text()
        assert drop_torch and f"sed '{drop_torch.group(1)}'" in makefile
        assert re.search(r"pip install --require-hashes .*-r /src/requirements/"
                         r"site-without-torch\.lock", text.replace("\\\n", " "))
    else:
        # Every package from the role's lock file, each pinned with its hash.
        assert re.search(r"pip install --require-hashes .*-r /src/requirements/\w+\.lock",
                         text.replace("\\\n", " "))


def _pins(lock: Path) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock.read_text(), re.M))


def test_each_image_installs_what_make_tests_and_the_coordinator_no_network_code() -> None:
    """Every pin of both images' locks is the dev lock's (what `make test` runs); the
    coordinator's lock has no torch, Opacus or MONAI (its image builds no network)."""
    locks = REPO / "requirements"
    dev = _pins(locks / "dev.lock")
    for role in ("site", "coordinator"):
        pins = _pins(locks / f"{role}.lock")
        assert pins and {name: dev.get(name) for name in pins} == pins, role
    coordinator = {name.lower() for name in _pins(locks / "coordinator.lock")}
    assert not coordinator & {"torch", "opacus", "monai", "torchvision"}
    assert {"torch", "opacus", "monai"} <= {name.lower() for name in _pins(locks / "site.lock")}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_bakes_in_no_secrets(path: Path) -> None:
    text = path.read_text()
    assert "PRIVATE KEY" not in text
    for keyword, args in instructions(path):
        if keyword in {"COPY", "ADD"}:
            assert not re.search(r"\.(key|pem|crt|p12|db)\b|\bpki\b|\.env\b", args), args
        if keyword in {"ENV", "ARG"}:
            for name in re.findall(r"([A-Z_][A-Z0-9_]*)=", args):
                assert not re.search(r"PASSWORD|SECRET|TOKEN|PRIVATE", name), name
    dockerignore = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in dockerignore and "**/*.key" in dockerignore


def test_cpu_images_use_python_slim_and_the_cpu_torch_index() -> None:
    for name in ("coordinator.Dockerfile", "site_agent.Dockerfile"):
        steps = instructions(DEPLOY / "docker" / name)
        args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
        # Base image, torch index and wheel folder are build args with these defaults.
        assert args["BASE_IMAGE"] == "python:3.11-slim"
        assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
        assert args["WHEELS"] == "deploy/docker/wheels"
        assert "VERSION" in args
        assert {a for k, a in steps if k == "FROM"} == {"${BASE_IMAGE}", "${BASE_IMAGE} AS build"}
    cuda = (DEPLOY / "docker" / "site_agent.cuda.Dockerfile").read_text()
    assert "nvidia/cuda" in cuda and "download.pytorch.org/whl/cu" in cuda
    steps = instructions(DEPLOY / "docker" / "site_agent.cuda.Dockerfile")
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert args["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    assert args["WHEELS"] == "deploy/docker/wheels" and "VERSION" in args


# --------------------------------------------------------------------------- compose


def test_compose_services_volumes_and_sites() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert {"pki-init", "coordinator", "prometheus", "grafana"} <= set(services)
    for site in SITES:
        service = services[f"site-{site}"]
        env = service["environment"]
        assert env["MEDFED_SITE_SITE"] == site
        # The study path: each hospital's own file, read-only; no synthetic cohort.
        assert not any("SYNTHETIC" in name for name in env)
        assert env["MEDFED_SITE_DATA__PATH"] == "/data/records.csv"
        assert f"./deploy/demo/data/{site}:/data:ro" in service["volumes"]
        assert (REPO / "deploy/demo/data" / site / "records.csv").is_file()
        # Per-site key isolation: this hospital's volume only, read-only.
        assert env["MEDFED_SITE_PKI"] == "/pki"
        assert service["volumes"][0] == f"hospital-{site}:/pki:ro"
        others = {f"hospital-{o}" for o in SITES if o != site} | {"pki", "coordinator-pki"}
        assert not {v.split(":")[0] for v in service["volumes"]} & others
        assert service["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert "ports" not in service, "site agents open no published port"
        # The hospital's approval runs first, into the site's own state volume, from the
        # study the hospital received (its own volume) and the SHA-256 its officer read.
        assert service["depends_on"][f"approve-{site}"]["condition"] == (
            "service_completed_successfully")
        approve = services[f"approve-{site}"]
        assert approve["image"] == service["image"]
        assert approve["entrypoint"] == ["medfed", "site", "approve"]
        assert approve["command"] == ["/pki/study.toml", "--config", "/config/site.toml",
                                      "--yes"]
        assert approve["volumes"] == [f"hospital-{site}:/pki:ro",
                                      "./deploy/config/site.toml:/config/site.toml:ro",
                                      f"site-{site}-state:/state"]
        assert approve["network_mode"] == "none" and approve["read_only"] is True
        assert approve["depends_on"] == {
            "pki-init": {"condition": "service_completed_successfully"}}
        for job in (approve, service):
            assert job["environment"]["MEDFED_SITE_STUDY_SHA256"] == (
                "${MEDFED_STUDY_SHA256:-}")
            assert job["environment"]["MEDFED_SITE_SITE"] == site
    coordinator = services["coordinator"]
    # The coordinator runs the study: the compose config as pki-init wrote it, with the
    # hospitals it signed as [[members]] (the sites keep their default policy: no open
    # membership anywhere), into a volume of its own that holds no key.
    command = coordinator["command"]
    assert command[command.index("--study") + 1] == "/study/study.toml"
    assert "coordinator-pki:/pki:ro" in coordinator["volumes"]
    assert "coordinator-study:/study:ro" in coordinator["volumes"]
    pki_init = services["pki-init"]
    # Settings and study bind-mounted read-only (compose `configs` are ignored by
    # podman-compose and docker-compose 1.x), never a `configs` section.
    assert "./deploy/demo/study.toml:/config/study.toml:ro" in pki_init["volumes"]
    assert pki_init["environment"]["STUDY_IN"] == "/config/study.toml"
    assert "./deploy/config/coordinator.toml:/config/coordinator.toml:ro" in (
        coordinator["volumes"])
    for site in SITES:
        assert "./deploy/config/site.toml:/config/site.toml:ro" in (
            services[f"site-{site}"]["volumes"])
    assert "configs" not in compose and not any("configs" in svc for svc in services.values())
    assert pki_init["environment"]["STUDY_OUT"] == "/coordinator-study/study.toml"
    assert "coordinator-study:/coordinator-study" in pki_init["volumes"]
    # The coordinator image has no torch: model-init (the site image) writes that
    # study's untrained network beside it, seeing nothing but that volume.
    model_init = services["model-init"]
    assert model_init["image"].startswith("medfed-site-agent:")
    assert model_init["entrypoint"] == ["medfed", "model", "init"]
    assert model_init["command"] == ["--study", "/study/study.toml",
                                     "--out", "/study/initial-model.safetensors"]
    assert model_init["volumes"] == ["coordinator-study:/study"]
    assert model_init["network_mode"] == "none" and model_init["read_only"] is True
    assert model_init["depends_on"]["pki-init"]["condition"] == (
        "service_completed_successfully")
    assert coordinator["depends_on"] == {
        "model-init": {"condition": "service_completed_successfully"}}
    assert command[command.index("--initial-model") + 1] == (
        "/study/initial-model.safetensors")
    assert "OPEN_MEMBERSHIP" not in COMPOSE.read_text()
    assert "MEDFED_COORDINATOR_MODEL__INIT_FILE" not in coordinator["environment"]
    # Images are the tags `make images` builds.
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for name, service in services.items():
        image = service.get("image", "")
        if image.startswith("medfed-"):
            assert image.endswith(f":${{MEDFED_VERSION:-{version}}}"), name
            assert image.split(":")[0] in {"medfed-coordinator", "medfed-site-agent"}
    assert coordinator["ports"] == ["7443:7443"]
    # Monitoring UIs only on the host's loopback.
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    assert "${GRAFANA_ADMIN_PASSWORD:?" in COMPOSE.read_text()


def test_prometheus_scrapes_the_compose_coordinator_over_https_with_its_own_monitor() -> None:
    """The operator's Prometheus scrapes the coordinator, on its configured port, over
    HTTPS with the monitor pair pki-init writes into the volume Prometheus mounts; it
    scrapes no site agent (each hospital scrapes its own)."""
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }
    coordinator_port = tomllib.loads((DEPLOY / "config/coordinator.toml").read_text())[
        "metrics_listen"].rsplit(":", 1)[1]
    assert targets == {"medfed-coordinator": {f"coordinator:{coordinator_port}"}}
    services = load_yaml(COMPOSE)["services"]
    assert "coordinator" in services
    (job,) = config["scrape_configs"]
    assert job["scheme"] == "https"
    prometheus, pki_init = services["prometheus"], services["pki-init"]
    mounted = dict(v.split(":")[:2] for v in prometheus["volumes"])
    folder = pki_init["environment"]["PROMETHEUS_PKI_DIR"]
    assert f"prometheus-pki:{folder}" in pki_init["volumes"]
    assert "prometheus-pki:/pki:ro" in prometheus["volumes"]
    written = {"ca_file": "ca.crt", "cert_file": "prometheus.crt", "key_file": "prometheus.key"}
    for key, name in written.items():
        assert job["tls_config"][key] == f"{mounted['prometheus-pki']}/{name}"
        assert f'"$PROMETHEUS_PKI_DIR/{name}"' in BOOTSTRAP.read_text()
    # Only pki-init and Prometheus see that volume; Prometheus reads the key as a member
    # of the group the images' user (10001) writes it with (0640).
    users = {name for name, svc in services.items()
             if any(str(v).startswith("prometheus-pki:") for v in svc.get("volumes", []))}
    assert users == {"pki-init", "prometheus"}
    assert prometheus["user"].split(":")[1] == "10001"
    assert prometheus["depends_on"]["pki-init"]["condition"] == (
        "service_completed_successfully")
    assert "/prometheus-pki" in (DEPLOY / "docker/coordinator.Dockerfile").read_text()


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose not installed (.ci/scripts/install-tools.sh)")
def test_docker_compose_config_accepts_the_file() -> None:
    env = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only"}
    ok = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    # Without the Grafana password it must refuse rather than run with a default one.
    env.pop("GRAFANA_ADMIN_PASSWORD")
    refused = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr


# --------------------------------------------------------------------------- configs


def documented_fields(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            names.extend(documented_fields(annotation, f"{name}."))
        else:
            names.append(prefix + name)
    return names


@pytest.mark.parametrize(
    ("cls", "path"),
    [(CoordinatorSettings, DEPLOY / "config/coordinator.toml"),
     (SiteSettings, DEPLOY / "config/site.toml")],
    ids=["coordinator", "site"],
)
def test_example_config_validates_and_mentions_every_field(
    clean_env: None, cls: type[CoordinatorSettings | SiteSettings], path: Path
) -> None:
    settings = load_settings(cls, config_file=path, overrides={})
    # Plain-HTTP metrics on loopback unless a deployment opens them deliberately.
    assert settings.metrics_listen.startswith("127.0.0.1:")
    if isinstance(settings, CoordinatorSettings):
        # ... where the coordinator's turn to HTTPS by themselves.
        assert settings.metrics_tls == "auto"
    lines = path.read_text().splitlines()
    for dotted in documented_fields(cls):
        section, _, name = dotted.rpartition(".")
        header = f"[{section}]" if section else None
        start = lines.index(header) if header else 0
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")),
                   len(lines))
        pattern = re.compile(rf"^#? ?{re.escape(name)} = ")
        body = lines[start:end]
        hits = [i for i, line in enumerate(body) if pattern.match(line)]
        assert hits, f"{path.name}: field {dotted} is missing"
        assert body[hits[0] - 1].startswith("#"), f"{path.name}: {dotted} has no comment"


def test_environment_overrides_the_example_site_file(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker-compose.yml shares one site.toml and names each site by environment."""
    monkeypatch.setenv("MEDFED_SITE_SITE", "rural")
    monkeypatch.setenv("MEDFED_SITE_DATA__PATH", "/data/records.csv")
    settings = load_settings(SiteSettings, config_file=DEPLOY / "config/site.toml",
                             overrides={})
    assert settings.site == "rural"
    assert str(settings.data.path) == "/data/records.csv"


def test_kubernetes_config_map_validates(clean_env: None, tmp_path: Path) -> None:
    config_map = load_yaml(DEPLOY / "k8s/configmap.yaml")
    path = tmp_path / "coordinator.toml"
    path.write_text(config_map["data"]["coordinator.toml"])
    settings = load_settings(CoordinatorSettings, config_file=path, overrides={})
    assert settings.listen.endswith(":7443") and settings.metrics_listen.endswith(":9464")
    assert settings.metrics_over_tls


# --------------------------------------------------------------------------- Kubernetes


def test_kubernetes_coordinator_manifests() -> None:
    kustomization = load_yaml(DEPLOY / "k8s/kustomization.yaml")
    docs = [d for f in kustomization["resources"]
            for d in yaml.safe_load_all((DEPLOY / "k8s" / f).read_text())]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"} <= kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod["containers"] + pod.get("initContainers", []):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        if "/pki" in mounts:
            assert mounts["/pki"].get("readOnly") is True
            assert "secret" in volumes[mounts["/pki"]["name"]]
    # The model-writing init container needs no certificate at all.
    assert all(
        "/pki" not in {m["mountPath"] for m in c["volumeMounts"]}
        for c in pod.get("initContainers", [])
    )
    assert "/pki" in {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    coordinator = pod["containers"][0]
    # The coordinator image has no torch: the site image writes the study's untrained
    # network into an emptyDir that the coordinator reads, read-only.
    (model_init,) = pod["initContainers"]
    assert model_init["image"].startswith("medfed-site-agent:")
    command = model_init["command"]
    assert command[:3] == ["medfed", "model", "init"]
    assert command[command.index("--study") + 1] == "/config/study.toml"
    written = command[command.index("--out") + 1]
    args = coordinator["args"]
    assert args[args.index("--study") + 1] == "/config/study.toml"
    assert args[args.index("--initial-model") + 1] == written
    model_mount = {m["mountPath"]: m for m in coordinator["volumeMounts"]}["/model"]
    assert model_mount["readOnly"] is True and "emptyDir" in volumes[model_mount["name"]]
    assert written.startswith("/model/")
    for probe in ("readinessProbe", "livenessProbe"):
        assert "medfed-healthcheck" in " ".join(coordinator[probe]["exec"]["command"])
    assert "persistentVolumeClaim" in volumes["state"]
    assert "configMap" in volumes["config"]
    services = [d for d in docs if d["kind"] == "Service"]
    ports = {p["port"] for s in services for p in s["spec"]["ports"]}
    assert ports == {7443, 9464}
    secret_items = {i["path"] for i in volumes["tls"]["secret"]["items"]}
    assert {"ca.crt", "crl.pem", "coordinator.crt", "coordinator.key",
            "monitors/healthcheck.crt", "monitors/healthcheck.key"} == secret_items
    assert not any(d["kind"] == "Secret" for d in docs), "secrets are created out of band"


# --------------------------------------------------------------------------- identities
# The coordinator holds no site identity anywhere, its probe is a
# monitor, and the probe verifies the server against a name the certificate carries.


def _coordinator_pod() -> dict[str, Any]:
    deployment = load_yaml(DEPLOY / "k8s/deployment.yaml")
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def _env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _dockerfile_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions(path):
        if keyword == "ENV":
            env.update(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", args))
    return env


def test_no_site_identity_is_mounted_into_or_generated_for_the_coordinator() -> None:
    compose = load_yaml(COMPOSE)["services"]
    coordinator = compose["coordinator"]
    volume_names = {v.split(":")[0] for v in coordinator["volumes"] if not v.startswith("./")}
    # Neither the operator's CA folder nor the hospitals' folders.
    assert volume_names == {"coordinator-pki", "coordinator-study", "coordinator-state"}
    assert "coordinator-pki:/pki:ro" in coordinator["volumes"]
    for site in SITES:
        assert not any(v.startswith("coordinator-") for v in compose[f"site-{site}"]["volumes"])
    # The study volume holds no key: only pki-init (the study) and model-init (its
    # untrained network) write it, and model-init mounts nothing else.
    writers = {name for name, svc in compose.items()
               if any(str(v).startswith("coordinator-study:") for v in svc.get("volumes", []))}
    assert writers == {"pki-init", "model-init", "coordinator"}
    text = yaml.safe_dump(coordinator)
    assert "sites/" not in text and "/hospitals" not in text
    # The operator folder is mounted by the bootstrap only.
    mounting_pki = {name for name, svc in compose.items()
                    if any(str(v).startswith("pki:") for v in svc.get("volumes", []))}
    assert mounting_pki == {"pki-init"}
    # Kubernetes: the Secret carries no site pair, the probe env names none.
    pod = _coordinator_pod()
    tls_items = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["items"]
    assert not any(i["path"].startswith("sites/") for i in tls_items)
    assert "sites/" not in yaml.safe_dump(pod)
    assert "sites/" not in (DEPLOY / "k8s/kustomization.yaml").read_text()
    assert not any("sites/" in v for v in _dockerfile_env(
        DEPLOY / "docker/coordinator.Dockerfile").values())
    # The bootstrap makes each hospital's key at the hospital (request) and signs only
    # its CSR; it never issues a site pair, and copies no site file to the coordinator.
    script = BOOTSTRAP.read_text()
    assert "pki issue --dir" in script and "--site" not in script.split("pki issue")[1]
    assert "pki request --site" in script and "pki sign --dir" in script
    copied = re.search(r"for file in (.*?); do", script, re.S)
    assert copied is not None and "sites" not in copied.group(1)


def test_health_probes_use_a_monitor_certificate() -> None:
    compose_env = load_yaml(COMPOSE)["services"]["coordinator"]["environment"]
    k8s_env = _env_of(_coordinator_pod()["containers"][0])
    image_env = _dockerfile_env(DEPLOY / "docker/coordinator.Dockerfile")
    for env in (compose_env, k8s_env, image_env):
        assert env["MEDFED_HEALTH_CERT"] == "/pki/monitors/healthcheck.crt"
        assert env["MEDFED_HEALTH_KEY"] == "/pki/monitors/healthcheck.key"
    assert "--monitor" in BOOTSTRAP.read_text()
    assert "/pki/monitors/healthcheck.crt" in HEALTHCHECK.read_text()


def test_probe_verifies_a_name_that_is_in_the_coordinator_certificate() -> None:
    compose = load_yaml(COMPOSE)["services"]
    hosts = compose["pki-init"]["environment"]["COORDINATOR_HOSTS"].split(",")
    env = compose["coordinator"]["environment"]
    probe_host = env["MEDFED_HEALTH_TARGET"].rsplit(":", 1)[0]
    # Dialled address in the certificate, or an explicit name that is.
    assert probe_host in hosts or env["MEDFED_HEALTH_SERVER_NAME"] in hosts
    # The sites dial a name in it too.
    for site in SITES:
        dialled = compose[f"site-{site}"]["environment"]["MEDFED_SITE_COORDINATOR"]
        assert dialled.rsplit(":", 1)[0] in hosts
    # Kubernetes (certificate made elsewhere): the probe reads the mounted certificate
    # and verifies against a name in it.
    pod = _coordinator_pod()
    k8s_env = _env_of(pod["containers"][0])
    tls_items = next(v for v in pod["volumes"] if v["name"] == "tls")["secret"]["items"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")
    cert_path = next(i["path"] for i in tls_items if i["key"] == "coordinator.crt")
    assert k8s_env["MEDFED_HEALTH_SERVER_CERT"] == f"{mount['mountPath']}/{cert_path}"
    assert _dockerfile_env(DEPLOY / "docker/coordinator.Dockerfile")[
        "MEDFED_HEALTH_SERVER_CERT"] == "/pki/coordinator.crt"


def _coordinator_settings_as_shipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> dict[str, CoordinatorSettings]:
    """The coordinator's settings as each shipped deployment runs them: the example
    config with compose's environment, and the Kubernetes ConfigMap."""
    shipped = {}
    for name, value in load_yaml(COMPOSE)["services"]["coordinator"]["environment"].items():
        if name.startswith("MEDFED_COORDINATOR_"):
            monkeypatch.setenv(name, str(value))
    shipped["compose"] = load_settings(
        CoordinatorSettings, config_file=DEPLOY / "config/coordinator.toml", overrides={})
    for name in list(os.environ):
        if name.startswith("MEDFED_"):
            monkeypatch.delenv(name)
    config_map = tmp_path / "coordinator.toml"
    config_map.write_text(load_yaml(DEPLOY / "k8s/configmap.yaml")["data"]["coordinator.toml"])
    shipped["kubernetes"] = load_settings(CoordinatorSettings, config_file=config_map,
                                          overrides={})
    return shipped


def test_attack_the_shipped_coordinator_never_serves_plain_metrics_beyond_loopback(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Compose and Kubernetes open the coordinator's metrics beyond loopback, so they
    serve HTTPS to monitor certificates: no one else on those networks reads them."""
    from common.core.config import is_loopback_host, parse_host_port

    shipped = _coordinator_settings_as_shipped(monkeypatch, tmp_path)
    for where, settings in shipped.items():
        assert not is_loopback_host(parse_host_port(settings.metrics_listen)[0]), where
        assert settings.metrics_over_tls, f"{where}: plain-HTTP /metrics beyond loopback"


def test_metrics_are_opened_only_on_internal_networks() -> None:
    """Shipped configs bind loopback; where a deployment opens metrics, the port is not
    published (compose) or is limited to the monitoring namespace (Kubernetes)."""
    for name in ("coordinator", "site"):
        config = tomllib.loads((DEPLOY / f"config/{name}.toml").read_text())
        assert config["metrics_listen"].startswith("127.0.0.1:")
    compose = load_yaml(COMPOSE)["services"]
    for name, service in compose.items():
        if name.startswith("site-") or name == "coordinator":
            published = [str(p) for p in service.get("ports", [])]
            assert not any(("9464" in p or "9465" in p) for p in published), name
    policy = load_yaml(DEPLOY / "k8s/networkpolicy.yaml")
    metrics_rules = [r for r in policy["spec"]["ingress"]
                     if any(p["port"] == 9464 for p in r["ports"])]
    assert metrics_rules and all(r.get("from") for r in metrics_rules)


# --------------------------------------------------------------------------- scripts


def healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEDFED_HEALTH_")}
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.e2e
def test_bootstrap_and_healthcheck_against_a_real_coordinator(tmp_path: Path) -> None:
    venv_bin = str(Path(sys.executable).parent)
    operator, coordinator_pki, hospitals = (
        tmp_path / "pki", tmp_path / "coordinator-pki", tmp_path / "hospitals")
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "PKI_DIR": str(operator), "COORDINATOR_PKI_DIR": str(coordinator_pki),
           "HOSPITALS_DIR": str(hospitals),
           # As in docker-compose.yml: the certificate does NOT name 127.0.0.1.
           "COORDINATOR_HOSTS": "coordinator",
           "SITES": "paediatric",
           "PROMETHEUS_PKI_DIR": str(tmp_path / "prometheus-pki"),
           "STUDY_IN": str(DEPLOY / "demo/study.toml"),
           "STUDY_OUT": str(coordinator_pki / "study.toml")}
    served = []
    (tmp_path / "prometheus-pki").mkdir()  # a volume the image made (Dockerfile)
    for run in (1, 2):  # the second run must keep everything
        done = subprocess.run(["sh", str(BOOTSTRAP)], env=env, capture_output=True, text=True,
                              timeout=180, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        served.append((coordinator_pki / "study.toml").read_text())
        if run == 1:
            first_ca = (operator / "ca.crt").read_bytes()
            first_key = (hospitals / "paediatric/sites/paediatric.key").read_bytes()
            first_scraper = (tmp_path / "prometheus-pki/prometheus.crt").read_bytes()
    assert "keeping the PKI" in done.stdout
    assert (operator / "ca.crt").read_bytes() == first_ca
    assert (hospitals / "paediatric/sites/paediatric.key").read_bytes() == first_key

    def keys(folder: Path) -> set[str]:
        return {str(p.relative_to(folder)) for p in folder.rglob("*.key")}

    # The operator holds no site key; the coordinator no site identity and no CA key.
    assert keys(operator) == {"ca.key", "coordinator.key", "monitors/healthcheck.key",
                              "monitors/prometheus.key"}
    # Prometheus: the CA and its own monitor pair, the key readable by the group only.
    scraper = tmp_path / "prometheus-pki"
    assert sorted(p.name for p in scraper.iterdir()) == [
        "ca.crt", "prometheus.crt", "prometheus.key"]
    assert (scraper / "prometheus.key").stat().st_mode & 0o777 == 0o640
    assert scraper.stat().st_mode & 0o007 == 0
    assert (scraper / "ca.crt").read_bytes() == first_ca
    assert (scraper / "prometheus.crt").read_bytes() == first_scraper  # issued once
    scraper_cert = pki.load_certificate(scraper / "prometheus.crt")
    assert pki.certificate_identity(scraper_cert).role is pki.Role.MONITOR
    assert keys(coordinator_pki) == {"coordinator.key", "monitors/healthcheck.key"}
    assert not (coordinator_pki / "sites").exists()
    assert keys(hospitals) == {"paediatric/sites/paediatric.key"}
    assert (hospitals / "paediatric/sites/paediatric.crt").is_file()
    assert (hospitals / "paediatric/ca.crt").read_bytes() == first_ca
    # The served study: the shipped one with the signed hospital as its member, the same
    # bytes on every run (its SHA-256 is what the sites approve).
    study = load_study(coordinator_pki / "study.toml")
    members = pki.site_members(operator, now=dt.datetime.now(dt.UTC))
    assert {(m.name, m.fingerprint) for m in study.members} == set(members.items())
    assert served[0] == served[1]
    assert served[0].startswith((DEPLOY / "demo/study.toml").read_text())

    coordinator = ManagedProcess(
        "coordinator",
        medfed_argv("coordinator", "serve", "--config", str(DEPLOY / "config/coordinator.toml"),
                    "--pki", str(coordinator_pki), "--state", str(tmp_path / "state"),
                    "--study", str(coordinator_pki / "study.toml"),
                    "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
        log_dir=tmp_path / "logs", cwd=REPO,
        env={k: "" for k in os.environ if k.startswith("MEDFED_")},
    )
    monitor = ("--cert", str(coordinator_pki / "monitors/healthcheck.crt"),
               "--key", str(coordinator_pki / "monitors/healthcheck.key"))
    try:
        ports = coordinator.wait_event("listening", timeout=60)
        target = f"127.0.0.1:{ports['port']}"
        probe = ("--ca", str(coordinator_pki / "ca.crt"), "--target", target)
        server_cert = ("--server-cert", str(coordinator_pki / "coordinator.crt"))
        # Dials 127.0.0.1, verifies the server as "coordinator" (read from its certificate).
        healthy = healthcheck("grpc", *probe, *monitor, *server_cert)
        assert healthy.returncode == 0, healthy.stderr
        assert healthy.stdout.strip() == "healthy"
        # The former defect: verifying against the dialled 127.0.0.1 fails the handshake.
        mismatch = healthcheck("grpc", *probe, *monitor,
                               "--server-cert", str(tmp_path / "absent.crt"))
        assert mismatch.returncode == 1 and "unhealthy" in mismatch.stderr
        # The coordinator's own (serverAuth-only) certificate is refused as a client:
        # this is why the image carries a dedicated probe certificate.
        refused = healthcheck("grpc", *probe, *server_cert,
                              "--cert", str(coordinator_pki / "coordinator.crt"),
                              "--key", str(coordinator_pki / "coordinator.key"))
        assert refused.returncode == 1 and "unhealthy" in refused.stderr
        metrics_url = f"http://127.0.0.1:{ports['metrics_port']}/metrics"
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            assert response.status == 200
        assert healthcheck("http", "--url", metrics_url,
                           "--expect", "medfed_coordinator_").returncode == 0
        wrong = healthcheck("http", "--url", metrics_url, "--expect", "medfed_site_")
        assert wrong.returncode == 1 and "no medfed_site_" in wrong.stderr
    finally:
        coordinator.stop()
    gone = healthcheck("grpc", *probe, *monitor, *server_cert, "--timeout", "2")
    assert gone.returncode == 1
    # docs/deploy.md's compose revocation: revoke, then re-run the bootstrap for the CRL.
    # The served study keeps its bytes (the coordinator's state is pinned to them); the
    # revoked hospital is refused by the new CRL, not by a rewritten member list.
    crl = (coordinator_pki / "crl.pem").read_bytes()
    subprocess.run(medfed_argv("pki", "revoke", "--dir", str(operator), "--site", "paediatric"),
                   env=env, capture_output=True, text=True, timeout=120, check=True)
    again = subprocess.run(["sh", str(BOOTSTRAP)], env=env, capture_output=True, text=True,
                           timeout=180, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (coordinator_pki / "crl.pem").read_bytes() != crl
    assert (coordinator_pki / "study.toml").read_text() == served[0]


# --------------------------------------------------------------------------- demo study


def test_demo_study_and_each_hospital_file_match() -> None:
    """The study compose and Kubernetes run, and each demo hospital's file passes the
    same check a site makes before sending anything."""
    from common.study import load_study
    from site_agent.data import load_study_table

    study = load_study(DEPLOY / "demo/study.toml")
    config_map = load_yaml(DEPLOY / "k8s/configmap.yaml")
    assert config_map["data"]["study.toml"] == (DEPLOY / "demo/study.toml").read_text()
    patients: set[str] = set()
    for site in SITES:
        table = load_study_table(DEPLOY / "demo/data" / site / "records.csv", study)
        assert len(table.rows) == 600 and table.patient_ids is not None
        ids = set(table.patient_ids.tolist())
        assert not ids & patients, "hospitals share no patient"
        patients |= ids
