"""Coordinator state machine: bad input from one site never harms the round."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import numpy as np
import pytest
from secagg_harness import make_federation, plaintext_sum, random_inputs, run_round

from common.core.errors import AbortReason, CryptoError, ProtocolAbort, ValidationError
from common.protocol.secagg.client import PeerStatus
from common.protocol.secagg.messages import (
    ConsistencySignature,
    RevealedShare,
    ShareKind,
    UnmaskShares,
)
from common.protocol.secagg.phases import Phase
from common.protocol.secagg.server import SiteProgress


def advertise_all(federation, skip=()):  # type: ignore[no-untyped-def]
    server = federation.server
    for site, client in federation.clients.items():
        message = client.advertise_keys()
        if site not in skip:
            server.receive_advertisement(
                site, message, certificate_der=federation.certificate(site)
            )
    return server


def test_bad_or_duplicate_advertisement_is_refused_for_that_site_only() -> None:
    federation = make_federation(4, threshold=3)
    server = federation.server
    assert server is not None
    clients = federation.clients
    good = clients["site-000"].advertise_keys()
    server.receive_advertisement(
        "site-000", good, certificate_der=federation.certificate("site-000")
    )
    with pytest.raises(ValidationError):  # replay of the same advertisement
        server.receive_advertisement(
            "site-000", good, certificate_der=federation.certificate("site-000")
        )
    forged = dataclasses.replace(clients["site-001"].advertise_keys(), signature=b"\x00" * 64)
    with pytest.raises(CryptoError):
        server.receive_advertisement(
            "site-001", forged, certificate_der=federation.certificate("site-001")
        )
    with pytest.raises(ValidationError):  # advertisement for another site than the caller
        server.receive_advertisement(
            "site-002", good, certificate_der=federation.certificate("site-002")
        )
    for site in ("site-002", "site-003"):
        server.receive_advertisement(
            site, clients[site].advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    assert [e.site_id for e in roster.entries] == ["site-000", "site-002", "site-003"]
    assert server.status["site-001"].dropped_in is Phase.ADVERTISE_KEYS
    assert server.phase is Phase.SHARE_KEYS


def test_too_few_advertisements_abort_the_round() -> None:
    federation = make_federation(5, threshold=4)
    server = advertise_all(federation, skip=("site-000", "site-001"))
    with pytest.raises(ProtocolAbort) as caught:
        server.close_advertise()
    assert caught.value.reason is AbortReason.TOO_FEW_PARTICIPANTS
    assert server.phase is Phase.ABORTED


def test_replayed_or_malformed_masked_input_leaves_the_sum_untouched() -> None:
    federation = make_federation(4, threshold=3, vector_length=32)
    inputs = random_inputs(federation.params, 9)
    server = federation.server
    assert server is not None
    original = server.receive_masked_input
    refusals: list[str] = []

    def receive_twice(site: str, vector: object) -> None:
        original(site, vector)  # type: ignore[arg-type]
        for bad in (
            vector,  # replay
            np.zeros(32, np.int64),  # wrong dtype
            np.zeros(31, np.uint32),  # wrong length
        ):
            with pytest.raises(ValidationError):
                original(site, bad)  # type: ignore[arg-type]
            refusals.append(site)

    server.receive_masked_input = receive_twice  # type: ignore[method-assign]
    total, survivors = run_round(federation, inputs)
    assert len(refusals) == 12
    np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))


def test_messages_from_outsiders_or_in_the_wrong_phase_are_refused() -> None:
    federation = make_federation(4, threshold=3)
    server = advertise_all(federation)
    with pytest.raises(ProtocolAbort) as caught:  # a straggler's message of a later phase
        server.receive_consistency("site-000", ConsistencySignature(b"x"))
    assert caught.value.reason is AbortReason.UNEXPECTED_MESSAGE
    assert server.phase is Phase.ADVERTISE_KEYS  # ... does not abort the round
    roster = server.close_advertise()
    with pytest.raises(ValidationError):
        server.receive_shares("site-999", federation.clients["site-000"].receive_roster(roster))
    with pytest.raises(ValidationError):  # shares addressed to only some neighbours
        out = federation.clients["site-001"].receive_roster(roster)
        server.receive_shares("site-001", dataclasses.replace(out, shares=out.shares[:1]))


def test_wrong_share_kind_in_unmask_is_refused() -> None:
    federation = make_federation(4, threshold=3)
    server = federation.server
    assert server is not None
    inputs = random_inputs(federation.params, 2)
    original = server.receive_unmask
    checked: list[bool] = []

    def check_then_receive(site: str, message: UnmaskShares) -> None:
        if not checked:
            flipped = tuple(
                RevealedShare(s.owner_site_id, ShareKind.MASKING_KEY, s.share)
                for s in message.shares
            )
            with pytest.raises(ValidationError):
                original(site, UnmaskShares(flipped))
            stranger = (RevealedShare("site-999", ShareKind.SELF_MASK_SEED, bytes(33)),)
            with pytest.raises(ValidationError):
                original(site, UnmaskShares(stranger))
            checked.append(True)
        original(site, message)
        with pytest.raises(ValidationError):  # replay
            original(site, message)

    server.receive_unmask = check_then_receive  # type: ignore[method-assign]
    total, survivors = run_round(federation, inputs)
    assert checked == [True]
    np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))


def test_unmask_with_fewer_than_t_share_holders_reveals_nothing() -> None:
    federation = make_federation(5, threshold=4)
    inputs = random_inputs(federation.params, 4)
    dropouts = {"site-003": Phase.UNMASK, "site-004": Phase.UNMASK}
    with pytest.raises(ProtocolAbort) as caught:
        run_round(federation, inputs, dropouts=dropouts)
    assert caught.value.reason is AbortReason.RECONSTRUCTION_FAILED
    server = federation.server
    assert server is not None
    assert server.phase is Phase.ABORTED
    assert server._sum is not None and server._sum.discarded  # the masked sum too


def test_per_site_status_records_progress_and_dropout_phase() -> None:
    federation = make_federation(8, threshold=3)  # n - t = 5 dropouts, one per phase
    inputs = random_inputs(federation.params, 6)
    dropouts = {
        "site-001": Phase.ADVERTISE_KEYS,
        "site-002": Phase.SHARE_KEYS,
        "site-003": Phase.MASKED_INPUT,
        "site-004": Phase.CONSISTENCY_CHECK,
        "site-005": Phase.UNMASK,
    }
    total, survivors = run_round(federation, inputs, dropouts=dropouts)
    server = federation.server
    assert server is not None
    assert survivors == ("site-000", "site-004", "site-005", "site-006", "site-007")
    assert server.survivors == survivors
    np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))
    status = server.status
    assert status["site-000"].progress is SiteProgress.UNMASKED
    assert status["site-000"].dropped_in is None
    assert status["site-001"].dropped_in is Phase.ADVERTISE_KEYS
    assert status["site-002"].dropped_in is Phase.SHARE_KEYS
    assert status["site-003"].dropped_in is Phase.MASKED_INPUT
    assert status["site-004"].dropped_in is Phase.CONSISTENCY_CHECK
    assert status["site-005"].progress is SiteProgress.CONFIRMED
    assert server.phase is Phase.COMPLETED
    # The same story from a surviving site's point of view (per-peer state).
    peers = federation.clients["site-000"].peers
    assert "site-001" not in peers  # never advertised: not in the roster
    assert peers["site-002"].status is PeerStatus.DROPPED
    assert peers["site-002"].dropped_in is Phase.SHARE_KEYS
    assert peers["site-003"].status is PeerStatus.DROPPED
    assert peers["site-003"].dropped_in is Phase.MASKED_INPUT
    assert peers["site-004"].status is PeerStatus.ALIVE
    assert federation.clients["site-000"].revealed_kind("site-003") is ShareKind.MASKING_KEY
    assert federation.clients["site-000"].revealed_kind("site-004") is ShareKind.SELF_MASK_SEED


def test_both_signature_algorithms_interoperate_in_one_round() -> None:
    for algorithm in ("ed25519", "ecdsa-p256-sha256"):
        federation = make_federation(4, threshold=3, algorithm=algorithm)
        inputs = random_inputs(federation.params, 8)
        total, survivors = run_round(federation, inputs)
        np.testing.assert_array_equal(total, plaintext_sum(inputs, survivors))
        key = next(iter(federation.signing_keys.values()))
        assert key.algorithm == algorithm


def test_server_keeps_one_accumulator_not_one_vector_per_site() -> None:
    """Memory O(d): after n masked inputs arrived (and the senders dropped their
    copies), the server holds about one vector, not n."""

    n, dim = 8, 250_000  # one vector is ~1 MB
    federation = make_federation(n, threshold=5, vector_length=dim)
    server, clients = federation.server, federation.clients
    assert server is not None
    for site, client in clients.items():
        server.receive_advertisement(
            site, client.advertise_keys(), certificate_der=federation.certificate(site)
        )
    roster = server.close_advertise()
    for site in clients:
        server.receive_shares(site, clients[site].receive_roster(roster))
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        inboxes = server.close_shares()
        for index, site in enumerate(clients):
            vector = np.full(dim, index, dtype=np.uint32)
            server.receive_masked_input(site, clients[site].receive_shares(inboxes[site], vector))
            del vector
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    vector_bytes = dim * 4
    assert vector_bytes <= retained < 2 * vector_bytes


def test_attack_upload_cut_part_way_poisons_the_sum_and_aborts_the_round() -> None:
    """A windowed masked input that stops half-way has already been added in part: the
    round aborts at close_masked_input and the corrupted sum is never unmasked."""
    federation = make_federation(4, threshold=3)
    server = advertise_all(federation)
    roster = server.close_advertise()
    for site in federation.clients:
        server.receive_shares(site, federation.clients[site].receive_roster(roster))
    inboxes = server.close_shares()
    inputs = random_inputs(federation.params, 3)
    for site in ("site-000", "site-001", "site-002"):
        masked = federation.clients[site].receive_shares(inboxes[site], inputs[site].copy())
        server.receive_masked_input(site, masked)
    half = federation.params.vector_length // 2
    cut = inputs["site-003"][:half].copy()
    with pytest.raises(ValidationError):
        server.receive_masked_input_windows("site-003", [cut])
    with pytest.raises(ProtocolAbort) as caught:
        server.close_masked_input()
    assert caught.value.reason is AbortReason.RECONSTRUCTION_FAILED
    assert server.phase is Phase.ABORTED
    with pytest.raises(ProtocolAbort):
        server.close_unmask()
