"""A coordinator serves a study the hospital never approved, against a victim started
exactly as the README, docker-compose.yml and the Kubernetes site kit start it.

The coordinator is the deviating double of tests/e2e/malicious_coordinator.py: real
mTLS with the federation's coordinator certificate, holding the CA (it mints site
certificates at will). The hospital's privacy officer approved the consortium's study
(the victim and two hospitals that made their keys at home, listed by key) the way each
kit does it: the README's `medfed site approve study.toml --state ... --yes`, compose's
approve-SITE job, the Kubernetes init container `approve-study` with the SHA-256 the
officer read out. The victim's agent is then started with that kit's own command line,
environment and settings file, container paths mapped to folders here (as the mounts
map them). The double then serves, instead of the approved study:

* minted sybils: the same terms, listing the victim next to two certificates the CA
  holder minted (whose inputs and secrets it knows: the sum would give the victim's
  exact update away);
* a substituted study: the approved study's name and members, other training terms;
* a coordinator-written one-round study: the whole budget in a single round.

Each study passes the victim's privacy policy, so without the approval gate the victim
would take part (the double would run the round). With it, the victim sends nothing
after Enroll (no poll for a round, no key, no statistics, no update) and says, in one
line, which study it was served and how to approve. A victim that approved nothing (the
kits before they carried an approval) joins nothing, even the consortium's own study.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from common.commands.study import render_study_toml
from common.core.processes import ManagedProcess, medfed_argv
from common.crypto.random import system_random
from common.protocol import pki
from common.study import Study, study_bytes, study_sha256
from demo.study import exact_statistics, synthetic_demo_study
from site_agent.data import load_study_table
from site_agent.synthetic import generate_cohort, write_site_csvs
from tests.deploy.test_k8s_site import OVERLAY, render
from tests.e2e.harness import PROCESS_ENV, REPO, Readme
from tests.e2e.malicious_coordinator import MaliciousCoordinator, make_story
from tests.e2e.test_malicious_coordinator import final_bundle, model, with_members

pytestmark = pytest.mark.e2e

APPROVED_TERMS = synthetic_demo_study(
    name="sepsis-consortium", rounds=3, epsilon=8.0, delta=1e-5, histogram_bins=10,
    local_epochs=1, learning_rate=0.5, batch_size=64)
"""Terms every kit's default site policy accepts (epsilon 8, delta 1e-5, its round
floor): a refusal below is the approval's, not the policy's."""

VICTIM = {"readme": "st-marys", "compose": "paediatric", "k8s": "st-marys"}
SYBILS = ("sybil1", "sybil2")
ATTACKS = ("minted-sybils", "substituted-study", "one-round-study")


@dataclass(frozen=True)
class Hospital:
    """What the victim hospital holds: its key pair (made at home), the CA certificate,
    its records, and the consortium's study as it received it."""

    kit: str
    site: str
    root: Path
    pki_dir: Path  # the operator's CA folder, which the deviating coordinator holds
    key: Path
    cert: Path
    data: Path
    approved: Study

    @property
    def state(self) -> Path:
        return self.root / "state"


def attack_study(attack: str, hospital: Hospital) -> Study:
    """The study the CA-holding coordinator serves instead of the approved one."""
    approved = hospital.approved
    if attack == "minted-sybils":
        fingerprints = {
            name: pki.public_key_fingerprint(pki.load_certificate(
                pki.site_paths(hospital.pki_dir, name)[0]))
            for name in (hospital.site, *SYBILS)}
        return with_members(APPROVED_TERMS, fingerprints)
    if attack == "substituted-study":
        data = approved.model_dump(mode="json")
        data["training"] = {**data["training"], "learning_rate": 2.0, "local_epochs": 3}
        return Study.model_validate(data)
    data = approved.model_dump(mode="json")
    data["study"] = {**data["study"], "rounds": 1}
    data["training"] = {**data["training"], "final_evaluation": False}
    return Study.model_validate(data)


