"""Unmask never yields a silently wrong sum (common/protocol/secagg/reconstruction.py).

A participant that reveals well-formed but wrong Shamir y-values at Unmask is either
corrected (enough right shares remain: the sum is exact and the holder is named in
`SecAggServer.misbehaving_sites`) or the round aborts with RECONSTRUCTION_FAILED and
no sum. Same for an owner whose ShareKeys commitment does not match its b_u: its own
seed can never pass the check, so the round aborts (nobody else is blamed).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from secagg_harness import make_federation, plaintext_sum, random_inputs, run_round

from common.core.errors import AbortReason, CryptoError, ProtocolAbort, ValidationError
from common.crypto.random import DeterministicRandom
from common.crypto.shamir import PRIME, SECRET_BYTES, SHARE_BYTES, split_secrets
from common.protocol.secagg.messages import ShareKeysOut, UnmaskShares, self_mask_commitment
from common.protocol.secagg.phases import Phase
from common.protocol.secagg.reconstruction import MAX_SUBSETS, blame_radius, reconstruct_checked
from common.rounds import wire


def forge_unmask(*forgers: str, value: bytes | None = None):  # type: ignore[no-untyped-def]
    """`outgoing` hook: the forgers replace every revealed y-value by another valid
    field element (below 2**256 < PRIME), keeping owners and kinds."""

    def rewrite(site: str, message: object) -> object:
        if site not in forgers or not isinstance(message, UnmaskShares):
            return message
        generator = DeterministicRandom(b"forged-" + site.encode())
        return UnmaskShares(
            shares=tuple(
                replace(share, share=value or bytes(1) + generator(SHARE_BYTES - 1))
                for share in message.shares
            )
        )

    return rewrite


def revealed_owners(federation, site: str, survivors, dropped) -> set[str]:  # type: ignore[no-untyped-def]
    """Owners `site` reveals a share of: its closed neighbourhood among those listed."""
    closed = {site, *federation.server.graph[site]}
    return closed & (set(survivors) | set(dropped))


# ------------------------------------------------------------ whole rounds


@pytest.mark.parametrize(
    ("n", "threshold", "neighbours", "forger", "dropped"),
    [
        (4, 3, 0, "site-000", None),  # m = t + 1: only the subset search can correct
        (7, 4, 0, "site-000", None),  # Berlekamp-Welch radius 1
        (7, 4, 0, "site-006", None),  # not among the first t: the fast path spots it
        (6, 3, 0, "site-001", "site-005"),  # also a dropped site's mask-key shares
        (12, 4, 6, "site-003", "site-007"),  # SecAgg+ neighbourhoods (k = 6)
    ],
)
def test_wrong_shares_from_one_holder_are_corrected_and_the_holder_named(
    n: int, threshold: int, neighbours: int, forger: str, dropped: str | None
) -> None:
    federation = make_federation(n, threshold=threshold, neighbours=neighbours, seed=b"rob")
    inputs = random_inputs(federation.params, seed=n)
    dropouts = {dropped: Phase.MASKED_INPUT} if dropped else {}
    total, survivors = run_round(
        federation, inputs, dropouts=dropouts, outgoing=forge_unmask(forger)
    )
    assert np.array_equal(total, plaintext_sum(inputs, survivors))
    server = federation.server
    assert server is not None and server.phase is Phase.COMPLETED
    owners = revealed_owners(federation, forger, survivors, [dropped] if dropped else [])
    assert dict(server.misbehaving_sites) == {forger: tuple(sorted(owners))}


def test_honest_round_names_nobody() -> None:
    federation = make_federation(12, threshold=4, neighbours=6, seed=b"honest")
    inputs = random_inputs(federation.params, seed=3)
    total, survivors = run_round(
        federation, inputs, dropouts={"site-002": Phase.MASKED_INPUT}
    )
    assert np.array_equal(total, plaintext_sum(inputs, survivors))
    assert federation.server is not None and federation.server.misbehaving_sites == {}


@pytest.mark.parametrize(
    ("n", "threshold", "forgers"),
    [
        (4, 3, ("site-000", "site-001")),  # 2 honest shares left, t = 3
        (7, 4, ("site-002", "site-004", "site-006", "site-005")),  # 3 honest, t = 4
    ],
)
def test_wrong_shares_from_too_many_holders_abort_without_a_sum(
    n: int, threshold: int, forgers: tuple[str, ...]
) -> None:
    federation = make_federation(n, threshold=threshold, seed=b"many")
    inputs = random_inputs(federation.params, seed=1)
    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, inputs, outgoing=forge_unmask(*forgers))
    assert caught.value.reason is AbortReason.RECONSTRUCTION_FAILED
    server = federation.server
    assert server is not None and server.phase is Phase.ABORTED
    with pytest.raises(ProtocolAbort):
        server.close_unmask()  # no second chance, no partial sum


def test_colluding_holders_that_agree_on_one_wrong_value_are_caught() -> None:
    """Two forgers reveal the same constant: still off the honest polynomial."""
    federation = make_federation(7, threshold=3, seed=b"const")
    inputs = random_inputs(federation.params, seed=2)
    same = bytes(1) + bytes(range(SHARE_BYTES - 1))
    total, survivors = run_round(
        federation, inputs, outgoing=forge_unmask("site-000", "site-001", value=same)
    )
    assert np.array_equal(total, plaintext_sum(inputs, survivors))
    assert federation.server is not None
    assert set(federation.server.misbehaving_sites) == {"site-000", "site-001"}


def test_an_owner_that_commits_to_another_seed_aborts_the_round() -> None:
    """Documented behaviour: a site whose commitment does not match its b_u cannot be
    unmasked (its masked input is already in the sum), so the round aborts; the
    honest holders of its shares are not blamed."""
    federation = make_federation(5, threshold=3, seed=b"liar")

    def lie(site: str, message: object) -> object:
        if site == "site-002" and isinstance(message, ShareKeysOut):
            return replace(message, self_mask_commitment=os.urandom(32))
        return message

    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, random_inputs(federation.params, seed=4), outgoing=lie)
    assert caught.value.reason is AbortReason.RECONSTRUCTION_FAILED
    assert "site-002" in caught.value.detail
    assert federation.server is not None
    assert federation.server.phase is Phase.ABORTED
    assert federation.server.misbehaving_sites == {}


def test_malformed_commitments_and_non_field_shares_are_refused_per_site() -> None:
    """Refused at receipt (the site alone is affected); the round still completes."""
    federation = make_federation(6, threshold=3, seed=b"malformed")
    too_big = PRIME.to_bytes(SHARE_BYTES, "big")

    def misbehave(site: str, message: object) -> object:
        if site == "site-001" and isinstance(message, ShareKeysOut):
            return replace(message, self_mask_commitment=message.self_mask_commitment[:31])
        if site == "site-004" and isinstance(message, UnmaskShares):
            first, *rest = message.shares
            return UnmaskShares(shares=(replace(first, share=too_big), *rest))
        return message

    rejected: list[str] = []
    inputs = random_inputs(federation.params, seed=5)
    total, survivors = run_round(federation, inputs, outgoing=misbehave, rejected=rejected)
    assert rejected == ["site-001", "site-004"]
    assert "site-001" not in survivors and "site-004" in survivors
    assert np.array_equal(total, plaintext_sum(inputs, survivors))


def test_commitment_binds_session_site_and_seed() -> None:
    seed, session = b"\x01" * 32, b"\x02" * 32
    base = self_mask_commitment(seed, session_id=session, site_id="a")
    assert len(base) == 32 and base != hashlib.sha256(seed).digest()
    assert self_mask_commitment(seed, session_id=session, site_id="a") == base
    for other in (
        self_mask_commitment(seed, session_id=b"\x03" * 32, site_id="a"),
        self_mask_commitment(seed, session_id=session, site_id="b"),
        self_mask_commitment(b"\x04" * 32, session_id=session, site_id="a"),
    ):
        assert other != base


def test_wire_carries_the_commitment_and_checks_its_length() -> None:
    out = ShareKeysOut(shares=(), self_mask_commitment=os.urandom(32))
    request = wire.share_keys_to_pb(out, round_number=3, session=b"s" * 32)
    assert wire.share_keys_from_pb(request) == out
    for length in (0, 31, 33):
        request.self_mask_commitment = bytes(length)
        with pytest.raises(ValidationError):
            wire.share_keys_from_pb(request)


# ------------------------------------------------------ the decoder itself


def _shares(secret: bytes, *, count: int, threshold: int, seed: int) -> list[int]:
    rows = split_secrets(
        [secret],
        threshold=threshold,
        xs=list(range(1, count + 1)),
        rng=DeterministicRandom(seed.to_bytes(8, "big")),
    )
    return [int.from_bytes(row[0], "big") for row in rows]


@settings(max_examples=60, deadline=None)
@given(
    threshold=st.integers(1, 6),
    extra=st.integers(0, 6),
    data=st.data(),
    seed=st.integers(0, 2**32),
)
def test_decoder_corrects_or_refuses_never_returns_a_wrong_secret(
    threshold: int, extra: int, data: st.DataObject, seed: int
) -> None:
    count = threshold + extra
    secret = DeterministicRandom(b"secret" + seed.to_bytes(8, "big"))(SECRET_BYTES)
    ys = _shares(secret, count=count, threshold=threshold, seed=seed)
    wrong = data.draw(st.sets(st.integers(0, count - 1), max_size=count), label="wrong")
    for index in wrong:
        forged = data.draw(st.integers(0, PRIME - 1), label="forged y")
        assume(forged != ys[index])
        ys[index] = forged
    xs = list(range(1, count + 1))
    commitment = hashlib.sha256(secret).digest()

    def check(candidate: bytes) -> bool:
        return hashlib.sha256(candidate).digest() == commitment

    honest = count - len(wrong)
    must_correct = len(wrong) <= extra // 2 or (
        honest >= threshold and math.comb(count, threshold) <= MAX_SUBSETS
    )
    try:
        result = reconstruct_checked(xs, ys, threshold=threshold, check=check)
    except CryptoError:
        assert not must_correct
        return
    assert honest >= threshold  # fewer right shares than t can never pass the check
    assert result.secret == secret
    named, guilty = sorted(result.disagreeing), sorted(xs[i] for i in wrong)
    if len(wrong) <= blame_radius(count, threshold):
        assert named == guilty
    else:
        assert set(named) <= set(guilty)


def _interpolate_at(points: list[tuple[int, int]], x: int) -> int:
    """Lagrange value at `x` of the polynomial through `points` (test oracle)."""
    total = 0
    for i, (xi, yi) in enumerate(points):
        term = yi
        for j, (xj, _) in enumerate(points):
            if j != i:
                term = term * (x - xj) * pow(xi - xj, -1, PRIME) % PRIME
        total = (total + term) % PRIME
    return total


@settings(max_examples=80, deadline=None)
@given(
    threshold=st.integers(1, 6),
    extra=st.integers(0, 8),
    data=st.data(),
    seed=st.integers(0, 2**32),
    framing=st.booleans(),
)
def test_named_holders_are_wrong_ones_up_to_the_correctable_number(
    threshold: int, extra: int, data: st.DataObject, seed: int, framing: bool
) -> None:
    """With at most `blame_radius` wrong holders, every holder named
    is a wrong one (and all of them are), and the secret is right, even when the wrong
    holders know the secret and every honest share and *frame* honest holders: they put
    their shares on another polynomial through (0, secret) and t - 2 honest shares, the
    strongest lie that still passes the commitment check."""
    count = threshold + extra
    secret = DeterministicRandom(b"frame" + seed.to_bytes(8, "big"))(SECRET_BYTES)
    ys = _shares(secret, count=count, threshold=threshold, seed=seed)
    xs = list(range(1, count + 1))
    radius = min(blame_radius(count, threshold), count - threshold)
    assume(radius >= 1)
    wrong = data.draw(
        st.sets(st.integers(0, count - 1), min_size=1, max_size=radius), label="wrong"
    )
    honest = [i for i in range(count) if i not in wrong]
    truth = [(xs[i], ys[i]) for i in honest[:threshold]]
    if framing and threshold >= 2:
        # Another polynomial q != p with q(0) = secret through t - 2 honest shares and
        # one free point the liars choose.
        lie = [(0, int.from_bytes(secret, "big"))]
        lie += [(xs[i], ys[i]) for i in honest[: threshold - 2]]
        free_x = count + 1
        free_y = data.draw(st.integers(0, PRIME - 1), label="free y")
        assume(free_y != _interpolate_at(truth, free_x))
        lie.append((free_x, free_y))
        for index in wrong:
            ys[index] = _interpolate_at(lie, xs[index])
    else:
        for index in wrong:
            ys[index] = data.draw(st.integers(0, PRIME - 1), label="forged y")
    # A "lie" that happens to equal the true share is no lie: it cannot be named.
    actually_wrong = {xs[i] for i in wrong if ys[i] != _interpolate_at(truth, xs[i])}
    commitment = hashlib.sha256(secret).digest()
    result = reconstruct_checked(
        xs, ys, threshold=threshold,
        check=lambda candidate: hashlib.sha256(candidate).digest() == commitment,
    )
    assert result.secret == secret
    assert set(result.disagreeing) <= {xs[i] for i in wrong}
    assert set(result.disagreeing) == actually_wrong


def test_colluders_beyond_the_radius_frame_nobody() -> None:
    """m = 5, t = 3, two liars who know the secret put their shares on q with
    q(0) = secret through one honest share: p and q each agree with 3 of 5 shares.
    The secret is right (it passed its check), and nobody is named: the former
    maximum-agreement rule named two honest holders whenever q was found first."""
    secret = b"\x09" * SECRET_BYTES
    ys = _shares(secret, count=5, threshold=3, seed=5)
    xs = [1, 2, 3, 4, 5]
    lie = [(0, int.from_bytes(secret, "big")), (xs[2], ys[2]), (9, 12345)]
    for index in (0, 1):
        ys[index] = _interpolate_at(lie, xs[index])
    commitment = hashlib.sha256(secret).digest()
    result = reconstruct_checked(
        xs, ys, threshold=3, check=lambda c: hashlib.sha256(c).digest() == commitment
    )
    assert result.secret == secret
    assert result.disagreeing == ()


def test_decoder_refuses_consistent_shares_of_an_uncommitted_secret() -> None:
    secret = b"\x05" * SECRET_BYTES
    ys = _shares(secret, count=6, threshold=3, seed=9)
    with pytest.raises(CryptoError):
        reconstruct_checked([1, 2, 3, 4, 5, 6], ys, threshold=3, check=lambda _: False)
    with pytest.raises(ValidationError):
        reconstruct_checked([1, 2], ys[:2], threshold=3, check=lambda _: True)


def test_decoder_beyond_the_radius_searches_pseudo_random_subsets() -> None:
    """m = 23, t = 12 (the n = 100 bench neighbourhood): 6 wrong shares are past the
    Berlekamp-Welch radius 5 and C(23, 12) > MAX_SUBSETS, yet a random 12-subset is
    all right with probability 0.46 %: found within the bounded search."""
    secret = b"\x07" * SECRET_BYTES
    ys = _shares(secret, count=23, threshold=12, seed=11)
    for index in (0, 3, 5, 8, 13, 21):
        ys[index] = (ys[index] + 1) % PRIME
    result = reconstruct_checked(
        list(range(1, 24)), ys, threshold=12, check=lambda s: s == secret
    )
    assert result.secret == secret
    assert result.disagreeing == (1, 4, 6, 9, 14, 22)

