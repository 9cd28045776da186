"""Deployment files (issue 5, section 4): containers, compose, Kubernetes, example configs.

There is no Docker engine on the test machines, so images are not built here; what can
be checked without one is: every YAML parses, `docker-compose config` accepts the
compose file, the Dockerfiles keep their security basics, the example configs validate
with the real settings models, and the health-check script and the bootstrap script
work against a real coordinator process.
"""

from __future__ import annotations

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

from common.config import CoordinatorSettings, SiteSettings, load_settings
from common.processes import ManagedProcess, medfed_argv
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
    # torch pinned (never a silent upgrade) and installed from an explicit index.
    assert re.search(r"torch==2\.13\.0 --index-url ", path.read_text())


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
        text = (DEPLOY / "docker" / name).read_text()
        assert {a for k, a in instructions(DEPLOY / "docker" / name) if k == "FROM"} >= {
            "python:3.11-slim"
        }
        assert "https://download.pytorch.org/whl/cpu" in text
    cuda = (DEPLOY / "docker" / "site_agent.cuda.Dockerfile").read_text()
    assert "nvidia/cuda" in cuda and "download.pytorch.org/whl/cu" in cuda


# --------------------------------------------------------------------------- compose


def test_compose_services_volumes_and_sites() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert {"pki-init", "coordinator", "prometheus", "grafana"} <= set(services)
    for site in SITES:
        service = services[f"site-{site}"]
        env = service["environment"]
        assert env["MEDFED_SITE_SITE"] == site
        assert int(env["MEDFED_SITE_DATA__SYNTHETIC_COHORT_SEED"]) >= 0
        assert any(v.endswith(":/pki:ro") for v in service["volumes"])
        assert service["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert "ports" not in service, "site agents open no published port"
    coordinator = services["coordinator"]
    assert coordinator["depends_on"]["pki-init"]["condition"] == (
        "service_completed_successfully"
    )
    assert coordinator["ports"] == ["7443:7443"]
    # Monitoring UIs only on the host's loopback.
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    assert "${GRAFANA_ADMIN_PASSWORD:?" in COMPOSE.read_text()


def test_prometheus_scrapes_the_compose_services_on_their_configured_ports() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in config["scrape_configs"]
    }
    coordinator_port = tomllib.loads((DEPLOY / "config/coordinator.toml").read_text())[
        "metrics_listen"].rsplit(":", 1)[1]
    site_port = tomllib.loads((DEPLOY / "config/site.toml").read_text())[
        "metrics_listen"].rsplit(":", 1)[1]
    assert targets["medfed-coordinator"] == {f"coordinator:{coordinator_port}"}
    assert targets["medfed-sites"] == {f"site-{s}:{site_port}" for s in SITES}
    assert set(load_yaml(COMPOSE)["services"]) >= {
        t.split(":")[0] for ts in targets.values() for t in ts
    }


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
    assert settings.metrics_listen.startswith("0.0.0.0:")  # reachable by Prometheus
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
    monkeypatch.setenv("MEDFED_SITE_DATA__SYNTHETIC_COHORT_SEED", "7")
    settings = load_settings(SiteSettings, config_file=DEPLOY / "config/site.toml",
                             overrides={})
    assert settings.site == "rural"
    assert settings.data.synthetic_cohort_seed == 7


def test_kubernetes_config_map_validates(clean_env: None, tmp_path: Path) -> None:
    config_map = load_yaml(DEPLOY / "k8s/configmap.yaml")
    path = tmp_path / "coordinator.toml"
    path.write_text(config_map["data"]["coordinator.toml"])
    settings = load_settings(CoordinatorSettings, config_file=path, overrides={})
    assert settings.listen.endswith(":7443") and settings.metrics_listen.endswith(":9464")


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
        assert mounts["/pki"].get("readOnly") is True
        assert "secret" in volumes[mounts["/pki"]["name"]]
    coordinator = pod["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert "medfed-healthcheck" in " ".join(coordinator[probe]["exec"]["command"])
    assert "persistentVolumeClaim" in volumes["state"]
    assert "configMap" in volumes["config"]
    services = [d for d in docs if d["kind"] == "Service"]
    ports = {p["port"] for s in services for p in s["spec"]["ports"]}
    assert ports == {7443, 9464}
    secret_items = {i["path"] for i in volumes["tls"]["secret"]["items"]}
    assert {"ca.crt", "crl.pem", "coordinator.crt", "coordinator.key",
            "sites/healthcheck.crt", "sites/healthcheck.key"} == secret_items
    assert not any(d["kind"] == "Secret" for d in docs), "secrets are created out of band"


# --------------------------------------------------------------------------- scripts


def healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEDFED_HEALTH_")}
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.e2e
def test_bootstrap_and_healthcheck_against_a_real_coordinator(tmp_path: Path) -> None:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "PKI_DIR": str(tmp_path / "pki"), "COORDINATOR_HOSTS": "127.0.0.1,localhost",
           "SITES": "paediatric", "MODEL_FILE": str(tmp_path / "state/initial-model.mfm")}
    for run in (1, 2):  # the second run must keep everything
        done = subprocess.run(["sh", str(BOOTSTRAP)], env=env, capture_output=True, text=True,
                              timeout=180, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        if run == 1:
            first_ca = (tmp_path / "pki/ca.crt").read_bytes()
            first_model = (tmp_path / "state/initial-model.mfm").read_bytes()
    assert "keeping the PKI" in done.stdout
    assert (tmp_path / "pki/ca.crt").read_bytes() == first_ca
    assert (tmp_path / "state/initial-model.mfm").read_bytes() == first_model
    pki = tmp_path / "pki"
    assert (pki / "sites/healthcheck.crt").is_file() and (pki / "sites/paediatric.key").is_file()

    coordinator = ManagedProcess(
        "coordinator",
        medfed_argv("coordinator", "serve", "--config", str(DEPLOY / "config/coordinator.toml"),
                    "--pki", str(pki), "--state", str(tmp_path / "state"),
                    "--model-init", str(tmp_path / "state/initial-model.mfm"),
                    "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"),
        log_dir=tmp_path / "logs", cwd=REPO,
        env={k: "" for k in os.environ if k.startswith("MEDFED_")},
    )
    try:
        ports = coordinator.wait_event("listening", timeout=60)
        target = f"127.0.0.1:{ports['port']}"
        probe = ("--ca", str(pki / "ca.crt"), "--target", target)
        healthy = healthcheck("grpc", *probe, "--cert", str(pki / "sites/healthcheck.crt"),
                              "--key", str(pki / "sites/healthcheck.key"))
        assert healthy.returncode == 0, healthy.stderr
        assert healthy.stdout.strip() == "healthy"
        # The coordinator's own (serverAuth-only) certificate is refused as a client:
        # this is why the image carries a dedicated probe certificate.
        refused = healthcheck("grpc", *probe, "--cert", str(pki / "coordinator.crt"),
                              "--key", str(pki / "coordinator.key"))
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
    gone = healthcheck("grpc", *probe, "--cert", str(pki / "sites/healthcheck.crt"),
                       "--key", str(pki / "sites/healthcheck.key"), "--timeout", "2")
    assert gone.returncode == 1
