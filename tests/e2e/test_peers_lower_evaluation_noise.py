"""Attack, over real processes: peers' own settings lowered the noise a site's ledger
accounts for. Each site used to add its share of the DP evaluation histogram's noise
from its own `privacy.evaluation_noise_std` (and, before that, its own collusion bound
and round floor): a peer configured for less noise left the secure sum with less honest
noise than every other site's ledger recorded.

Three hospitals with different configurations (defaults; an old config asking
`evaluation_noise_std = 2.5` with the RDP accountant; one asking 5 under a laxer
collusion bound and round floor) run one study that sets `[privacy.evaluation]
noise_std`. Each site's masked-vector plaintext (test instrumentation) and the
coordinator's unmasked sum are read back: every site's histogram carries the study's
noise share whatever its configuration, the sum is exactly the sites' noised
histograms, and the noise in it that a site can count on (its own share and the
weakest peer's, the other possibly colluding) is what its ledger entry records.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from common.core.processes import ManagedProcess
from common.privacy.ledger import read_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.study import load_study
from coordinator.store import CoordinatorStore
from site_agent.approvals import Approvals
from site_agent.dp_release import PURPOSE_EVALUATION
from tests.e2e.harness import StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

SITES = ["alpha", "beta", "gamma"]
NOISE_STD = 500.0
"""The study's noise per summed count: far above any held-out count (~20 patients a
site over 400 buckets), so a site's noised histogram is its noise share to within a
part in 10^5 of its variance."""
BINS = 200
"""Score buckets: 400 counts a site, so a share's variance is estimated to ~7%."""
CONFIGS = {
    "alpha": "",
    "beta": '[privacy]\nevaluation_noise_std = 2.5\naccountant = "rdp"\n',
    "gamma": ("[privacy]\nevaluation_noise_std = 5.0\n\n"
              "[policy]\nmax_colluding_sites = 0\nmin_round_sites = 2\n"),
}


def histogram_words(path: Path, length: int) -> np.ndarray:
    """The last `length` words of a round's ring vector: its score histogram."""
    words = np.fromfile(path, dtype="<u4")
    return words[-length:]


def signed(words: np.ndarray) -> np.ndarray:
    return words.view(np.int32).astype(np.int64)


def test_attack_peers_lower_evaluation_noise(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    files = hospital_csvs(tmp_path, SITES, n_patients=100)
    pki = make_pki(tmp_path, SITES)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("evaluation-noise", rounds=1) + (
        f"\n[privacy.evaluation]\nhistogram_bins = {BINS}\nnoise_std = {NOISE_STD}\n"))
    study = load_study(list_members(study_path, pki, SITES))
    assert study.privacy.evaluation.noise_std == NOISE_STD

    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    coordinator = run.start_coordinator("--exit-when-finished", "--linger-seconds", "5",
                                        "--debug-write-aggregates")
    agents = {}
    for site in SITES:
        state = run.site_state(site)
        state.mkdir(parents=True)
        Approvals(state).approve_study(study)  # each hospital approved the study
        config = tmp_path / f"{site}.toml"
        config.write_text(CONFIGS[site])
        agents[site] = run.start_site(site, files[site], "--config", str(config),
                                      "--debug-write-updates")
    for site, proc in agents.items():
        assert proc.wait_exit(timeout=1300) == 0, f"{site}:\n{proc.tail(30)}"
    assert coordinator.wait_exit(timeout=120) == 0, coordinator.tail(30)

    # Each ledger's one DP evaluation: the study's noise, whatever the site's setting.
    entries = {}
    for site in SITES:
        _, ledger = read_ledger(run.site_state(site) / "privacy-ledger.db")
        (entry,) = [e for e in ledger if e.purpose == PURPOSE_EVALUATION]
        (mechanism,) = entry.mechanisms
        assert isinstance(mechanism, DistributedDiscreteGaussian)
        assert mechanism.contributors == 2  # the study's floor 3 minus 1 colluding site
        assert mechanism.noise_variance_per_site == pytest.approx(NOISE_STD**2 / 2)
        entries[site] = (entry.round, mechanism)
    (number,) = {r for r, _ in entries.values()}
    length = entries[SITES[0]][1].dimension
    assert length == 2 * BINS

    # What each site put in the sum, and the sum the coordinator unmasked.
    shares = {site: histogram_words(
        run.site_state(site) / "debug-updates" / f"round-{number:06d}.u32", length)
        for site in SITES}
    folder = run.state / "aggregates"
    assert sorted((folder / f"round-{number:06d}.survivors").read_text().split()) == SITES
    total = histogram_words(folder / f"round-{number:06d}.u32", length)
    ring = np.sum([w.astype(np.uint64) for w in shares.values()], axis=0) % (1 << 32)
    assert np.array_equal(total.astype(np.uint64), ring)  # the sum is exactly these shares

    variances = {site: float(np.var(signed(words), ddof=1)) for site, words in shares.items()}
    for site in SITES:
        # Every site added the study's share (std 500 / sqrt(2)); before, each added
        # its own setting's: alpha std 7.1, beta 1.8, gamma 3.5.
        share = NOISE_STD**2 / 2
        assert 0.7 * share < variances[site] < 1.4 * share, (site, variances)
    for site, (_, mechanism) in entries.items():
        # The noise this site can count on: its own share and the weakest other one
        # (the study assumes one colluding site, which knows its own noise). Its ledger
        # recorded n_noise shares of its variance; before, alpha's ledger recorded std
        # 10 and it could count on 7.5.
        others = sorted(v for s, v in variances.items() if s != site)
        honest = variances[site] + others[0]
        recorded = mechanism.contributors * mechanism.noise_variance_per_site
        assert honest > 0.8 * recorded, (site, honest, recorded)
    # The coordinator read the round with the noise the three ledgers recorded.
    store = CoordinatorStore(f"sqlite:///{run.state / 'coordinator.db'}")
    try:
        (record,) = [r for r in store.rounds() if r.round_number == number]
    finally:
        store.close()
    assert record.metrics["auc_noise_std"] == pytest.approx(
        math.sqrt(len(SITES) * NOISE_STD**2 / 2))
