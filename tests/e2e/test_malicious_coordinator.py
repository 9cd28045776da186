"""A deviating coordinator against the real site agent.

The coordinator is `tests/e2e/malicious_coordinator.py`: real mTLS with the federation's
coordinator certificate, the real `SecAggServer`, and valid site certificates of the
same CA that it plays itself. The hospitals are real `medfed site run` processes with
keys they generated themselves (`pki request` / `pki sign`), enrolled into the study the
double serves, DP-SGD on a synthetic CSV, and a privacy ledger. In each attack the site
aborts with the expected reason (its log line) and what it sent does not give its update
away.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from bench.instrumented import instrumented_argv
from common.core.codec import TensorSpec
from common.core.config import CoordinatorSettings
from common.core.processes import ManagedProcess
from common.crypto.random import system_random
from common.models.build import initial_model
from common.models.layout import flatten_parameters, model_layout
from common.privacy.ledger import read_ledger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol import pki
from common.study import GlobalStatistics, Study, study_sha256
from coordinator.bundles import write_round_bundle
from coordinator.study_run import StudyRun
from demo.study import exact_statistics, synthetic_demo_study
from site_agent.approvals import Approvals
from site_agent.data import load_study_table
from site_agent.synthetic import generate_cohort, write_site_csvs
from tests.e2e.harness import REPO
from tests.e2e.malicious_coordinator import MaliciousCoordinator, Story, make_story

pytestmark = pytest.mark.e2e

HOSPITALS = ("h1", "h2")  # real processes; keys generated at the "hospital"
HELD_BY_COORDINATOR = ("evil", "h3", "h4")  # certificates + keys the double holds
STUDY = synthetic_demo_study(
    name="malicious", rounds=1, epsilon=8.0, delta=1e-3, histogram_bins=10, local_epochs=1,
    learning_rate=0.1, batch_size=64,
)
"""The study's terms, listing no members (what a site with default settings refuses)."""


def with_members(study: Study, members: dict[str, str]) -> Study:
    """`study` listing `members` (site id -> public-key SHA-256) as its [[members]]."""
    return Study.model_validate({
        **study.model_dump(mode="json"),
        "members": [{"name": n, "fingerprint": f} for n, f in members.items()]})


def floor_4(study: Study) -> Study:
    """The same study with a round floor of 4: a site refuses a study whose floor is below
    its own policy's, so a site requiring sums over 4 sites joins only this one."""
    return study.model_copy(update={
        "privacy": study.privacy.model_copy(update={"min_round_sites": 4})})


@dataclass(frozen=True)
class World:
    root: Path
    pki: Path
    hospital_keys: Path
    data: dict[str, Path]
    study: Study  # served at enrolment: STUDY listing every certificate made here as members
    statistics: GlobalStatistics  # announced as if the study's release produced them
    final_model: bytes  # the study's final bundle, served once the double says "finished"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("malicious")
    pki_dir = root / "pki"
    pki.init_ca(pki_dir)
    pki.issue_coordinator(pki_dir, ["127.0.0.1", "localhost"])
    keys = root / "hospital-keys"
    for site in HOSPITALS:
        # `medfed pki request` at the hospital, `medfed pki sign` at the operator.
        request = pki.request_certificate(keys / site, site)
        pki.sign_request(pki_dir, request.csr_path)
        assert not (pki_dir / "sites" / f"{site}.key").exists()  # the key stayed home
    for site in HELD_BY_COORDINATOR:
        # What the shipped deployment used to give the coordinator (and what a CA
        # holder can always mint): valid site certificates of the federation CA.
        pki.issue_site(pki_dir, site)
    # The study lists them all (the double plays h3 and h4 as honest members and evil as
    # a colluding one), so these attacks reach the round a site with default settings
    # joins; what a member-less study gets is test_attack_ca_holder_runs_sybil_round_*.
    study = with_members(STUDY, {
        site: pki.public_key_fingerprint(pki.load_certificate(pki_dir / "sites" / f"{site}.crt"))
        for site in (*HOSPITALS, *HELD_BY_COORDINATOR)})
    cohort = generate_cohort(list(HOSPITALS), seed=11, patients_per_site=160)
    data = write_site_csvs(root / "data", cohort)
    tables = {site: load_study_table(path, study) for site, path in data.items()}
    statistics = exact_statistics(tables, study, seed=0)
    final = final_bundle(study, statistics, pki_dir=pki_dir, state=root / "coordinator")
    return World(root, pki_dir, keys, data, study, statistics, final)