def make_hospital(kit: str, root: Path) -> Hospital:
    """The operator's CA, the victim's key made at home (`pki request`, signed by the
    operator), two more members that made theirs at home, the consortium's study listing
    the three by key, and two site certificates the CA holder minted for itself."""
    site = VICTIM[kit]
    pki_dir = root / "pki"
    pki.init_ca(pki_dir)
    pki.issue_coordinator(pki_dir, ["127.0.0.1", "localhost"])
    fingerprints = {}
    for name in (site, "county", "riverside"):
        request = pki.request_certificate(root / "keys" / name, name)
        pki.sign_request(pki_dir, request.csr_path)
        csr, _ = pki.load_request(request.csr_path)
        fingerprints[name] = pki.public_key_fingerprint(csr)
    for sybil in SYBILS:
        pki.issue_site(pki_dir, sybil)  # what a CA holder can always mint
    cohort = generate_cohort([site], seed=5, patients_per_site=160)
    data = write_site_csvs(root / "data", cohort)[site]
    return Hospital(kit=kit, site=site, root=root, pki_dir=pki_dir,
                    key=root / "keys" / site / f"{site}.key",
                    cert=pki.site_paths(pki_dir, site)[0], data=data,
                    approved=with_members(APPROVED_TERMS, fingerprints))


# ----------------------------------------------------------- the victim, as each kit starts it


Started = tuple[ManagedProcess, Path]
"""The victim's agent and its state folder."""


def start_readme(hospital: Hospital, address: str, *, approve: bool) -> Started:
    """The README's `approve` and `site run` blocks as written (paths, port and names
    substituted as tests/e2e/test_readme.py does)."""
    (hospital.root / "readme").mkdir()
    readme = Readme(hospital.root / "readme")
    readme.port = int(address.rsplit(":", 1)[1])
    (readme.root / "pki" / "sites").mkdir(parents=True)
    shutil.copy(hospital.pki_dir / "ca.crt", readme.root / "pki" / "ca.crt")
    shutil.copy(hospital.cert, readme.root / "pki" / "sites" / f"{hospital.site}.crt")
    shutil.copytree(hospital.key.parent, readme.root / hospital.site)
    shutil.copy(hospital.data, readme.root / f"{hospital.site}.csv")
    (readme.root / "study.toml").write_text(render_study_toml(hospital.approved))
    if approve:
        readme.run(readme.command("approve", hospital.site))
    proc = readme.start(hospital.site, readme.command("site", hospital.site))
    return proc, readme.root / "state" / hospital.site


def _mapped(value: str, mounts: dict[str, Path]) -> str:
    """A container path in a command line or setting, as the mount maps it here."""
    for inside, outside in sorted(mounts.items(), key=lambda m: -len(m[0])):
        if value == inside or value.startswith(inside + "/"):
            return str(outside) + value[len(inside):]
    return value


def _compose_env(service: dict[str, Any], address: str, mounts: dict[str, Path]) -> dict[str, str]:
    env = {}
    for name, value in service["environment"].items():
        value = str(value).replace("${MEDFED_STUDY_SHA256:-}", "")  # unset, as in the demo
        env[name] = _mapped(value, mounts)
    env["MEDFED_SITE_COORDINATOR"] = address
    env["MEDFED_SITE_METRICS_LISTEN"] = "127.0.0.1:0"
    # site.toml's `state = "/state"`: the state volume, mounted here.
    env["MEDFED_SITE_STATE"] = str(mounts["/state"])
    return env


def data_volume(hospital: Hospital) -> Path:
    """The hospital's data volume, holding its records as both kits name them."""
    volume = hospital.root / "data-volume"
    volume.mkdir()
    shutil.copy(hospital.data, volume / "records.csv")
    return volume


