"""A deviating coordinator (or CA holder) at the study seams, over real mutual TLS.

The real SiteAgent, its real signed SQLite privacy ledger and the federation's real
PKI; the coordinator is `DeviatingStudyCoordinator` (tests/study/deviating_coordinator.py),
which enrols the site into a study of its choosing, serves scripted announcements and a
final bundle of its choosing, and records every request with the round it names. Each
test is named after the attack and shows what the site did NOT send.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.transport_site import DeterministicTestHook
from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import PrivacyError, StudyRefused, ValidationError
from common.core.modelfile import flat_layout
from common.crypto.random import system_random
from common.privacy.ledger import LedgerSigner, PrivacyLedger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol import pki
from common.protocol.secagg import round_floor
from common.releases import egress
from common.releases.bundle import ModelBundle, bundle_bytes, bundle_size_limit
from common.releases.seam import KIND_STATISTICS
from common.releases.statistics import (
    l2_squared_sensitivity,
    plan_statistics,
    statistics_layout,
    statistics_length,
)
from common.rounds.announcement import Announcement
from common.study import (
    GlobalStatistics,
    SitePrivacyPolicy,
    Study,
    check_study_against_policy,
    statistics_bytes,
    study_bytes,
    study_from_mapping,
    study_sha256,
)
from site_agent.agent import SiteAgent
from site_agent.approvals import Approvals
from site_agent.data import load_study_table
from site_agent.metrics import SiteMetrics
from tests.study.deviating_coordinator import DeviatingStudyCoordinator
from tests.study.helpers import (
    hospital_study,
    noiseless_statistics,
    study_mapping,
    trained_bundle,
    write_hospital_csv,
)

SITES = ("alpha", "beta", "gamma")
THRESHOLD = 3  # complete graph of 3, one colluder: 2t > m + T


@dataclass(frozen=True)
class World:
    pki: Path
    study: Study
    statistics: GlobalStatistics
    bundle: ModelBundle


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("study-attacks")
    pki_dir = root / "pki"
    now = dt.datetime.now(dt.UTC)
    pki.init_ca(pki_dir, now=now - dt.timedelta(days=1))
    pki.issue_coordinator(pki_dir, ["127.0.0.1", "localhost"])
    pki.issue_site(pki_dir, "alpha", now=now)
    csv_path = write_hospital_csv(root / "train.csv", n_patients=60)
    study = hospital_study()
    statistics = noiseless_statistics(study, load_study_table(csv_path, study))
    bundle = trained_bundle(csv_path, steps=1)  # the same study and statistics
    assert bundle.statistics == statistics
    return World(pki_dir, study, statistics, bundle)


def _now_ms() -> int:
    return int(dt.datetime.now(dt.UTC).timestamp() * 1000)


def training_round(world: World, number: int, *, statistics: bytes,
                   study: Study | None = None) -> Announcement:
    ann = Announcement(
        round_number=number, round_nonce=bytes(range(16)), participants=SITES,
        threshold=THRESHOLD, neighbours=0, vector_length=0, quantization_bits=16, clip=1.0,
        histogram_bins=2, secure_aggregation=True, model_layout=flat_layout(8),
        model_sha256=bytes(32), model_bytes=32, local_epochs=1, learning_rate=0.1,
        fedprox_mu=0.0, planned_rounds=3, train_deadline_ms=_now_ms() + 120_000,
        phase_timeout_ms=60_000, weight_cap=100,
        study_sha256=bytes.fromhex(study_sha256(study or world.study)), statistics=statistics,
    )
    return _with(ann, vector_length=ann.manifest().vector_length)


def statistics_round(world: World, number: int, *, participants: Sequence[str] = SITES,
                     threshold: int = THRESHOLD, secure: bool = True) -> Announcement:
    return Announcement(
        round_number=number, round_nonce=bytes(range(16)), participants=tuple(participants),
        threshold=threshold, neighbours=0, vector_length=statistics_length(world.study),
        quantization_bits=16, clip=1.0, histogram_bins=2, secure_aggregation=secure,
        model_layout=(), model_sha256=b"", model_bytes=0, local_epochs=0, learning_rate=0.1,
        fedprox_mu=0.0, planned_rounds=3, train_deadline_ms=_now_ms() + 120_000,
        phase_timeout_ms=60_000, weight_cap=1,
        study_sha256=bytes.fromhex(study_sha256(world.study)), kind=KIND_STATISTICS,
    )


def _with(ann: Announcement, **changes: Any) -> Announcement:
    import dataclasses

    return dataclasses.replace(ann, **changes)


def statistics_release_mechanism(study: Study) -> Any:
    """What an honest site records for the study's release (its own floor's noise)."""
    settings_policy = SitePolicySection()
    floor = round_floor(min_round_sites=settings_policy.min_round_sites,
                        max_colluding_sites=settings_policy.max_colluding_sites)
    return plan_statistics(
        study, n_noise=max(floor - settings_policy.max_colluding_sites, 1)
    ).mechanism()


@dataclass
class Site:
    state: Path
    ledger: PrivacyLedger

    def spent(self) -> float:
        return self.ledger.spent()


@pytest.fixture
def site(world: World, tmp_path: Path) -> Site:
    return make_site(world, tmp_path / "state", budget=8.0)


def make_site(world: World, state: Path, *, budget: float) -> Site:
    """A site whose privacy officer approved the study the double serves (`medfed site
    approve`): what each attack below deviates from is that study's run."""
    state.mkdir(parents=True, exist_ok=True)
    Approvals(state).approve_study(world.study)
    ledger = PrivacyLedger(
        state / "privacy-ledger.db", site_id="alpha", budget_epsilon=budget, delta=1e-3,
        privacy_unit="patient", signer=LedgerSigner.from_files(*pki.site_paths(world.pki, "alpha")),
    )
    return Site(state, ledger)


