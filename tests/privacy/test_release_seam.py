"""The release seam (common.releases.seam) from a newcomer's side: a DP release that exists
only in this file (a count of patients aged 65 or over) is registered, released by three
sites through the site's generic path (`site_agent.releases.release_vector`: a real
signed ledger entry first, then noise from the system CSPRNG, then the egress
encoding), summed by real SecAgg+ (real X25519/AES-GCM/Shamir, in-process), and decoded
by the coordinator's generic path (`common.releases.seam.read_sum`, then kept as JSON).
Nothing else in the product knows about it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.core.config import SitePolicySection
from common.core.errors import ValidationError
from common.privacy.accountant import compose_epsilon
from common.privacy.ledger import PrivacyLedger
from common.privacy.signed import LedgerSigner
from common.protocol import pki
from common.releases import egress
from common.releases.seam import (
    KIND_RELEASE,
    RELEASES,
    DpRelease,
    NoisePlan,
    Purpose,
    ReleaseKind,
    load_releases,
    read_sum,
    register_release,
    release_kind,
    sum_noise_sigmas,
)
from common.rounds import wire
from common.rounds.announcement import Announcement, validate_for_site
from coordinator.release_round import keep_json
from site_agent.releases import release_vector
from tests.secagg.secagg_harness import make_federation, run_round
from tests.study.helpers import ring_to_signed

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
SIGMA = 4.0  # summed noise std per count
ROUND = 7


class CountOver65(DpRelease):
    """TEST ONLY: how many of a site's patients are 65 or older. One patient moves the
    count by at most 1 (L1 = L2 = 1)."""

    name = "test_count_over_65"
    purpose = Purpose.STATISTICS

    def __init__(self, study: Any = None) -> None:
        self.study = study

    @property
    def length(self) -> int:
        return 1

    def query(self, site: Any) -> np.ndarray:
        return np.array([int((np.asarray(site.ages) >= 65).sum())], dtype=np.int64)

    def plan(self, *, n_noise: int) -> NoisePlan:
        return NoisePlan(sigma=SIGMA, n_noise=n_noise, length=1, l2_sensitivity=1.0,
                         l1_sensitivity=1.0)

    def decode(self, total: np.ndarray, *, noise_sigma: float, round_number: int,
               contributors: int) -> tuple[int, float]:
        return int(total[0]), noise_sigma


@dataclass(frozen=True)
class Site:
    """What the query reads on a site."""

    ages: np.ndarray


@pytest.fixture
def registered() -> Iterator[ReleaseKind]:
    """The test release registered, and unregistered afterwards (the egress manifest
    table in docs/privacy.md lists the product's segments only)."""
    kind = register_release(ReleaseKind(
        name=CountOver65.name, purpose=Purpose.STATISTICS, build=CountOver65,
        mechanism="distributed discrete Gaussian on one count (Kairouz et al. 2021)",
        description="test only: patients aged 65 or over",
    ))
    try:
        yield kind
    finally:
        RELEASES.pop(kind.name, None)
        egress.SEGMENT_KINDS.pop(kind.name, None)


@pytest.fixture(scope="module")
def signers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LedgerSigner]:
    root = tmp_path_factory.mktemp("release-pki")
    pki.init_ca(root)
    out = {}
    for site in ("site-000", "site-001", "site-002"):
        pki.issue_site(root, site, algorithm="ed25519")
        out[site] = LedgerSigner.from_files(*pki.site_paths(root, site))
    return out


