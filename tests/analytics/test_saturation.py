"""An approved query cannot reveal an exact count by failing: a site's cell past the
public cap (`MAX_SITE_VALUE`) saturates instead of refusing the query before any ledger
entry, one patient still moves the vector by at most the block's sensitivity, and the
answer flags a statistic whose sum may hold a capped cell."""

from __future__ import annotations

import numpy as np

from common.crypto.quantize import max_integer_for_sites
from common.crypto.random import numpy_generator, system_random
from common.releases.analytics.answer import answer_query
from common.releases.analytics.vector import (
    MAX_SITE_VALUE,
    block_slices,
    noise_sigmas,
    query_blocks,
    site_vector,
)
from common.releases.egress import STATISTICS, WEIGHT, EgressManifest, VectorSegment
from common.study import study_sha256
from tests.analytics.helpers import Row, followup_study, query_of, table_of

STUDY = followup_study()
STEPS = 10_000
FINE_MEAN = query_of(f"""
name = "fine-age"
study_sha256 = "{study_sha256(STUDY)}"

[[statistics]]
name = "age"
kind = "mean"
feature = "Age (years)"
range = [0, 100]
resolution = 0.01
epsilon = 0.5
""", STUDY)


def patients_aged_100(n: int) -> list[Row]:
    return [(f"P{i}", 100.0, "F", 1.0, 10.0, "icu", "alive") for i in range(n)]


def test_attack_query_reveals_an_exact_count_by_failing() -> None:
    """A mean at 10,000 steps: 26,800 patients aged 100 sum to 268,000,000 (below the
    cap, 2^28), 26,900 to 269,000,000 (above). Both sites answer (the one above was
    refused before, so which sites dropped out said which held more than 26,843
    patients); one patient more moves the vector by at most the block's sensitivity K."""
    below = site_vector(FINE_MEAN, table_of(patients_aged_100(26_800)), study=STUDY)
    above = site_vector(FINE_MEAN, table_of(patients_aged_100(26_900)), study=STUDY)
    one_more = site_vector(FINE_MEAN, table_of(patients_aged_100(26_901)), study=STUDY)
    cells = block_slices(FINE_MEAN, study=STUDY)["age"]
    assert below[cells].tolist() == [26_800 * STEPS, 0, 0]
    assert above[cells].tolist() == [MAX_SITE_VALUE, 0, 0]
    (block,) = query_blocks(FINE_MEAN, study=STUDY, n_noise=2)
    step = np.abs(one_more - above).astype(np.float64)
    assert step.sum() <= block.l1_sensitivity and np.sqrt((step**2).sum()) <= block.l2_sensitivity


def test_the_answer_flags_a_statistic_whose_sum_may_hold_a_capped_cell() -> None:
    sigmas = noise_sigmas(query_blocks(FINE_MEAN, study=STUDY, n_noise=2), contributors=3)
    small = site_vector(FINE_MEAN, table_of(patients_aged_100(100)), study=STUDY)
    capped = site_vector(FINE_MEAN, table_of(patients_aged_100(26_900)), study=STUDY)
    clear = answer_query(FINE_MEAN, 3 * small, study=STUDY, noise_sigmas=sigmas,
                         contributors=3).statistic("age")
    assert not any("cap" in note for note in clear.notes)
    doubtful = answer_query(FINE_MEAN, capped + 2 * small, study=STUDY, noise_sigmas=sigmas,
                            contributors=3).statistic("age")
    assert any("cap" in note for note in doubtful.notes)
    assert all(estimate.flagged for estimate in doubtful.estimates)


def test_integers_past_the_ring_range_saturate_instead_of_refusing() -> None:
    """A noised count a site's data pushes past what `n_sites` can sum without wrapping
    is sent saturated, never refused (a refusal would be a dropout)."""
    manifest = EgressManifest((VectorSegment(WEIGHT, 1), VectorSegment(STATISTICS, 3)))
    limit = max_integer_for_sites(8) // 2
    out = manifest.encode({WEIGHT: [5], STATISTICS: [limit + 10, -limit - 3, 7]},
                          clip=1.0, bits=1, n_sites=8, rng=numpy_generator(system_random))
    sums = manifest.decode_integers(out)
    assert sums[STATISTICS].tolist() == [limit, -limit, 7] and sums[WEIGHT].tolist() == [5]
