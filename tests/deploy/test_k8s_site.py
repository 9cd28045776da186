"""A hospital's site agent on Kubernetes (deploy/k8s/site): a kustomize base and an
example overlay. The base's manifests pass `kubernetes-validate --strict`; the tests
below check what the hospital's security officer relies on: only its own pair in the
Secret, data mounted read-only, egress only to DNS and the coordinator, the metrics
port for its own Prometheus, and settings that load."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.core.config import SiteSettings, load_settings
from tests.e2e.harness import REPO

SITE = REPO / "deploy" / "k8s" / "site"
BASE = SITE / "base"
OVERLAY = SITE / "overlays" / "example"


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_objects() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = load(BASE / "kustomization.yaml")[0]
    objects = {}
    for name in kustomization["resources"]:
        for doc in load(BASE / name):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _validator() -> list[str] | None:
    found = shutil.which("kubernetes-validate")
    if found:
        return [found]
    probe = subprocess.run([sys.executable, "-c", "import kubernetes_validate"],
                           capture_output=True, timeout=60)
    return [sys.executable, "-m", "kubernetes_validate"] if probe.returncode == 0 else None


def test_manifests_pass_kubernetes_validate_strict() -> None:
    validator = _validator()
    if validator is None:
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate)")
    kustomization = load(BASE / "kustomization.yaml")[0]
    coordinator = load(REPO / "deploy/k8s/kustomization.yaml")[0]
    files = [str(BASE / name) for name in kustomization["resources"]]
    files += [str(REPO / "deploy/k8s" / name) for name in coordinator["resources"]]
    done = subprocess.run([*validator, "--strict", *files], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") >= len(files)


def test_the_set_is_complete() -> None:
    kinds = {kind for kind, _ in base_objects()}
    assert {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
            "NetworkPolicy"} <= kinds
    # The Secret is made by the hospital from its own files, never committed.
    assert "Secret" not in kinds


def test_pod_mounts_only_its_own_pair_and_its_data_read_only() -> None:
    objects = base_objects()
    deployment = objects[("Deployment", "medfed-site-agent")]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"]
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in ("/pki", "/data", "/config"):
        assert mounts[path].get("readOnly") is True, path
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert "persistentVolumeClaim" in volumes[mounts["/state"]["name"]]
    secret = volumes[mounts["/pki"]["name"]]["secret"]
    assert {i["key"] for i in secret["items"]} == {"ca.crt", "site.crt", "site.key"}
    assert secret["defaultMode"] == 0o440
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"][-2:] == [
            "/usr/local/bin/medfed-healthcheck", "http"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9465}]
    service = objects[("Service", "medfed-site-agent-metrics")]
    assert [p["port"] for p in service["spec"]["ports"]] == [9465]


def test_network_policy_allows_egress_only_to_dns_and_the_coordinator() -> None:
    policy = base_objects()[("NetworkPolicy", "medfed-site-agent")]["spec"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    egress = policy["egress"]
    assert len(egress) == 2
    dns, coordinator = egress
    assert {p["port"] for p in dns["ports"]} == {53}
    assert dns["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    assert [p["port"] for p in coordinator["ports"]] == [7443]
    assert coordinator["to"][0]["ipBlock"]["cidr"].endswith("/32")
    # Inbound: the metrics port, from the monitoring namespace only.
    (ingress,) = policy["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [9465] and ingress["from"]


def test_overlay_patches_what_the_base_has() -> None:
    overlay = load(OVERLAY / "kustomization.yaml")[0]
    assert overlay["resources"] == ["../../base"]
    objects = base_objects()
    deployment = objects[("Deployment", "medfed-site-agent")]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert {i["name"] for i in overlay["images"]} == {image.split(":")[0]}
    for patch in overlay["patches"]:
        if "path" in patch:
            (doc,) = load(OVERLAY / patch["path"])
            assert (doc["kind"], doc["metadata"]["name"]) in objects
            pod = doc["spec"]["template"]["spec"]
            for container in (*pod["containers"], *pod["initContainers"]):
                env = {e["name"]: e["value"] for e in container["env"]}
                assert env["MEDFED_SITE_SITE"] != "SITE_ID"
                assert re.fullmatch(r"[0-9a-f]{64}", env["MEDFED_SITE_STUDY_SHA256"])
        else:
            target = objects[(patch["target"]["kind"], patch["target"]["name"])]
            (operation,) = yaml.safe_load(patch["patch"])
            node: Any = target
            for step in operation["path"].strip("/").split("/"):
                node = node[int(step)] if isinstance(node, list) else node[step]
            assert isinstance(node, str) and operation["value"].endswith("/32")


def test_site_settings_in_the_config_map_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("MEDFED_"):
            monkeypatch.delenv(name)
    config = base_objects()[("ConfigMap", "medfed-site-config")]
    path = tmp_path / "site.toml"
    path.write_text(config["data"]["site.toml"])
    (doc,) = load(OVERLAY / "site.yaml")
    for item in doc["spec"]["template"]["spec"]["containers"][0]["env"]:
        monkeypatch.setenv(item["name"], item["value"])
    settings = load_settings(SiteSettings, config_file=path, overrides={})
    assert settings.site == "st-marys"
    assert settings.study_sha256 is not None
    assert settings.coordinator == "fl.example.org:7443"
    assert settings.metrics_listen.endswith(":9465")
    assert (settings.tls_ca, settings.tls_cert, settings.tls_key) == (
        Path("/pki/ca.crt"), Path("/pki/site.crt"), Path("/pki/site.key"))
    assert str(settings.data.path) == "/data/records.csv"


# ----------------------------------------------------------------- docs/deploy.md's walk


def _kubectl_steps(section: str) -> list[list[str]]:
    """The kubectl commands of a docs section's shell blocks, in order."""
    steps = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:1] == ["kubectl"]:
                steps.append(words)
    return steps