RunSite = Callable[..., DeviatingStudyCoordinator]


def pinned_members(world: World) -> SitePolicySection:
    """The site's own pin of the consortium (`medfed pki members`): the study served here
    lists no [[members]], which a site joins only when it pins them itself (or opts in)."""
    return SitePolicySection(members=pki.site_members(world.pki))


@pytest.fixture
def run_site(world: World, caplog: pytest.LogCaptureFixture) -> Iterator[RunSite]:
    """Run the real agent (once) against a deviating coordinator until the federation
    "finishes"; returns the double, whose record shows what the site sent."""
    caplog.set_level(logging.INFO, logger="medfed.site")

    def run(site: Site, rounds: Sequence[Announcement], *, final: bytes | None = None,
            study: bytes | None = None, sha: str | None = None,
            expect: type[Exception] | None = None) -> DeviatingStudyCoordinator:
        double = DeviatingStudyCoordinator(
            world.pki,
            study=study_bytes(world.study) if study is None else study,
            study_sha256=study_sha256(world.study) if sha is None else sha,
            rounds=rounds,
            final_bundle=bundle_bytes(world.bundle) if final is None else final,
        )
        with double:
            settings = SiteSettings(
                site="alpha", coordinator=double.address, state=site.state, pki=world.pki,
                once=True, policy=pinned_members(world),
            )
            agent = SiteAgent(settings, DeterministicTestHook("alpha"),
                              metrics=SiteMetrics("alpha"), ledger=site.ledger)
            if expect is None:
                assert agent.run() == 0
            else:
                with pytest.raises(expect) as raised:
                    agent.run()
                double.error = raised.value  # type: ignore[attr-defined]
        return double

    yield run


def sent_for(double: DeviatingStudyCoordinator, number: int) -> list[str]:
    """Every request that named round `number`, except declining it."""
    return [m for _, m, r in double.record.calls if r == number and m != "DeclineRound"]


def pin_file(site: Site, world: World) -> Path:
    return site.state / "statistics" / f"{study_sha256(world.study)}.json"


# --------------------------------------------------------------------------- 1. repeats


