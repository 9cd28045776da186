"""Attack (s5 review): under privacy.intermediaries = "auto" the coordinator computes the
next v from the decoded sum of the clipped unit norms (the norm coordinate). The sum is
linear in the ring: ONE site, without the coordinator, can upload words whose decoded
norm coordinate is large and negative (a noiseless rounded vector, negated k times). The
coordinator projects the estimate onto (0, U S], i.e. to its floor, lambda explodes, and
it announces the cap v = 8 to everyone next round: every honest hospital's
hospital-level epsilon for that round becomes 8-fold group privacy (docs/privacy.md says
only the coordinator is trusted with that choice).

The test asserts the property "one site cannot move the announced v away from what the
honest sites' data give"; it failed before the coordinator's guards on the measurement
(common.privacy.intermediaries `plausible_norm_sum`, `step_bounds`)."""

from __future__ import annotations

import math

import numpy as np

from common.core.config import SitePolicySection
from common.privacy import hospital
from common.rounds.announcement import Announcement, validate_for_site
from coordinator import hospital_sum
from site_agent import hospital as site_hospital
from site_agent.site_training import LocalUpdate
from tests.privacy.test_intermediaries_guards import _announcement, _forged_words

SITES = ("alpha", "beta", "mallory")
DIM, Z, CLIP = 1000, 0.3, 0.5


def _honest_words(ann: Announcement, site: str, delta: np.ndarray) -> np.ndarray:
    policy = SitePolicySection()
    rnd = validate_for_site(ann, policy=policy, site_id=site)
    planned = site_hospital.plan_round(rnd, study=None, policy=policy)
    update = LocalUpdate(delta.astype(np.float32), 50, np.array([1, 2, 3, 4]), 0.0)
    return site_hospital.encode(rnd, update, planned)


def test_one_site_cannot_force_the_largest_v() -> None:
    terms = hospital.HospitalTerms(CLIP, Z, intermediaries=1, norm_segment=True)
    ann = hospital_sum.announce(_announcement(DIM), terms)
    generator = np.random.default_rng(3)
    direction = generator.standard_normal(DIM)
    deltas = [(direction + 0.3 * generator.standard_normal(DIM)) / math.sqrt(DIM)
              for _ in SITES]

    honest = np.zeros(ann.vector_length, np.uint32)
    for site, delta in zip(SITES, deltas, strict=True):
        honest += _honest_words(ann, site, delta)
    v_honest = int(hospital_sum.decode(honest, ann=ann, count=3)
                   .metrics["next_intermediaries"])

    attacked = np.zeros(ann.vector_length, np.uint32)
    for site, delta in zip(SITES[:2], deltas[:2], strict=True):
        attacked += _honest_words(ann, site, delta)
    attacked += _forged_words(ann, k=-40, weight=1)
    decoded = hospital_sum.decode(attacked, ann=ann, count=3)
    v_attacked = int(decoded.metrics["next_intermediaries"])

    assert v_honest < hospital.MAX_AUTO_INTERMEDIARIES  # the honest rule stays below the cap
    assert v_attacked == v_honest, (
        f"one site moved the next round's v from {v_honest} to {v_attacked} (cap "
        f"{hospital.MAX_AUTO_INTERMEDIARIES}); decoded unit norm sum "
        f"{decoded.metrics['unit_norm_sum']:.2f}"
    )
