"""Parameters, threat-model inequalities, the neighbour graph, session ids, phases."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import ConfigError
from common.protocol.secagg.graph import adjacency_is_symmetric, neighbourhoods
from common.protocol.secagg.messages import RosterEntry, advertise_message, survivors_message
from common.protocol.secagg.params import (
    COMPLETE_GRAPH_MAX_SITES,
    NO_ANNOUNCEMENT_DIGEST,
    SecAggParams,
    ThreatModel,
    choose_parameters,
    minimum_threshold,
    round_floor,
    validate_against_threat_model,
)
from common.protocol.secagg.phases import TERMINAL_PHASES, TRANSITIONS, Phase
from common.protocol.secagg.session import session_id

NONCE = bytes(range(16))


def params(**overrides: object) -> SecAggParams:
    base: dict[str, object] = {
        "round_number": 3,
        "round_nonce": NONCE,
        "participants": ("a", "b", "c", "d", "e"),
        "threshold": 3,
        "neighbours": 0,
        "vector_length": 10,
    }
    base.update(overrides)
    return SecAggParams(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round_number", -1),
        ("round_nonce", b"short"),
        ("participants", ("b", "a")),
        ("participants", ("a", "a", "b")),
        ("participants", ("a",)),
        ("threshold", 0),
        ("threshold", 6),
        ("neighbours", -2),
        ("vector_length", 0),
        ("announcement_digest", b""),
        ("announcement_digest", bytes(31)),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        params(**{field: value})
    assert caught.value.field == field


def test_harary_degree_must_be_even() -> None:
    sites = tuple(f"s{i:02d}" for i in range(10))
    with pytest.raises(ConfigError) as caught:
        params(participants=sites, neighbours=3, threshold=2)
    assert caught.value.field == "neighbours"
    assert params(participants=sites, neighbours=4, threshold=3).neighbourhood_size == 5


def test_threat_model_rejects_a_threshold_the_coordinator_could_beat() -> None:
    # n = 5, T = 1: need t > 1 and 2t > 6, i.e. t >= 4; D = 1 allows t <= 4.
    threat = ThreatModel(max_colluding_sites=1, max_dropouts=1)
    validate_against_threat_model(params(threshold=4), threat)
    with pytest.raises(ConfigError, match="too small"):
        validate_against_threat_model(params(threshold=3), threat)
    with pytest.raises(ConfigError, match="too large"):
        validate_against_threat_model(
            params(threshold=5), ThreatModel(max_colluding_sites=1, max_dropouts=1)
        )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 2000),
    colluding=st.integers(0, 10),
    dropouts=st.integers(0, 10),
)
def test_chosen_parameters_satisfy_every_inequality(n: int, colluding: int, dropouts: int) -> None:
    threat = ThreatModel(max_colluding_sites=colluding, max_dropouts=dropouts)
    try:
        t, k = choose_parameters(n, threat)
    except ConfigError:
        # Only when even the complete graph is too small for this threat.
        assert minimum_threshold(neighbourhood_size=n, colluding=colluding) > n - dropouts
        return
    m = n if k == 0 else k + 1
    assert t > colluding and 2 * t > m + colluding and t <= m - dropouts
    if n <= COMPLETE_GRAPH_MAX_SITES:
        assert k == 0
    if k:
        assert k % 2 == 0 and k < n - 1
    sites = tuple(f"s{i:04d}" for i in range(n))
    validate_against_threat_model(
        SecAggParams(
            round_number=1,
            round_nonce=NONCE,
            participants=sites,
            threshold=t,
            neighbours=k,
            vector_length=1,
        ),
        threat,
    )


def test_large_federations_get_logarithmic_neighbourhoods() -> None:
    threat = ThreatModel(max_colluding_sites=2, max_dropouts=3)
    _, k100 = choose_parameters(100, threat)
    _, k1000 = choose_parameters(1000, threat)
    assert 0 < k100 <= 30 and 0 < k1000 <= 40
    assert choose_parameters(10, threat)[1] == 0
    assert choose_parameters(100, threat, neighbours=12)[1] == 12


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 60), k=st.integers(1, 30), seed=st.binary(min_size=32, max_size=32))
def test_graph_is_symmetric_k_regular_and_deterministic(n: int, k: int, seed: bytes) -> None:
    k = 2 * k
    sites = [f"s{i:02d}" for i in range(n)]
    graph = neighbourhoods(seed, sites, k)
    assert graph == neighbourhoods(seed, list(reversed(sites)), k)
    assert adjacency_is_symmetric(graph)
    expected_degree = n - 1 if k >= n - 1 else k
    for site, peers in graph.items():
        assert site not in peers
        assert len(peers) == expected_degree == len(set(peers))


def test_graph_depends_on_the_session_id() -> None:
    sites = [f"s{i:02d}" for i in range(30)]
    graphs = {tuple(sorted(neighbourhoods(bytes([i]) * 32, sites, 4).items())) for i in range(5)}
    assert len(graphs) == 5
    complete = neighbourhoods(b"x" * 32, sites, 0)
    assert all(len(peers) == 29 for peers in complete.values())


def _entry(site: str, byte: int) -> RosterEntry:
    return RosterEntry(site, bytes([byte]) * 32, bytes([byte + 1]) * 32, b"sig", b"cert")


def test_session_id_binds_params_and_every_roster_key() -> None:
    roster = [_entry("a", 1), _entry("b", 3), _entry("c", 5)]
    base = session_id(params(), roster)
    assert len(base) == 32
    assert session_id(params(), list(reversed(roster))) == base  # order-free
    variants = [
        session_id(params(round_number=4), roster),
        session_id(params(round_nonce=bytes(16)), roster),
        session_id(params(threshold=4), roster),
        session_id(params(vector_length=11), roster),
        session_id(params(announcement_digest=b"\x01" * 32), roster),
        session_id(params(participants=("a", "b", "c", "d", "f")), roster),
        session_id(params(), roster[:2]),
        session_id(
            params(), [*roster[:2], dataclasses.replace(roster[2], masking_public_key=bytes(32))]
        ),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_advertise_signature_binds_the_announcement() -> None:
    message = functools.partial(
        advertise_message,
        round_number=3,
        round_nonce=NONCE,
        site_id="a",
        encryption_public_key=bytes(32),
        masking_public_key=b"\x01" * 32,
    )
    assert message() == message(announcement_digest=NO_ANNOUNCEMENT_DIGEST)
    assert message() != message(announcement_digest=b"\x01" * 32)


@pytest.mark.parametrize(
    ("min_round_sites", "colluding", "floor"),
    [(3, 0, 3), (3, 1, 3), (3, 2, 4), (5, 1, 5), (2, 0, 2)],
)
def test_round_floor_is_the_larger_of_policy_and_t_plus_two(
    min_round_sites: int, colluding: int, floor: int
) -> None:
    assert round_floor(min_round_sites=min_round_sites, max_colluding_sites=colluding) == floor


@pytest.mark.parametrize(("field", "value"), [("min_round_sites", 1), ("max_colluding_sites", -1)])
def test_round_floor_refuses_nonsense(field: str, value: int) -> None:
    arguments = {"min_round_sites": 3, "max_colluding_sites": 1, field: value}
    with pytest.raises(ConfigError) as caught:
        round_floor(**arguments)
    assert caught.value.field == field


def test_survivor_message_is_injective_across_the_list_boundary() -> None:
    sid = bytes(32)
    a = survivors_message(round_number=1, session_id=sid, survivors=("x", "y"), dropped=())
    b = survivors_message(round_number=1, session_id=sid, survivors=("x",), dropped=("y",))
    c = survivors_message(round_number=1, session_id=sid, survivors=("x", "|"), dropped=())
    d = survivors_message(round_number=1, session_id=sid, survivors=("x",), dropped=("|",))
    assert len({a, b, c, d}) == 4


def test_transition_table_is_a_chain_with_abort_from_every_live_phase() -> None:
    live = [p for p in Phase if p not in TERMINAL_PHASES]
    for phase in live:
        assert Phase.ABORTED in TRANSITIONS[phase]
        assert len(TRANSITIONS[phase]) == 2
    for phase in TERMINAL_PHASES:
        assert TRANSITIONS[phase] == frozenset()
    chain = [*live, Phase.COMPLETED]
    for before, after in itertools.pairwise(chain):
        assert after in TRANSITIONS[before]