def test_replayed_statistics_round_number_is_refused_not_released_for_free(
    world: World, site: Site, run_site: RunSite, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger's reserve() is idempotent per (round, purpose): re-announcing the
    statistics round under the same number would release a second noisy vector at no
    recorded cost, and averaging many of them removes the noise."""
    site.ledger.reserve(7, [statistics_release_mechanism(world.study)],
                        now=dt.datetime.now(dt.UTC), purpose="statistics")
    before = site.spent()
    double = run_site(site, [statistics_round(world, 7)])
    assert sent_for(double, 7) == []
    assert "AdvertiseKeys" not in double.record.methods()
    assert site.spent() == before and len(site.ledger.entries()) == 1
    assert "already on this site's privacy ledger" in caplog.text


def test_second_statistics_round_after_the_release_is_refused(
    world: World, site: Site, run_site: RunSite, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the study's global statistics reached the site, another statistics round
    (any number) is a coordinator averaging noise away: refused before any key."""
    blob = statistics_bytes(world.statistics)
    double = run_site(site, [training_round(world, 8, statistics=blob),
                             statistics_round(world, 9)], expect=StudyRefused)
    assert double.record.rounds_of("AdvertiseKeys") == [8]  # the training round only
    assert sent_for(double, 9) == []
    # It can never take part in this run of the study: it says so and stops.
    assert double.decline_reasons == {9: pb.DeclineRoundRequest.STATISTICS_RELEASED}
    assert [e.purpose for e in site.ledger.entries()] == []
    assert "statistics were already released" in caplog.text
    assert str(pin_file(site, world)) in str(double.error)  # type: ignore[attr-defined]
    # After a restart the pin still holds (it is on disk).
    double = run_site(site, [statistics_round(world, 10)], expect=StudyRefused)
    assert sent_for(double, 10) == []
    assert double.decline_reasons == {10: pb.DeclineRoundRequest.STATISTICS_RELEASED}


def test_second_statistics_release_pays_and_the_budget_check_holds(
    world: World, tmp_path: Path, run_site: RunSite
) -> None:
    """Without the pin (statistics never reached the site), a new statistics round is a
    new ledger entry: a site that cannot pay for a second release declines it."""
    mechanism = statistics_release_mechanism(world.study)
    probe = make_site(world, tmp_path / "probe", budget=100.0)
    probe.ledger.reserve(1, [mechanism], now=dt.datetime.now(dt.UTC), purpose="statistics")
    one = probe.spent()
    site = make_site(world, tmp_path / "state", budget=one * 1.2)
    site.ledger.reserve(7, [mechanism], now=dt.datetime.now(dt.UTC), purpose="statistics")
    double = run_site(site, [statistics_round(world, 11)])
    assert sent_for(double, 11) == []
    assert double.record.rounds_of("DeclineRound") == [11]
    assert len(site.ledger.entries()) == 1


# --------------------------------------------------------------- 2. too few, low t


@pytest.mark.parametrize(
    ("participants", "threshold", "secure"),
    [
        (("alpha", "beta"), 2, True),  # below the round-size floor of 3
        (SITES, 1, True),  # a threshold that one colluder plus the coordinator reaches
        (SITES, 2, True),  # 2t <= m + T: two survivor stories could unmask alpha
        (SITES, 0, False),  # no secure aggregation: the coordinator sees the vector
    ],
    ids=["two-sites", "threshold-1", "threshold-2", "plain"],
)
def test_statistics_round_too_small_or_unmaskable_is_refused_before_anything_leaves(
    world: World, site: Site, run_site: RunSite, participants: tuple[str, ...],
    threshold: int, secure: bool,
) -> None:
    ann = statistics_round(world, 5, participants=participants, threshold=threshold,
                           secure=secure)
    double = run_site(site, [ann])
    assert sent_for(double, 5) == []
    assert site.ledger.entries() == []


# ------------------------------------------------------- 3. malicious statistics


def _edit(statistics: GlobalStatistics, change: Callable[[dict[str, Any]], None]) -> bytes:
    data = json.loads(statistics_bytes(statistics))
    change(data)
    return json.dumps(data).encode()


AGE, LACTATE, ADMISSION = "Age (years)", "Lactate mmol/L", "Admission type"


def _set(section: str, feature: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data[section][feature][key] = value

    return change


MALICIOUS = {
    "nan-scale": ("numeric", AGE, "scale", float("nan")),
    "infinite-mean": ("numeric", LACTATE, "mean", float("inf")),
    "negative-scale": ("numeric", AGE, "scale", -1.0),
    "zero-scale": ("numeric", LACTATE, "scale", 0.0),
    "impute-outside-declared-range": ("numeric", AGE, "impute", 1000.0),
    "mean-outside-declared-range": ("numeric", AGE, "mean", -5.0),
    "impute-outside-auto-range": ("numeric", LACTATE, "impute", 1e6),
    "clip-range-not-the-study's": ("numeric", AGE, "clip_low", 0.0),
    "undeclared-level": ("categorical", ADMISSION, "impute", "walk-in"),
    "no-level-for-impute": ("categorical", ADMISSION, "impute", None),
}


def _malicious_blob(world: World, case: str) -> bytes:
    # json writes NaN and Infinity as bare tokens, as a hostile coordinator may.
    section, feature, key, value = MALICIOUS[case]
    return _edit(world.statistics, _set(section, feature, key, value))


def _other_study() -> Study:
    mapping = study_mapping()
    mapping["study"]["name"] = "another-study"
    return study_from_mapping(mapping, source="test")


def _foreign_study_blob(world: World) -> bytes:
    return _edit(world.statistics, lambda d: d.update(study_sha256=study_sha256(_other_study())))


def _missing_feature_blob(world: World) -> bytes:
    return _edit(world.statistics, lambda d: d["numeric"].pop(LACTATE))


@pytest.mark.parametrize("case", [*MALICIOUS, "another-study", "missing-feature"])
def test_malicious_global_statistics_are_refused_before_the_round(
    world: World, site: Site, run_site: RunSite, caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    if case == "another-study":
        blob = _foreign_study_blob(world)
    elif case == "missing-feature":
        blob = _missing_feature_blob(world)
    else:
        blob = _malicious_blob(world, case)
    double = run_site(site, [training_round(world, 4, statistics=blob)])
    assert sent_for(double, 4) == []  # no key, no model download, no heartbeat
    assert not pin_file(site, world).exists()  # nothing was accepted
    assert site.ledger.entries() == []
    assert "round 4 failed: statistics" in caplog.text


def test_statistics_changing_between_rounds_of_one_study_are_refused(
    world: World, site: Site, run_site: RunSite, caplog: pytest.LogCaptureFixture
) -> None:
    """Statistics come from the study's one release and never change: a coordinator
    that sends others later is probing how the site encodes its records. Refused in the
    same run and after a restart (the first statistics are pinned on disk)."""
    first = statistics_bytes(world.statistics)
    probe = _edit(world.statistics, _set("numeric", AGE, "mean", 70.0))
    double = run_site(site, [training_round(world, 8, statistics=first),
                             training_round(world, 9, statistics=probe),
                             training_round(world, 10, statistics=first)],
                      expect=StudyRefused)
    # Every later round of this run would carry the same statistics: the site declines
    # and stops rather than fail each round while the coordinator waits for it.
    assert double.record.rounds_of("AdvertiseKeys") == [8]
    assert sent_for(double, 9) == [] and sent_for(double, 10) == []
    assert double.decline_reasons == {9: pb.DeclineRoundRequest.STATISTICS_RELEASED}
    assert "differ from the ones this site accepted" in caplog.text
    double = run_site(site, [training_round(world, 11, statistics=probe)],
                      expect=StudyRefused)
    assert sent_for(double, 11) == []


# ------------------------------------------------------------- 4. swapped study


def test_announcement_for_another_study_is_refused(
    world: World, site: Site, run_site: RunSite, caplog: pytest.LogCaptureFixture
) -> None:
    other = _other_study()
    ann = training_round(world, 3, statistics=b"", study=other)
    stats_ann = _with(statistics_round(world, 4),
                      study_sha256=bytes.fromhex(study_sha256(other)))
    double = run_site(site, [ann, stats_ann])
    assert sent_for(double, 3) == [] and sent_for(double, 4) == []
    assert "another study than the one joined" in caplog.text


def test_enrolment_study_that_does_not_hash_to_the_announced_sha_is_refused(
    world: World, site: Site, run_site: RunSite
) -> None:
    """A coordinator (or CA holder) that announces one study and ships another."""
    other = study_bytes(_other_study())
    double = run_site(site, [statistics_round(world, 2)], study=other,
                      sha=study_sha256(world.study), expect=ValidationError)
    assert double.record.methods() == ["Enroll"]  # nothing after the refused study
    assert "do not match the announced study_sha256" in str(double.error)  # type: ignore[attr-defined]


def test_enrolment_study_in_non_canonical_form_is_refused(
    world: World, site: Site, run_site: RunSite
) -> None:
    """Same meaning, other bytes: two parties could hash two encodings of one study."""
    data = json.dumps(json.loads(study_bytes(world.study)), indent=1).encode()
    double = run_site(site, [], study=data, sha=hashlib.sha256(data).hexdigest(),
                      expect=ValidationError)
    assert double.record.methods() == ["Enroll"]
    assert "canonical" in str(double.error)  # type: ignore[attr-defined]


# --------------------------------------------------------------- 5. final model


def _final(site: Site) -> Path:
    return site.state / "model" / "final.safetensors"


def _bundle(world: World, **changes: Any) -> bytes:
    import dataclasses

    return bundle_bytes(dataclasses.replace(world.bundle, **changes))


GOOD = b"previous good final model"


def _edited_bundle(world: World, key: str, value: str) -> bytes:
    """The bundle with one metadata value replaced and its digest recomputed (the digest
    is not a signature: whoever edits the file can recompute it)."""
    from safetensors.numpy import load, save

    from common.core.tensor_file import metadata_digest

    data = bundle_bytes(world.bundle)
    length = int.from_bytes(data[:8], "little")
    metadata = {**json.loads(data[8 : 8 + length])["__metadata__"], key: value}
    tensors = load(data)
    metadata["medfed.sha256"] = metadata_digest(
        metadata, {name: tensors[name] for name in world.bundle.parameters})
    return save(tensors, metadata=metadata)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("another-study", "another study"),
        ("corrupt", "digest mismatch|safetensors|tensors"),
        ("truncated", "safetensors|tensors|header"),
        ("not-final", "not marked final"),
        ("other-statistics", "statistics differ"),
        ("deeply-nested-header", "header is not JSON"),
        ("superscript-round", r"medfed\.round: must be a non-negative integer"),
        ("5000-digit-round", r"medfed\.round: must be a non-negative integer"),
    ],
)
def test_bad_final_model_is_refused_and_nothing_is_overwritten(
    world: World, site: Site, run_site: RunSite, case: str, words: str,
) -> None:
    blob = statistics_bytes(world.statistics)
    good = bundle_bytes(world.bundle)
    if case == "another-study":
        other = _other_study()
        stats = world.statistics.model_copy(update={"study_sha256": study_sha256(other)})
        data = _bundle(world, study=other, statistics=stats)
    elif case == "corrupt":
        flipped = bytearray(good)
        flipped[-3] ^= 0xFF  # inside the tensor data; metadata and digest unchanged
        data = bytes(flipped)
    elif case == "truncated":
        data = good[: len(good) // 2]
    elif case == "not-final":
        data = _bundle(world, final=False)  # an intermediate round's bundle
    elif case == "other-statistics":
        # A self-consistent bundle (its digest recomputed) whose metadata lies about
        # the preprocessing the site trained with.
        lied = world.statistics.model_copy(update={"source": "another release"})
        data = _bundle(world, statistics=lied)
    elif case == "deeply-nested-header":
        header = b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        data = len(header).to_bytes(8, "little") + header
    elif case in ("superscript-round", "5000-digit-round"):
        data = _edited_bundle(world, "medfed.round", "²" if "superscript" in case else "9" * 5000)
    else:
        raise AssertionError(case)
    _final(site).parent.mkdir(parents=True)
    _final(site).write_bytes(GOOD)
    rounds = [training_round(world, 2, statistics=blob)]
    double = run_site(site, rounds, final=data, expect=ValidationError)
    assert re.search(words, str(double.error))  # type: ignore[attr-defined]
    assert _final(site).read_bytes() == GOOD
    assert not _final(site).with_name("final.safetensors.tmp").exists()


def test_crafted_final_model_does_not_stop_a_long_running_site(
    world: World, site: Site, caplog: pytest.LogCaptureFixture
) -> None:
    """Without --once a site serves study after study: a crafted final model (a
    deeply nested header) is refused with one error record naming the cause, and the
    agent stays up waiting for the next study instead of dying; nothing of the bad
    file is kept and the previous final model stays."""
    import threading

    refused = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) == "final_model_refused":
                refused.set()

    header = b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    crafted = len(header).to_bytes(8, "little") + header
    _final(site).parent.mkdir(parents=True)
    _final(site).write_bytes(GOOD)
    rounds = [training_round(world, 2, statistics=statistics_bytes(world.statistics))]
    watch = Watch()
    logging.getLogger("medfed.site").addHandler(watch)
    caplog.set_level(logging.INFO, logger="medfed.site")
    stop = threading.Event()
    result: list[int] = []
    try:
        with DeviatingStudyCoordinator(
            world.pki, study=study_bytes(world.study), study_sha256=study_sha256(world.study),
            rounds=rounds, final_bundle=crafted,
        ) as double:
            settings = SiteSettings(site="alpha", coordinator=double.address,
                                    state=site.state, pki=world.pki, once=False,
                                    policy=pinned_members(world))
            agent = SiteAgent(settings, DeterministicTestHook("alpha"),
                              metrics=SiteMetrics("alpha"), ledger=site.ledger, stop=stop)
            thread = threading.Thread(target=lambda: result.append(agent.run()), daemon=True)
            thread.start()
            assert refused.wait(120), "the site never refused the crafted final model"
            assert thread.is_alive()  # still up, waiting for the next study
            stop.set()
            thread.join(60)
    finally:
        stop.set()
        logging.getLogger("medfed.site").removeHandler(watch)
    assert not thread.is_alive() and result == [0]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [getattr(r, "event", None) for r in errors] == ["final_model_refused"]
    assert "header is not JSON" in errors[0].getMessage()
    assert _final(site).read_bytes() == GOOD
    assert sorted(p.name for p in _final(site).parent.iterdir()) == ["final.safetensors"]


def test_final_model_stream_past_the_announced_size_is_refused(
    world: World, site: Site, run_site: RunSite
) -> None:
    """A coordinator streaming more than the announced model can be (its float32
    parameters plus the bundle's header margin) is cut off at that bound, before the
    site writes more: the message names the limit, the previous file stays, and no
    temporary file is left."""
    ann = training_round(world, 2, statistics=statistics_bytes(world.statistics))
    limit = bundle_size_limit(model_elements=ann.model_elements)
    good = bundle_bytes(world.bundle)
    data = good + bytes(limit + 1 - len(good))
    _final(site).parent.mkdir(parents=True)
    _final(site).write_bytes(GOOD)
    double = run_site(site, [ann], final=data, expect=ValidationError)
    message = str(double.error)  # type: ignore[attr-defined]
    assert f"final model too large: more than {limit} bytes" in message
    assert f"{ann.model_elements} float32 parameters" in message
    assert _final(site).read_bytes() == GOOD
    assert sorted(p.name for p in _final(site).parent.iterdir()) == ["final.safetensors"]


def test_good_final_model_is_stored_byte_for_byte(
    world: World, site: Site, run_site: RunSite
) -> None:
    """The control for the refusals above: the honest bundle is stored."""
    blob = statistics_bytes(world.statistics)
    data = bundle_bytes(world.bundle)
    run_site(site, [training_round(world, 2, statistics=blob)], final=data)
    assert _final(site).read_bytes() == data


# -------------------------------------------------------------------- 6. counts


def test_statistics_release_sends_no_count_outside_the_noised_vector(world: World) -> None:
    """The unit count and the missing counts are entries of the one noised vector
    (the "statistics" DP segment of the egress manifest), never fields of their own:
    a statistics round's vector is that one segment, every entry gets noise, and the
    sensitivity the ledger records counts the units entry."""
    ann = statistics_round(world, 1)
    manifest = ann.manifest()
    assert [(s.kind, s.length) for s in manifest.segments] == [
        (egress.STATISTICS, statistics_length(world.study))
    ]
    kind = egress.SEGMENT_KINDS[egress.STATISTICS]
    assert kind.protection == egress.Protection.DP and kind.ledger_purpose == "statistics"
    layout = {s.name: s for s in statistics_layout(world.study)}
    assert layout["units"].start == 0 and layout["units"].length == 1
    assert all(f"{f.name}.missing" in layout for f in world.study.features)
    plan = plan_statistics(world.study, n_noise=2)
    assert plan.length == manifest.vector_length
    noise = plan.noise(system_random)
    assert noise.shape == (manifest.vector_length,)
    assert plan.l2_sensitivity ** 2 == pytest.approx(l2_squared_sensitivity(world.study))
    assert np.count_nonzero(noise) > 0


# ---------------------------------------------------------- 7. the study's requests


def test_study_asking_for_a_nearly_noiseless_statistics_release_is_refused() -> None:
    """The coordinator writes the study: a statistics release at a large
    epsilon would publish the unit and missing counts nearly exactly. The site's own
    per-release cap and total budget bound it, before the site joins."""
    name = "statistics_epsilon"
    mapping = study_mapping(epsilon=4.0, max_epsilon_per_round=1.0)
    mapping["privacy"][name] = 3.0
    study = study_from_mapping(mapping, source="test")
    capped = SitePrivacyPolicy(epsilon=8.0, delta=1e-3, unit="patient",
                               max_epsilon_per_round=1.0)
    with pytest.raises(PrivacyError, match=rf"privacy\.{name} = 3 exceeds this site's 1"):
        check_study_against_policy(study, capped)
    # Without a per-release cap, the whole budget still bounds one release.
    mapping = study_mapping(epsilon=4.0)
    mapping["privacy"][name] = 9.0
    study = study_from_mapping(mapping, source="test")
    uncapped = SitePrivacyPolicy(epsilon=8.0, delta=1e-3, unit="patient")
    with pytest.raises(PrivacyError, match=rf"privacy\.{name} = 9 exceeds this site's 8"):
        check_study_against_policy(study, uncapped)
    mapping["privacy"][name] = 0.5
    check_study_against_policy(study_from_mapping(mapping, source="test"), uncapped)
