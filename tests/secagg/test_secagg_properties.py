"""Property tests: random federations, graphs and dropout patterns give the exact sum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from secagg_harness import make_federation, plaintext_sum, random_inputs, run_round

from common.core.errors import ProtocolAbort
from common.crypto.quantize import bits_for_sites, dequantize_sum, quantize
from common.protocol.secagg.phases import Phase

DROP_PHASES = [
    Phase.ADVERTISE_KEYS,
    Phase.SHARE_KEYS,
    Phase.MASKED_INPUT,
    Phase.CONSISTENCY_CHECK,
    Phase.UNMASK,
]
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def round_setups(draw: st.DrawFn, *, tolerable: bool) -> tuple[int, int, int, dict[str, Phase]]:
    """(n, t, k, dropouts). `tolerable`: at most m - t dropouts (m = k + 1 holders)."""
    n = draw(st.integers(3, 12))
    complete = n < 5 or draw(st.booleans())
    k = 0 if complete else draw(st.sampled_from([k for k in range(2, n - 1, 2)]))
    m = n if k == 0 else k + 1
    t = draw(st.integers(2, m))
    limit = m - t if tolerable else n
    drop_count = draw(st.integers(0, limit))
    dropped = draw(st.permutations(range(n)))[:drop_count]
    phases = draw(st.lists(st.sampled_from(DROP_PHASES), min_size=drop_count, max_size=drop_count))
    return n, t, k, {f"site-{i:03d}": phase for i, phase in zip(dropped, phases)}


@SETTINGS
@given(setup=round_setups(tolerable=True), seed=st.integers(0, 2**16))
def test_sum_is_exact_in_the_ring_whenever_dropouts_are_tolerable(
    setup: tuple[int, int, int, dict[str, Phase]], seed: int
) -> None:
    n, t, k, dropouts = setup
    federation = make_federation(n, threshold=t, neighbours=k, seed=seed.to_bytes(4, "big"))
    inputs = random_inputs(federation.params, seed)
    total, survivors = run_round(federation, inputs, dropouts=dropouts)
    # Survivors are exactly the sites whose masked input arrived.
    expected_survivors = tuple(
        site
        for site in federation.params.participants
        if site not in dropouts or dropouts[site] in (Phase.CONSISTENCY_CHECK, Phase.UNMASK)
    )
    assert survivors == expected_survivors
    np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))
    assert federation.server is not None and federation.server.phase is Phase.COMPLETED


@SETTINGS
@given(setup=round_setups(tolerable=False), seed=st.integers(0, 2**16))
def test_any_dropout_pattern_gives_exact_sum_or_a_clean_abort(
    setup: tuple[int, int, int, dict[str, Phase]], seed: int
) -> None:
    n, t, k, dropouts = setup
    federation = make_federation(n, threshold=t, neighbours=k, seed=seed.to_bytes(4, "big"))
    inputs = random_inputs(federation.params, seed)
    completers = n - len(dropouts)
    try:
        total, survivors = run_round(federation, inputs, dropouts=dropouts)
    except ProtocolAbort:
        # Whoever detected it (the server, or a site whose neighbourhood became too
        # small to protect it) is terminally aborted; no sum was returned.
        assert federation.server is not None
        parties = [federation.server, *federation.clients.values()]
        assert any(party.phase is Phase.ABORTED for party in parties)
        return
    # Fewer than t sites took part to the end: no round may complete.
    assert completers >= t
    np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 10),
    seed=st.integers(0, 2**16),
    phases=st.lists(st.sampled_from(DROP_PHASES), min_size=12, max_size=12),
)
def test_fewer_than_t_survivors_abort_and_reveal_no_sum(
    n: int, seed: int, phases: list[Phase]
) -> None:
    t = n // 2 + 1
    federation = make_federation(n, threshold=t, seed=seed.to_bytes(4, "big"))
    inputs = random_inputs(federation.params, seed)
    # n - t + 1 sites drop at random phases: at most t - 1 finish the round.
    dropouts = {f"site-{i:03d}": phases[i] for i in range(n - t + 1)}
    with pytest.raises(ProtocolAbort):
        run_round(federation, inputs, dropouts=dropouts)
    assert federation.server is not None
    assert federation.server.phase is Phase.ABORTED


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 8),
    seed=st.integers(0, 2**16),
    drop_phase=st.sampled_from(DROP_PHASES),
)
def test_dequantized_sum_matches_float_sum_within_one_step_per_site(
    n: int, seed: int, drop_phase: Phase
) -> None:
    clip, length = 1.0, 64
    bits = bits_for_sites(n)
    federation = make_federation(
        n, threshold=n - 1, vector_length=length, seed=seed.to_bytes(4, "big")
    )
    generator = np.random.default_rng(seed)
    floats = {
        site: generator.uniform(-clip, clip, size=length) for site in federation.params.participants
    }
    inputs = {
        site: quantize(x, clip=clip, bits=bits, rng=generator, out=np.empty(length, np.uint32))
        for site, x in floats.items()
    }
    total, survivors = run_round(federation, inputs, dropouts={"site-000": drop_phase})
    decoded = dequantize_sum(total, clip=clip, bits=bits, count=len(survivors))
    expected = sum(floats[site] for site in survivors)
    step = 2 * clip / ((1 << bits) - 1)
    assert np.max(np.abs(decoded - expected)) <= len(survivors) * step + 1e-9


@SETTINGS
@given(setup=round_setups(tolerable=True), seed=st.integers(0, 2**16), data=st.data())
# Neighbours that sent no shares on either side of every site id (masks to take out
# with both signs), and one that dropped after sending them.
@example(setup=(5, 3, 0, {"site-000": Phase.SHARE_KEYS}), seed=1, data=None)
@example(setup=(5, 3, 0, {"site-004": Phase.SHARE_KEYS}), seed=2, data=None)
@example(setup=(6, 3, 0, {"site-002": Phase.SHARE_KEYS, "site-005": Phase.MASKED_INPUT}),
         seed=3, data=None)
def test_masks_prepared_before_the_input_give_the_same_masked_vectors(
    setup: tuple[int, int, int, dict[str, Phase]], seed: int, data: st.DataObject | None
) -> None:
    """`prepare_masks` (masks expanded while ShareKeys is in flight, for every neighbour)
    changes nothing a site sends, also when neighbours drop before sending shares."""
    n, t, k, dropouts = setup
    sent: list[dict[str, np.ndarray]] = []
    everyone = {f"site-{i:03d}" for i in range(n)}
    prepared = everyone if data is None else data.draw(st.sets(st.sampled_from(sorted(everyone))))
    for sites in ((), prepared):
        federation = make_federation(n, threshold=t, neighbours=k, seed=seed.to_bytes(4, "big"))
        inputs = random_inputs(federation.params, seed)
        masked: dict[str, np.ndarray] = {}
        total, survivors = run_round(federation, inputs, dropouts=dropouts, prepared=sites,
                                     masked_inputs=masked)
        np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))
        sent.append(masked)
    assert sent[0].keys() == sent[1].keys()
    for site, vector in sent[0].items():
        np.testing.assert_array_equal(sent[1][site], vector)