def test_a_release_of_one_file_runs_the_generic_path(
    registered: ReleaseKind, signers: dict[str, LedgerSigner], tmp_path: Path
) -> None:
    release = release_kind(CountOver65.name).build(None)  # type: ignore[misc]
    assert isinstance(release, CountOver65)
    # Its masked-vector segment is in the egress manifest: DP, under its ledger purpose.
    segment = egress.SEGMENT_KINDS[release.name]
    assert (segment.protection, segment.ledger_purpose) == (egress.Protection.DP, "statistics")

    rng = np.random.default_rng(3)
    sites = {s: Site(rng.integers(20, 95, size=n)) for s, n in
             zip(signers, (40, 55, 70), strict=True)}
    federation = make_federation(3, threshold=2, vector_length=release.length,
                                 round_number=ROUND)
    plan = release.plan(n_noise=3)  # every site honest: all three shares count
    ledgers, vectors, truth = {}, {}, 0
    for site, data in sites.items():
        ledgers[site] = PrivacyLedger(
            tmp_path / f"{site}.db", site_id=site, budget_epsilon=8.0, delta=1e-5,
            privacy_unit="patient", signer=signers[site],
        )
        exact = release.query(data)
        truth += int(exact[0])
        vectors[site] = release_vector(release, exact, plan, ledger=ledgers[site],
                                       round_number=ROUND, n_sites=3, now=NOW)
    total, survivors = run_round(federation, vectors)
    assert set(survivors) == set(sites)

    # Each site's ledger holds exactly this release: its purpose, its mechanism, and
    # the epsilon the accountant gives that mechanism alone.
    for ledger in ledgers.values():
        (entry,) = ledger.entries()
        assert (entry.round, entry.purpose) == (ROUND, "statistics")
        assert entry.mechanisms == (plan.mechanism(),)
        (mechanism,) = entry.mechanisms
        assert mechanism.noise_variance_per_site == pytest.approx(SIGMA**2 / 3)
        expected = compose_epsilon([plan.mechanism()], delta=1e-5, accountant=ledger.accountant)
        assert entry.epsilon_after == pytest.approx(expected)
        assert 0 < entry.epsilon_after < 8.0

    # The coordinator's generic decode: the exact signed sum of what the sites sent ...
    count, noise_sigma = read_sum(release, total, contributors=3, noise_sites=3,
                                  round_number=ROUND).value
    sent = sum(int(ring_to_signed(v)[0]) for v in vectors.values())
    assert count == sent
    # ... which is the true count plus the sites' noise (three shares of variance
    # SIGMA^2 / 3 each: std SIGMA, as the coordinator computes it).
    assert noise_sigma == pytest.approx(SIGMA)
    assert [noise_sigma] == sum_noise_sigmas(release, contributors=3, noise_sites=3)
    assert abs(count - truth) <= 6 * noise_sigma
    # Kept by the coordinator as JSON under its state (no keeper written for it).
    kept = json.loads(keep_json(tmp_path, release, (count, noise_sigma), ROUND).read_text())
    assert kept == {"release": release.name, "round": ROUND, "value": [count, noise_sigma]}


def test_a_release_names_a_ledger_purpose_and_one_round_kind(registered: ReleaseKind) -> None:
    with pytest.raises(ValidationError, match="registered twice"):
        register_release(ReleaseKind(
            name=CountOver65.name, purpose=Purpose.EVALUATION, build=CountOver65,
            mechanism="m", description="d"))
    with pytest.raises(ValidationError, match="unknown ledger purpose"):
        register_release(ReleaseKind(
            name="test_bad_purpose", purpose="queries",  # type: ignore[arg-type]
            build=CountOver65, mechanism="m", description="d"))
    with pytest.raises(ValidationError, match="already carries a release"):
        register_release(ReleaseKind(
            name="test_other", purpose=Purpose.STATISTICS, build=CountOver65,
            mechanism="m", description="d", round_kind="statistics"))
    assert "test_bad_purpose" not in RELEASES and "test_other" not in RELEASES
    with pytest.raises(ValidationError, match="expected 1"):
        CountOver65().encode(np.zeros(2, dtype=np.int64))