def _secret_volume(deployment: dict[str, Any]) -> dict[str, Any]:
    (secret,) = [v["secret"] for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if "secret" in v]
    return secret


def _check_walk(steps: list[list[str]], *, namespace: str, secret: dict[str, Any],
                applied: Path) -> None:
    kinds = []
    for words in steps:
        if words[1:3] == ["create", "namespace"]:
            assert words[3] == namespace
            kinds.append("namespace")
        elif words[1] == "apply" and "-f" in words:
            (doc,) = load(REPO / words[words.index("-f") + 1])
            assert doc["kind"] == "Namespace" and doc["metadata"]["name"] == namespace
            kinds.append("namespace")
        elif "secret" in words and "create" in words:
            assert words[words.index("-n") + 1] == namespace
            assert words[words.index("generic") + 1] == secret["secretName"]
            keys = {w.split("=", 2)[1] for w in words if w.startswith("--from-file=")}
            assert keys == {i["key"] for i in secret["items"]}
            kinds.append("secret")
        elif "configmap" in words and "create" in words:
            assert words[words.index("-n") + 1] == namespace
            assert words[words.index("configmap") + 1] == "medfed-site-study"
            assert [w.split("=")[1] for w in words if w.startswith("--from-file=")] == [
                "study.toml"]
            kinds.append("study")
        elif words[1] == "apply" and "-k" in words:
            assert (REPO / words[words.index("-k") + 1]).resolve() == applied.resolve()
            kinds.append("apply")
    # The Secret needs its namespace; the pods need their Secret (and a site's, its study).
    assert kinds in (["namespace", "secret", "apply"],
                     ["namespace", "secret", "study", "apply"]), kinds


def test_deploy_md_walks_the_site_set_in_order() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text.split("### A site on Kubernetes", 1)[1].split("\n#", 1)[0]
    overlay = load(OVERLAY / "kustomization.yaml")[0]
    deployment = base_objects()[("Deployment", "medfed-site-agent")]
    steps = _kubectl_steps(section)
    assert any("configmap" in words for words in steps), "the study's ConfigMap"
    _check_walk(steps, namespace=overlay["namespace"],
                secret=_secret_volume(deployment), applied=OVERLAY)


def test_deploy_md_walks_the_coordinator_set_in_order() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    section = text.split("- Kubernetes (coordinator):", 1)[1].split("\n- ", 1)[0]
    coordinator = REPO / "deploy" / "k8s"
    kustomization = load(coordinator / "kustomization.yaml")[0]
    (deployment,) = [d for name in kustomization["resources"]
                     for d in load(coordinator / name) if d["kind"] == "Deployment"]
    _check_walk(_kubectl_steps(section), namespace=kustomization["namespace"],
                secret=_secret_volume(deployment), applied=coordinator)


# ------------------------------------------------------------- the rendered overlay
# No kustomize binary on the test machines: a renderer for exactly the kustomization
# fields the shipped sets use (anything else fails the test rather than being skipped),
# so that the objects a cluster receives from `kubectl apply -k` are what is validated.

KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches",
                    "labels"}