def start_compose(hospital: Hospital, address: str, *, approve: bool) -> Started:
    """docker-compose.yml's approve-SITE job, then its site-SITE service: their
    entrypoints, commands and environments, deploy/config/site.toml as mounted, the
    hospital's volume laid out as pki-init leaves it (ca.crt, sites/SITE.crt/.key, the
    study it received as study.toml)."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    volume = hospital.root / "hospital"
    (volume / "sites").mkdir(parents=True)
    shutil.copy(hospital.pki_dir / "ca.crt", volume / "ca.crt")
    shutil.copy(hospital.cert, volume / "sites" / f"{hospital.site}.crt")
    shutil.copy(hospital.key, volume / "sites" / f"{hospital.site}.key")
    (volume / "study.toml").write_text(render_study_toml(hospital.approved))
    mounts = {"/pki": volume, "/config/site.toml": REPO / "deploy/config/site.toml",
              "/state": hospital.state, "/data": data_volume(hospital)}
    env = {**PROCESS_ENV, **os.environ}
    env = {k: v for k, v in env.items() if not k.startswith("MEDFED_")}
    if approve:
        job = services[f"approve-{hospital.site}"]
        argv = [_mapped(word, mounts) for word in job["entrypoint"][1:] + job["command"]]
        done = _run(medfed_argv(*argv), env={**env, **_compose_env(job, address, mounts)})
        assert done.returncode == 0, done.stderr
    service = services[f"site-{hospital.site}"]
    # The image's ENTRYPOINT is `medfed site run`; compose gives its command.
    argv = ["site", "run", *(_mapped(word, mounts) for word in service["command"])]
    proc = ManagedProcess(hospital.site, medfed_argv(*argv),
                          env={**env, **_compose_env(service, address, mounts)},
                          log_dir=hospital.root / "logs", cwd=REPO)
    return proc, hospital.state


def start_k8s(hospital: Hospital, address: str, *, approve: bool) -> Started:
    """The rendered example overlay (deploy/k8s/site): the init container
    `approve-study`, then the `site-agent` container, each with its command and
    environment, the ConfigMap's site.toml, the Secret's three files and the study's
    ConfigMap mounted where the pod mounts them; the overlay's study SHA-256 set to the
    one the privacy officer read out (the approved study's)."""
    docs = render(OVERLAY)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"] == "medfed-site-config"]
    pod = deployment["spec"]["template"]["spec"]
    tls = hospital.root / "tls"
    tls.mkdir()
    shutil.copy(hospital.pki_dir / "ca.crt", tls / "ca.crt")
    shutil.copy(hospital.cert, tls / "site.crt")
    shutil.copy(hospital.key, tls / "site.key")
    study = hospital.root / "study-configmap"
    study.mkdir()
    (study / "study.toml").write_text(render_study_toml(hospital.approved))
    settings = hospital.root / "config"
    settings.mkdir()
    mounts = {"/pki": tls, "/config": settings, "/study": study, "/state": hospital.state,
              "/data": data_volume(hospital)}
    text = config["data"]["site.toml"]
    for inside in ("/pki", "/state", "/data"):
        text = text.replace(f'"{inside}', f'"{mounts[inside]}')
    text = text.replace('metrics_listen = "0.0.0.0:9465"', 'metrics_listen = "127.0.0.1:0"')
    (settings / "site.toml").write_text(text)
    base = {k: v for k, v in {**PROCESS_ENV, **os.environ}.items()
            if not k.startswith("MEDFED_")}

    def container_env(container: dict[str, Any]) -> dict[str, str]:
        env = {e["name"]: _mapped(str(e["value"]), mounts) for e in container["env"]}
        env["MEDFED_SITE_SITE"] = hospital.site
        env["MEDFED_SITE_COORDINATOR"] = address
        # What the officer read out and the hospital set in its overlay.
        env["MEDFED_SITE_STUDY_SHA256"] = study_sha256(hospital.approved)
        return env

    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    if approve:
        argv = [_mapped(word, mounts) for word in init["command"]]
        assert argv[0] == "medfed"
        done = _run(medfed_argv(*argv[1:]), env={**base, **container_env(init)})
        assert done.returncode == 0, done.stderr
    proc = ManagedProcess(
        hospital.site,
        medfed_argv("site", "run", *(_mapped(word, mounts) for word in agent["args"])),
        env={**base, **container_env(agent)}, log_dir=hospital.root / "logs", cwd=REPO)
    return proc, hospital.state


def _run(argv: list[str], *, env: dict[str, str]) -> Any:
    import subprocess

    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


START: dict[str, Callable[..., Started]] = {
    "readme": start_readme, "compose": start_compose, "k8s": start_k8s}


# ------------------------------------------------------------------------ the attacks


@pytest.fixture
def victims(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for proc in started:
        proc.stop()


def serve(hospital: Hospital, study: Study, participants: list[str],
          puppets: list[str]) -> MaliciousCoordinator:
    """The double serving `study` at enrolment, ready to run its round 1 (the victim with
    `puppets`, sites whose keys and inputs it holds) for a victim that joins."""
    tables = {hospital.site: load_study_table(hospital.data, study)}
    statistics = exact_statistics(tables, study, seed=0)
    layout, flat = model(7)
    story = make_story(participants=participants, layout=layout, flat=flat,
                       nonce=system_random(16), threshold=len(participants), study=study,
                       statistics=statistics)
    final = final_bundle(study, statistics, pki_dir=hospital.pki_dir,
                         state=hospital.root / "coordinator")
    return MaliciousCoordinator(hospital.pki_dir, stories={hospital.site: story},
                                server_story=story, puppets=puppets, study=study,
                                final_model=final)


def refused_at_enrolment(proc: ManagedProcess, double: MaliciousCoordinator, site: str,
                         served: Study) -> str:
    """The victim's one-line refusal; it sent nothing after Enroll. `--once` (the
    README's) exits 2; a long-running agent (the kits') says it and waits."""
    line = proc.wait_event("study_not_approved", timeout=300)
    message = str(line["msg"])
    assert f"sha256 {study_sha256(served)}" in message, message
    assert "medfed site approve" in message, message
    assert set(double.record.methods_of(site)) == {"Enroll"}, double.record.calls
    assert site not in double.record.masked
    return message


@pytest.mark.parametrize("kit", sorted(START))
@pytest.mark.parametrize("attack", ATTACKS)
def test_attack_coordinator_serves_a_study_the_hospital_did_not_approve(
    kit: str, attack: str, tmp_path: Path, victims: list[ManagedProcess]
) -> None:
    """minted sybils / a substituted study / a coordinator-written one-round study, each
    refused at enrolment by a victim approved and started as `kit` ships it."""
    hospital = make_hospital(kit, tmp_path)
    served = attack_study(attack, hospital)
    assert study_sha256(served) != study_sha256(hospital.approved)
    participants = [hospital.site, *SYBILS]
    with serve(hospital, served, participants, list(SYBILS)) as double:
        proc, state = START[kit](hospital, double.address, approve=True)
        victims.append(proc)
        message = refused_at_enrolment(proc, double, hospital.site, served)
        assert f"not the study this site approved, {hospital.approved.study.name!r} " \
               f"(sha256 {study_sha256(hospital.approved)})" in message
        if kit == "readme":
            assert proc.wait_exit(120) == 2, proc.tail()
    pinned = state / "approved" / "study.json"
    assert pinned.read_bytes() == study_bytes(hospital.approved)
    # Nothing was spent for the served study: no ledger was even opened.
    assert not (state / "privacy-ledger.db").exists()


@pytest.mark.parametrize("kit", ["compose", "k8s"])
def test_attack_site_started_without_approval_joins_nothing(
    kit: str, tmp_path: Path, victims: list[ManagedProcess]
) -> None:
    """The kits as they shipped before their approval step: the agent started with no
    pin joins no study, not even the consortium's own, and says how to approve."""
    hospital = make_hospital(kit, tmp_path)
    served = hospital.approved
    if kit == "k8s":
        # The agent's own check, before it dials out: its config names a study SHA-256
        # and the state pins none.
        with serve(hospital, served, [hospital.site, *SYBILS], list(SYBILS)) as double:
            proc, _ = START[kit](hospital, double.address, approve=False)
            victims.append(proc)
            assert proc.wait_exit(120) == 2, proc.tail()
            text = "\n".join(str(line.get("msg", line.get("text", ""))) for line in proc.lines)
            assert "study_sha256" in text and "pins no study" in text, text[-2000:]
            assert double.record.calls == []
        return
    with serve(hospital, served, [hospital.site, *SYBILS], list(SYBILS)) as double:
        proc, _ = START[kit](hospital, double.address, approve=False)
        victims.append(proc)
        message = refused_at_enrolment(proc, double, hospital.site, served)
        assert "has approved no study" in message
        assert re.search(r"medfed site approve STUDY\.toml --state \S+", message)