def test_a_release_round_names_its_release_on_the_wire(registered: ReleaseKind) -> None:
    """A release run as a round of its own (`KIND_RELEASE`) reaches the site through the
    one announcement: named on the wire, bound into the digest, validated like the
    statistics round (a study, no model, secure aggregation)."""
    own = register_release(dataclasses.replace(
        registered, name="test_own_round", round_kind=KIND_RELEASE))
    try:
        ann = Announcement(
            round_number=9, round_nonce=bytes(range(16)), participants=("a", "b", "c"),
            threshold=2, neighbours=0, vector_length=1, quantization_bits=20, clip=1.0,
            histogram_bins=2, secure_aggregation=True, model_layout=(), model_sha256=b"",
            model_bytes=0, local_epochs=0, learning_rate=0.1, fedprox_mu=0.0,
            planned_rounds=1, train_deadline_ms=1, phase_timeout_ms=30_000, weight_cap=1,
            study_sha256=bytes(32), kind=KIND_RELEASE, release_name=own.name,
        )
        back = wire.announcement_from_pb(wire.announcement_to_pb(ann))
        assert back == ann and back.release == own.name
        assert back.manifest().kinds() == (own.name,)
        policy = SitePolicySection(max_colluding_sites=0)
        rnd = validate_for_site(back, policy=policy, site_id="b")
        assert rnd.params is not None and rnd.params.announcement_digest == ann.digest()
        other = dataclasses.replace(ann, release_name=registered.name)
        assert other.digest() != ann.digest()
        # A name registered for no round of its own, or for none at all, is refused.
        for name in (registered.name, "nobody_registered_this"):
            with pytest.raises(ValidationError, match="registered"):
                validate_for_site(dataclasses.replace(ann, release_name=name),
                                  policy=policy, site_id="b")
        with pytest.raises(ValidationError, match="names its release"):
            validate_for_site(dataclasses.replace(ann, release_name=""), policy=policy,
                              site_id="b")
    finally:
        RELEASES.pop(own.name, None)
        egress.SEGMENT_KINDS.pop(own.name, None)


@pytest.mark.parametrize(("contributors", "expected_ratio"), [(2, 1.0), (3, 1.5**0.5),
                                                              (5, 2.5**0.5)])
def test_the_sum_noise_is_read_from_the_n_noise_every_member_planned_for(
    contributors: int, expected_ratio: float,
) -> None:
    """Every member of a study with a round floor of 3 and one colluding site plans for
    n_noise = 2 shares, whatever the round's size: a sum over 5 sites carries 2.5 shares'
    worth of variance (sigma^2 * 5 / 2), one over 2 survivors exactly sigma^2. Reading it
    as n_noise = K - T (the coordinator's old assumption) understated a 5-site sum's
    noise by a factor 1.41 (intervals too narrow) and overstated a 2-survivor one's."""
    from common.releases.seam import planned_noise_sites, sum_noise_sigmas

    n_noise = planned_noise_sites(min_round_sites=3, max_colluding_sites=1)
    assert n_noise == 2
    release = CountOver65()
    (sigma,) = sum_noise_sigmas(release, contributors=contributors, noise_sites=n_noise)
    assert sigma == pytest.approx(SIGMA * expected_ratio)
    # What the sites add, drawn: each N_Z(0, SIGMA^2 / 2), K of them.
    plan = release.plan(n_noise=n_noise)
    draws = np.array([sum(int(plan.noise(np.random.default_rng(1000 * i + k).bytes)[0])
                          for k in range(contributors)) for i in range(3000)])
    assert draws.std() == pytest.approx(sigma, rel=0.06)


def test_the_releases_are_the_modules_of_the_plugins_folder_named_as_they_register() -> None:
    """Both services and the egress docs load the releases from one folder, by file
    name: a new release is one module there, named as the release it registers."""
    folder = Path(__file__).resolve().parents[2] / "common/releases/plugins"
    files = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    assert load_releases() == tuple(files)
    assert files == ["evaluation_histogram", "query", "statistics"]
    for name in files:
        kind = release_kind(name)
        assert kind.name == name
        assert egress.SEGMENT_KINDS[name].protection == egress.Protection.DP
    assert [k.name for k in RELEASES.values() if k.once_per_study] == ["statistics"]