def _merge(target: Any, patch: Any) -> Any:
    """Strategic merge as kustomize does it for these objects: maps merge, lists of
    named items merge by name, anything else is replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        for key, value in patch.items():
            target[key] = _merge(target[key], value) if key in target else value
        return target
    if (isinstance(target, list) and isinstance(patch, list)
            and all(isinstance(i, dict) and "name" in i for i in [*target, *patch])):
        by_name = {item["name"]: item for item in target}
        for item in patch:
            if item["name"] in by_name:
                _merge(by_name[item["name"]], item)
            else:
                target.append(item)
        return target
    return patch


def _pod_containers(doc: dict[str, Any], *, init: bool = False) -> list[dict[str, Any]]:
    if doc["kind"] != "Deployment":
        return []
    pod = doc["spec"]["template"]["spec"]
    containers: list[dict[str, Any]] = pod["containers"]
    return [*pod.get("initContainers", []), *containers] if init else containers


def render(folder: Path) -> list[dict[str, Any]]:
    kustomization = load(folder / "kustomization.yaml")[0]
    unknown = set(kustomization) - KUSTOMIZE_FIELDS
    assert not unknown, f"{folder}: the test's renderer does not know {sorted(unknown)}"
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        path = folder / resource
        docs += render(path) if path.is_dir() else load(path)

    def target(kind: str, name: str) -> dict[str, Any]:
        (found,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (kind, name)]
        return found

    for label in kustomization.get("labels", []):
        assert set(label) == {"pairs"}, label
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = namespace
            else:
                doc["metadata"]["namespace"] = namespace
    for image in kustomization.get("images", []):
        assert set(image) <= {"name", "newTag"}, image
        for doc in docs:
            for container in _pod_containers(doc, init=True):
                if container["image"].split(":")[0] == image["name"]:
                    container["image"] = f"{image['name']}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            (doc,) = load(folder / patch["path"])
            _merge(target(doc["kind"], doc["metadata"]["name"]), doc)
            continue
        assert set(patch) == {"target", "patch"}, patch
        node: Any = target(patch["target"]["kind"], patch["target"]["name"])
        for operation in yaml.safe_load(patch["patch"]):
            assert operation["op"] == "replace", operation
            *parents, last = operation["path"].strip("/").split("/")
            for step in parents:
                node = node[int(step)] if isinstance(node, list) else node[step]
            key: Any = int(last) if isinstance(node, list) else last
            assert key in node if isinstance(node, dict) else key < len(node), operation
            node[key] = operation["value"]
    return docs


def test_the_rendered_sets_pass_kubernetes_validate_strict(tmp_path: Path) -> None:
    validator = _validator()
    if validator is None:
        pytest.skip("kubernetes-validate not installed (pip install kubernetes-validate)")
    files = []
    for name, folder in (("site", OVERLAY), ("coordinator", REPO / "deploy/k8s")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(render(folder), sort_keys=False))
        files.append(str(path))
    done = subprocess.run([*validator, "--strict", *files], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") >= 12, done.stdout


def test_the_rendered_overlay_is_the_example_hospital() -> None:
    docs = render(OVERLAY)
    overlay = load(OVERLAY / "kustomization.yaml")[0]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
        overlay["namespace"]}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == [
        overlay["namespace"]]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = _pod_containers(deployment)
    approve, agent = _pod_containers(deployment, init=True)
    assert agent is container and approve["name"] == "approve-study"
    hashes = set()
    for each in (approve, agent):
        names = [e["name"] for e in each["env"]]
        assert len(names) == len(set(names)), names  # merged by name, not appended
        env = {e["name"]: e["value"] for e in each["env"]}
        assert env["MEDFED_SITE_SITE"] == "st-marys"
        assert env["MEDFED_SITE_COORDINATOR"] == "fl.example.org:7443"
        hashes.add(env["MEDFED_SITE_STUDY_SHA256"])
        assert each["image"] == "medfed-site-agent:" + overlay["images"][0]["newTag"]
    # The approval and the agent check one hash: the study the officer approved.
    (approved,) = hashes
    assert re.fullmatch(r"[0-9a-f]{64}", approved)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "OMP_NUM_THREADS" in env  # the base's entries survive the patch
    # The approval pins the study it was handed, into the agent's own state volume.
    assert approve["command"] == ["medfed", "site", "approve", "/study/study.toml",
                                  "--config", "/config/site.toml", "--yes"]
    mounts = {m["mountPath"]: m["name"] for m in approve["volumeMounts"]}
    agent_mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert mounts["/state"] == agent_mounts["/state"] and mounts["/config"] == (
        agent_mounts["/config"])
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/study"]]["configMap"]["name"] == "medfed-site-study"
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    cidrs = [peer["ipBlock"]["cidr"] for rule in policy["spec"]["egress"]
             for peer in rule["to"] if "ipBlock" in peer]
    assert cidrs == ["203.0.113.7/32"]
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "medfed" for d in docs)