def final_bundle(study: Study, statistics: GlobalStatistics, *, pki_dir: Path,
                 state: Path) -> bytes:
    """The study's final model bundle, as the coordinator writes it."""
    run = StudyRun(study=study, state=state, statistics=statistics)
    layout, flat = model(0)
    write_round_bundle(run, round_number=1, layout=layout, flat=flat, budgets=[], final=True,
                       settings=CoordinatorSettings(pki=pki_dir, state=run.state))
    return run.final_path.read_bytes()


def model(seed: int) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    net = initial_model(STUDY, seed=seed)
    return model_layout(net), flatten_parameters(net)


@pytest.fixture
def start_site(world: World, tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    started: list[ManagedProcess] = []

    def start(site: str, address: str, *, approved: Study | None,
              policy: str = "") -> ManagedProcess:
        """`site run` with flags only (every setting at its default), and with a config
        file holding `policy` ([policy] lines) when one is given; `approved`: the study
        the hospital pinned first (`medfed site approve`), or none."""
        if approved is not None:
            Approvals(tmp_path / "state" / site).approve_study(approved)
        config: tuple[str, ...] = ()
        if policy:
            (tmp_path / f"{site}.toml").write_text(f"[policy]\n{policy}\n")
            config = ("--config", str(tmp_path / f"{site}.toml"))
        proc = ManagedProcess(
            site,
            instrumented_argv(
                "site", "run", *config,
                "--tls-ca", str(world.pki / "ca.crt"),
                "--tls-cert", str(world.pki / "sites" / f"{site}.crt"),
                "--tls-key", str(world.hospital_keys / site / f"{site}.key"),
                "--site", site, "--coordinator", address, "--metrics-listen", "127.0.0.1:0",
                "--state", str(tmp_path / "state" / site), "--data", str(world.data[site]),
                "--budget-epsilon", "8", "--delta", "1e-3", "--trainer", "dpsgd",
                "--debug-write-updates", "--once",
            ),
            log_dir=tmp_path / "logs", cwd=REPO, env={"PYTHONPATH": str(REPO)},
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def assert_nothing_after_announcement(double: MaliciousCoordinator, site: str) -> None:
    # ReplicateLedger carries the signed ledger's parameters only; the final model is the
    # coordinator's, downloaded.
    assert set(double.record.methods_of(site)) <= {
        "Enroll", "WaitForRound", "ReplicateLedger", "DownloadFinalModel"}
    assert site not in double.record.masked


def test_abort_when_round_has_only_two_sites(
    world: World, start_site: Callable[..., ManagedProcess]
) -> None:
    """The coordinator signs as a second "hospital": a sum of two would give h1's update
    away. h1 refuses the announcement before any key, download or training."""
    layout, flat = model(1)
    story = make_story(participants=["evil", "h1"], layout=layout, flat=flat,
                       nonce=system_random(16), threshold=2, study=world.study,
                       statistics=world.statistics)
    with MaliciousCoordinator(world.pki, stories={"h1": story}, server_story=story,
                              puppets=["evil"], study=world.study,
                              final_model=world.final_model) as double:
        site = start_site("h1", double.address, approved=world.study)
        site.wait_log("round 1 aborted: round_too_small", timeout=180)
        assert site.wait_exit(60) == 0
    assert_nothing_after_announcement(double, "h1")


def test_abort_when_survivor_set_shrinks_below_floor_after_masked_input(
    world: World, start_site: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    """Four announced (h1 real; h3, h4 honest sites the double plays; evil colludes),
    h1 and the study require sums over 4 sites. After the masked inputs are in, the
    coordinator drops h4 from the sum: h1 refuses to sign the survivor list or send
    Unmask shares."""
    layout, flat = model(2)
    study = floor_4(world.study)
    statistics = world.statistics.model_copy(update={"study_sha256": study_sha256(study)})
    story = make_story(participants=["evil", "h1", "h3", "h4"], layout=layout, flat=flat,
                       nonce=system_random(16), threshold=3, study=study,
                       statistics=statistics)
    final = final_bundle(study, statistics, pki_dir=world.pki, state=tmp_path / "coordinator")
    with MaliciousCoordinator(world.pki, stories={"h1": story}, server_story=story,
                              puppets=["evil", "h3", "h4"], withhold=["h4"],
                              study=study, final_model=final) as double:
        site = start_site("h1", double.address, approved=study, policy="min_round_sites = 4")
        site.wait_log("round 1 aborted: survivors_below_floor", timeout=300)
        assert site.wait_exit(60) == 0
    methods = double.record.methods_of("h1")
    assert "UploadMaskedInput" in methods
    assert "ConsistencyCheck" not in methods and "Unmask" not in methods
    survivors = double.survivors
    assert survivors is not None and survivors.survivors == ("evil", "h1", "h3")
    # h1 really trained (DP-SGD) and recorded the spend before anything left the site.
    state = tmp_path / "state" / "h1"
    assert (state / "privacy-ledger.db").is_file()
    plaintext = np.fromfile(state / "debug-updates" / "round-000001.u32", dtype="<u4")
    # What h1 sent is masked: it is not h1's update ...
    masked = double.record.masked["h1"]
    assert masked.shape == plaintext.shape
    assert np.mean(masked == plaintext) < 0.01
    # ... and even knowing every other survivor's input (the colluder's and the honest
    # h3's, which the double plays), the sum minus those inputs is still masked: h1's
    # self-mask seed is Shamir-shared with t = 3 among the four, the coordinator's
    # survivors hold two shares, and h1's own share was never sent.
    total = np.zeros_like(masked)
    for name in survivors.survivors:
        vector = masked if name == "h1" else double.puppets[name].masked
        assert vector is not None
        np.add(total, vector, out=total)
    for name in ("evil", "h3"):
        np.subtract(total, double.puppets[name].vector, out=total)
    assert np.mean(total == plaintext) < 0.01


def test_divergent_announcements_abort(
    world: World, start_site: Callable[..., ManagedProcess]
) -> None:
    """h1 and h2 are told different models and clip (so their score histograms or
    updates could be told apart in the sum): the announcement digest in every signed
    AdvertiseKeys makes each reject the other at the roster, before any share, update or
    training (only the model download runs beside the key phases)."""
    nonce = system_random(16)
    layout, flat_a = model(3)
    _, flat_b = model(4)
    participants = ["evil", "h1", "h2"]
    story_a = make_story(participants=participants, layout=layout, flat=flat_a, nonce=nonce,
                         threshold=3, study=world.study, statistics=world.statistics)
    story_b = make_story(participants=participants, layout=layout, flat=flat_b, nonce=nonce,
                         threshold=3, clip=0.5, study=world.study,
                         statistics=world.statistics)
    stories: dict[str, Story] = {"h1": story_a, "h2": story_b}
    with MaliciousCoordinator(world.pki, stories=stories, server_story=story_a,
                              puppets=["evil"], study=world.study,
                              final_model=world.final_model) as double:
        sites = {name: start_site(name, double.address, approved=world.study)
                 for name in stories}
        for proc in sites.values():
            proc.wait_log("round 1 aborted: bad_signature", timeout=300)
            assert proc.wait_exit(60) == 0
    for name in stories:
        methods = set(double.record.methods_of(name))
        # The model download runs beside the key phases (it sends nothing of the site's
        # but the round number), the final model's after the study; no share, update,
        # signature or heartbeat data left.
        assert methods <= {"Enroll", "WaitForRound", "ReplicateLedger", "AdvertiseKeys",
                           "DownloadModel", "Heartbeat", "DownloadFinalModel"}, methods
        assert not methods & {"ShareKeys", "UploadMaskedInput", "ConsistencyCheck", "Unmask"}
        assert name not in double.record.masked


def fingerprint_of_request(keys: Path, site: str) -> str:
    """A hospital's `medfed pki request`: the public-key SHA-256 its officer reads out."""
    request = pki.request_certificate(keys / site, site)
    csr, _ = pki.load_request(request.csr_path)
    return pki.public_key_fingerprint(csr)


@pytest.mark.parametrize("sybils", [("sybil1", "sybil2"), ("m2", "m3")],
                         ids=["new-names", "members-names"])
def test_attack_ca_holder_runs_sybil_round(
    world: World, start_site: Callable[..., ManagedProcess], tmp_path: Path,
    sybils: tuple[str, str],
) -> None:
    """The coordinator holds the CA: it mints two site certificates and runs the
    floor-sized round {h1, sybil, sybil}; knowing both sybils' inputs and secrets, the
    sum would give h1's exact input away. h1 approved a study listing its hospitals by
    key (h1, m2, m3; m2 and m3 made their keys at home). Sybils under new names: h1
    refuses the announcement before any key, download or training. Sybils minted under
    the members' names (with the CA holder's keys): h1 refuses at the roster, before any
    share or masked input leaves it."""
    members = {
        "h1": pki.public_key_fingerprint(pki.load_certificate(world.pki / "sites" / "h1.crt")),
        "m2": fingerprint_of_request(tmp_path / "keys", "m2"),
        "m3": fingerprint_of_request(tmp_path / "keys", "m3"),
    }
    study = with_members(STUDY, members)
    for sybil in sybils:
        pki.issue_site(world.pki, sybil)  # what a CA holder can always mint
    statistics = world.statistics.model_copy(update={"study_sha256": study_sha256(study)})
    final = final_bundle(study, statistics, pki_dir=world.pki, state=tmp_path / "coordinator")
    layout, flat = model(5)
    story = make_story(participants=["h1", *sybils], layout=layout, flat=flat,
                       nonce=system_random(16), threshold=3, study=study,
                       statistics=statistics)
    with MaliciousCoordinator(world.pki, stories={"h1": story}, server_story=story,
                              puppets=list(sybils), study=study, final_model=final) as double:
        # Flags only (every setting's default), after approving the members' study.
        site = start_site("h1", double.address, approved=study)
        site.wait_log("round 1 aborted: unknown_member", timeout=300)
        assert site.wait_exit(60) == 0
    methods = set(double.record.methods_of("h1"))
    if sybils == ("sybil1", "sybil2"):
        assert_nothing_after_announcement(double, "h1")
    else:
        # Public keys were advertised (the names were the members'); the keys were not:
        # no share, masked input, signature or unmasking share left h1.
        assert "AdvertiseKeys" in methods
        assert not methods & {"ShareKeys", "UploadMaskedInput", "ConsistencyCheck", "Unmask"}
        assert "h1" not in double.record.masked


def test_attack_ca_holder_runs_sybil_round_against_a_site_with_default_settings(
    world: World, start_site: Callable[..., ManagedProcess], tmp_path: Path,
) -> None:
    """The CA-holding coordinator serves a study listing no members and runs the
    floor-sized round {h1, minted1, minted2} with two certificates it minted. Even with
    that study approved (its officer overlooked "members NONE LISTED"), h1, started with
    flags only (no configuration file: policy.allow_open_membership at its default),
    refuses the study at enrolment, naming the study, the setting and the way out, and
    stops with exit code 2: it never learns of the round, and the sybils' sum never gets
    its masked input. A default that let it join would reach the round."""
    sybils = ("minted1", "minted2")
    for sybil in sybils:
        pki.issue_site(world.pki, sybil)  # what a CA holder can always mint
    statistics = world.statistics.model_copy(update={"study_sha256": study_sha256(STUDY)})
    final = final_bundle(STUDY, statistics, pki_dir=world.pki, state=tmp_path / "coordinator")
    layout, flat = model(6)
    story = make_story(participants=["h1", *sybils], layout=layout, flat=flat,
                       nonce=system_random(16), threshold=3, study=STUDY,
                       statistics=statistics)
    with MaliciousCoordinator(world.pki, stories={"h1": story}, server_story=story,
                              puppets=list(sybils), study=STUDY, final_model=final) as double:
        site = start_site("h1", double.address, approved=STUDY)
        assert site.wait_exit(300) == 2, site.tail(30)
    site.stop()  # joins its output readers: every line is in
    text = "\n".join(str(line.get("msg", line.get("text", ""))) for line in site.lines)
    refusal = next(line for line in text.splitlines() if "medfed: error:" in line)
    for part in ("policy.allow_open_membership", f"study {STUDY.study.name!r}",
                 f"sha256 {study_sha256(STUDY)[:12]}", "lists no [[members]]",
                 "medfed study init --member-from", "medfed pki members",
                 "policy.allow_open_membership = true"):
        assert part in refusal, refusal
    assert "Traceback" not in text
    # Nothing after the enrolment: no round asked for, no key, no share, no masked input.
    assert set(double.record.methods_of("h1")) == {"Enroll"}
    assert "h1" not in double.record.masked
    assert not (tmp_path / "state" / "h1" / "debug-updates").exists()


def test_attack_coordinator_serves_a_model_beyond_the_weight_bound(
    world: World, start_site: Callable[..., ManagedProcess], tmp_path: Path,
) -> None:
    """The coordinator serves a finite model with a weight of 1e20, far past the study's
    public bound (`[model] max_abs_weight`, 1e6 by default): a model that large can be
    planted to overflow float32 on the records it targets. h1 (which pinned the study,
    `medfed site approve`) checks the downloaded model before any ledger entry or
    training and declines the round saying why (MODEL_OUT_OF_BOUNDS, which the
    coordinator logs); no masked input leaves it. The check reads the model and the
    study only, so declining says nothing about h1's data."""
    layout, flat = model(7)
    flat = flat.copy()
    flat[3] = 1e20
    story = make_story(participants=["evil", "h1", "h3"], layout=layout, flat=flat,
                       nonce=system_random(16), threshold=3, study=world.study,
                       statistics=world.statistics)
    with MaliciousCoordinator(world.pki, stories={"h1": story}, server_story=story,
                              puppets=["evil", "h3"], study=world.study,
                              final_model=world.final_model) as double:
        site = start_site("h1", double.address, approved=world.study)
        site.wait_log("max_abs_weight", timeout=180)
        assert site.wait_exit(60) == 0
    methods = double.record.methods_of("h1")
    assert "DownloadModel" in methods
    assert double.record.declines == {"h1": pb.DeclineRoundRequest.MODEL_OUT_OF_BOUNDS}
    assert not set(methods) & {"UploadMaskedInput", "ConsistencyCheck", "Unmask"}
    assert "h1" not in double.record.masked
    assert not (tmp_path / "state" / "h1" / "debug-updates").exists()
    # Declined before the ledger's write-ahead entries: nothing spent on that model.
    entries = read_ledger(tmp_path / "state" / "h1" / "privacy-ledger.db")[1]
    assert not [e for e in entries if e.round == 1]
