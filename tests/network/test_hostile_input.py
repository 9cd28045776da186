"""Hostile and broken input against the live coordinator.

Each test is named after its attack and asserts the exact gRPC status code. Attacks on
the protocol run inside a real round: honest site agents (threads) take part next to a
scripted participant "d" that misbehaves, then either recovers or is dropped. The round
must still complete, and the coordinator's unmasked aggregate must equal the ring sum
of the survivors' plaintext updates (debug files written by both sides).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from common.crypto.signing import SigningKey
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki
from common.protocol.secagg.messages import advertise_message
from common.rounds import wire
from tests.network.conftest import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    HonestSites,
    InProcessCoordinator,
    PkiLayout,
    ScriptedSite,
    health_status,
    raw_channel,
    raw_stub,
    read_aggregate,
    ring_sum,
    status_of,
)

OK = grpc.StatusCode.OK
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
ABORTED = grpc.StatusCode.ABORTED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING

# A length-delimited field 1 that claims 255 bytes and has none: never a valid message.
UNPARSEABLE = b"\x0a\xff\x01"


def rpc_error(call: Callable[..., object], *args: object, **kwargs: object) -> grpc.RpcError:
    """The RpcError an RPC must end with (fails the test if it succeeds)."""
    try:
        call(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call was accepted")


# --------------------------------------------------------------------------- helpers


@dataclass
class LiveRound:
    coordinator: InProcessCoordinator
    honest: HonestSites
    hostile: ScriptedSite
    announcement: pb.RoundAnnouncement

    @property
    def number(self) -> int:
        return int(self.announcement.round)


@pytest.fixture
def live_round(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> LiveRound:
    """Round 1 open for honest a, b, c and scripted (hostile) d; n=4, t=3."""
    return open_live_round(coordinator, honest_sites, pki_layout, hostile="d")


def open_live_round(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
    *,
    hostile: str,
    honest_ids: Sequence[str] = ("a", "b", "c"),
    **settings: object,
) -> LiveRound:
    coord = coordinator(**settings)
    scripted = ScriptedSite(pki_layout, coord.address, hostile)
    scripted.enroll()
    honest = honest_sites(coord.address, honest_ids)
    ann = scripted.wait_for_round()
    assert list(ann.participants) == sorted([*honest_ids, hostile])
    assert ann.threshold == 3
    return LiveRound(coord, honest, scripted, ann)


def open_round_with_holder(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> tuple[LiveRound, ScriptedSite]:
    """Round 1 for honest a, b and scripted d (hostile) and e; until e advertises, the
    AdvertiseKeys phase stays open, so d's misbehaviour there is timed exactly."""
    coord = coordinator()
    d = ScriptedSite(pki_layout, coord.address, "d")
    e = ScriptedSite(pki_layout, coord.address, "e")
    d.enroll()
    e.enroll()
    honest = honest_sites(coord.address, ["a", "b"])
    wait_e = e.stub.WaitForRound.future(pb.WaitForRoundRequest(wait_seconds=30), timeout=35)
    ann = d.wait_for_round()
    assert list(ann.participants) == ["a", "b", "d", "e"]
    e.join_round(wait_e.result().round)
    return LiveRound(coord, honest, d, ann), e


def finish_honestly(site: ScriptedSite, shares: pb.ShareKeysRequest) -> None:
    """From ShareKeys on, behave: the site stays a survivor."""
    masked = site.send_shares(shares)
    consistency = site.send_upload(site.upload_chunks(masked))
    unmask = site.send_consistency(consistency)
    reply = site.send_unmask(unmask)
    assert reply.completed


def assert_round_completed(
    live: LiveRound, *, survivors: Sequence[str], extra: Sequence[ScriptedSite] = ()
) -> None:
    """Honest agents finished cleanly and aggregate == ring sum of the survivors."""
    codes = live.honest.join(60)
    assert codes == dict.fromkeys(live.honest.threads, 0)
    live.coordinator.wait_engine_done(20)
    aggregate, listed = read_aggregate(live.coordinator.settings.state, live.number)
    assert listed == tuple(sorted(survivors))
    scripted = {s.site_id: s for s in (live.hostile, *extra)}
    vectors = []
    for site in survivors:
        if site in scripted:
            vector = scripted[site].plain_vector
            assert vector is not None
            vectors.append(vector)
        else:
            vectors.append(live.honest.update(site, live.number))
    assert np.array_equal(aggregate, ring_sum(vectors))
    assert health_status(live.hostile.pki_layout, live.coordinator.address) == SERVING


# ----------------------------------------------------------- transport identity


def test_no_client_certificate_is_refused_at_handshake(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    coord = coordinator()
    stub = raw_stub(pki_layout, coord.address, cert_of=None)
    assert status_of(stub.Enroll, pb.EnrollRequest(), timeout=10) == UNAVAILABLE
    assert health_status(pki_layout, coord.address) == SERVING


def test_certificate_from_foreign_ca_is_refused_at_handshake(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    coord = coordinator()
    # The foreign CA's site is also called "a" and its CA has our CA's name.
    stub = raw_stub(pki_layout, coord.address, cert_of="a", foreign=True)
    assert status_of(stub.Enroll, pb.EnrollRequest(), timeout=10) == UNAVAILABLE
    assert health_status(pki_layout, coord.address) == SERVING


def test_expired_site_certificate_is_refused(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    coord = coordinator()
    stub = raw_stub(pki_layout, coord.address, cert_of="expired")
    # gRPC's TLS layer checks validity dates already (the servicer would say
    # PERMISSION_DENIED if a certificate got that far).
    assert status_of(stub.Enroll, pb.EnrollRequest(), timeout=10) == UNAVAILABLE
    assert health_status(pki_layout, coord.address) == SERVING


def test_revoked_site_certificate_is_permission_denied_on_every_rpc(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    coord = coordinator()
    stub = raw_stub(pki_layout, coord.address, cert_of="revoked")
    calls: list[tuple[Callable[..., object], object]] = [
        (stub.Enroll, pb.EnrollRequest()),
        (stub.WaitForRound, pb.WaitForRoundRequest(wait_seconds=1)),
        (stub.DeclineRound, pb.DeclineRoundRequest(round=1)),
        (stub.Heartbeat, pb.HeartbeatRequest(round=1)),
        (stub.AdvertiseKeys, pb.AdvertiseKeysRequest(round=1)),
        (stub.ShareKeys, pb.ShareKeysRequest(round=1)),
        (stub.ConsistencyCheck, pb.ConsistencyCheckRequest(round=1)),
        (stub.Unmask, pb.UnmaskRequest(round=1)),
    ]
    for call, request in calls:
        error = rpc_error(call, request, timeout=10)
        assert error.code() == PERMISSION_DENIED, call
        assert "revoked" in (error.details() or "")
    download = stub.DownloadModel(pb.DownloadModelRequest(round=1), timeout=10)
    assert status_of(lambda: list(download)) == PERMISSION_DENIED
    upload = iter([pb.MaskedInputChunk(header=pb.MaskedInputHeader(round=1))])
    assert status_of(stub.UploadMaskedInput, upload, timeout=10) == PERMISSION_DENIED


def test_site_revoked_after_coordinator_started_is_refused_without_restart(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    coord = coordinator()
    late = raw_stub(pki_layout, coord.address, cert_of="late")
    assert status_of(late.Enroll, pb.EnrollRequest(), timeout=10) == OK
    pki.revoke_site(pki_layout.root, "late", now=dt.datetime.now(dt.UTC))
    # Same coordinator, same TLS connection: the next call sees the new CRL.
    assert status_of(late.Enroll, pb.EnrollRequest(), timeout=10) == PERMISSION_DENIED
    fresh = raw_stub(pki_layout, coord.address, cert_of="late")
    assert status_of(fresh.Enroll, pb.EnrollRequest(), timeout=10) == PERMISSION_DENIED
    other = raw_stub(pki_layout, coord.address, cert_of="e")
    assert status_of(other.Enroll, pb.EnrollRequest(), timeout=10) == OK


def test_participant_revoked_mid_round_is_refused_and_dropped(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> None:
    """The CRL changes while "midround" is a selected participant: its next message is
    refused, it is dropped at AdvertiseKeys and a, b, c complete the round."""
    live = open_live_round(coordinator, honest_sites, pki_layout, hostile="midround")
    pki.revoke_site(pki_layout.root, "midround", now=dt.datetime.now(dt.UTC))
    request = live.hostile.advertise_request()
    assert status_of(live.hostile.stub.AdvertiseKeys, request, timeout=10) == PERMISSION_DENIED
    assert_round_completed(live, survivors=["a", "b", "c"])


# -------------------------------------------------------------- message identity


def test_non_participant_replaying_participants_messages_is_refused_as_itself(
    live_round: LiveRound, pki_layout: PkiLayout
) -> None:
    """Site e (valid certificate, not selected) re-sends d's exact messages in every
    phase: each is judged as e's (the error names e), never as d's."""
    live, d = live_round, live_round.hostile
    e = ScriptedSite(pki_layout, live.coordinator.address, "e")
    e.enroll()

    def refused_as_e(call: Callable[..., object], request: object) -> None:
        error = rpc_error(call, request, timeout=10)
        assert error.code() == FAILED_PRECONDITION
        assert "site e is not a participant" in (error.details() or "")

    advertise = d.advertise_request()
    refused_as_e(e.stub.AdvertiseKeys, advertise)
    # e signs keys "for b" with its own key: still e's message, still refused.
    forged = pb.AdvertiseKeysRequest()
    forged.CopyFrom(advertise)
    forged.signature = SigningKey.from_pem(pki_layout.site_pair("e")[1]).sign(
        advertise_message(
            round_number=live.number,
            round_nonce=live.announcement.round_nonce,
            site_id="b",
            encryption_public_key=advertise.encryption_public_key,
            masking_public_key=advertise.masking_public_key,
            # The digest every honest site binds: only the signer's identity is forged.
            announcement_digest=wire.announcement_from_pb(live.announcement).digest(),
        )
    )
    refused_as_e(e.stub.AdvertiseKeys, forged)
    download = e.stub.DownloadModel(pb.DownloadModelRequest(round=live.number), timeout=10)
    assert status_of(lambda: list(download)) == FAILED_PRECONDITION
    shares = d.send_advertise(advertise)
    refused_as_e(e.stub.ShareKeys, shares)
    masked = d.send_shares(shares)
    upload = d.upload_chunks(masked)
    error = rpc_error(e.stub.UploadMaskedInput, iter(upload), timeout=10)
    assert error.code() == FAILED_PRECONDITION
    assert "site e is not a participant" in (error.details() or "")
    consistency = d.send_upload(upload)
    refused_as_e(e.stub.ConsistencyCheck, consistency)
    unmask = d.send_consistency(consistency)
    refused_as_e(e.stub.Unmask, unmask)
    refused_as_e(e.stub.DeclineRound, pb.DeclineRoundRequest(round=live.number))
    assert d.send_unmask(unmask).completed
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_participant_advertising_keys_signed_as_another_site_is_refused(
    live_round: LiveRound, pki_layout: PkiLayout
) -> None:
    """d signs an advertisement naming b: the coordinator checks it as d's (the caller's
    certificate), so the signature does not verify."""
    live, d = live_round, live_round.hostile
    honest_request = d.advertise_request()
    as_b = pb.AdvertiseKeysRequest()
    as_b.CopyFrom(honest_request)
    as_b.signature = d.signing_key.sign(
        advertise_message(
            round_number=live.number,
            round_nonce=live.announcement.round_nonce,
            site_id="b",
            encryption_public_key=honest_request.encryption_public_key,
            masking_public_key=honest_request.masking_public_key,
            # The digest every honest site binds: only the signer's identity is forged.
            announcement_digest=wire.announcement_from_pb(live.announcement).digest(),
        )
    )
    assert status_of(d.stub.AdvertiseKeys, as_b, timeout=10) == INVALID_ARGUMENT
    # The refused message left no trace: d's honest advertisement is still accepted.
    finish_honestly(d, d.send_advertise(honest_request))
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


# ------------------------------------------------------------- protocol misuse


def test_wrong_round_number_is_aborted(live_round: LiveRound) -> None:
    live, d = live_round, live_round.hostile
    request = d.advertise_request()
    # Another round is ABORTED; a number no round can have is refused at the boundary.
    for wrong, expected in ((0, ABORTED), (live.number + 1, ABORTED),
                            (2**53, INVALID_ARGUMENT), (2**64 - 1, INVALID_ARGUMENT)):
        bad = pb.AdvertiseKeysRequest()
        bad.CopyFrom(request)
        bad.round = wrong
        assert status_of(d.stub.AdvertiseKeys, bad, timeout=10) == expected
        download = d.stub.DownloadModel(pb.DownloadModelRequest(round=wrong), timeout=10)
        assert status_of(lambda it=download: list(it)) == expected
    wrong_nonce = pb.AdvertiseKeysRequest()
    wrong_nonce.CopyFrom(request)
    wrong_nonce.round_nonce = bytes(16)
    assert status_of(d.stub.AdvertiseKeys, wrong_nonce, timeout=10) == ABORTED
    finish_honestly(d, d.send_advertise(request))
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_wrong_session_id_is_aborted_in_every_phase(live_round: LiveRound) -> None:
    live, d = live_round, live_round.hostile
    other_session = os.urandom(32)
    shares = d.send_advertise(d.advertise_request())
    for bad_session, code in ((other_session, ABORTED), (b"short", INVALID_ARGUMENT)):
        bad = pb.ShareKeysRequest()
        bad.CopyFrom(shares)
        bad.session_id = bad_session
        assert status_of(d.stub.ShareKeys, bad, timeout=10) == code
    masked = d.send_shares(shares)
    bad_upload = d.upload_chunks(masked)
    bad_upload[0].header.session_id = other_session
    assert status_of(d.stub.UploadMaskedInput, iter(bad_upload), timeout=10) == ABORTED
    consistency = d.send_upload(d.upload_chunks(masked))
    bad_consistency = pb.ConsistencyCheckRequest()
    bad_consistency.CopyFrom(consistency)
    bad_consistency.session_id = other_session
    assert status_of(d.stub.ConsistencyCheck, bad_consistency, timeout=10) == ABORTED
    unmask = d.send_consistency(consistency)
    bad_unmask = pb.UnmaskRequest()
    bad_unmask.CopyFrom(unmask)
    bad_unmask.session_id = other_session
    assert status_of(d.stub.Unmask, bad_unmask, timeout=10) == ABORTED
    assert d.send_unmask(unmask).completed
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_phase_messages_out_of_order_are_aborted(live_round: LiveRound) -> None:
    """ShareKeys, MaskedInput, ConsistencyCheck and Unmask before AdvertiseKeys closed."""
    live, d = live_round, live_round.hostile
    session = os.urandom(32)
    n = live.number
    early_upload = iter([pb.MaskedInputChunk(header=pb.MaskedInputHeader(
        round=n, session_id=session, vector_length=live.announcement.vector_length))])
    early_shares = pb.ShareKeysRequest(
        round=n, session_id=session, self_mask_commitment=os.urandom(32)
    )
    assert status_of(d.stub.ShareKeys, early_shares, timeout=10) == ABORTED
    assert status_of(d.stub.UploadMaskedInput, early_upload, timeout=10) == ABORTED
    assert status_of(
        d.stub.ConsistencyCheck,
        pb.ConsistencyCheckRequest(round=n, session_id=session, signature=b"x" * 64),
        timeout=10,
    ) == ABORTED
    assert status_of(
        d.stub.Unmask, pb.UnmaskRequest(round=n, session_id=session), timeout=10
    ) == ABORTED
    shares = d.send_advertise(d.advertise_request())
    # AdvertiseKeys after its phase closed is out of order too.
    late = pb.AdvertiseKeysRequest(round=n, round_nonce=live.announcement.round_nonce,
                                   encryption_public_key=os.urandom(32),
                                   masking_public_key=os.urandom(32), signature=b"s")
    assert status_of(d.stub.AdvertiseKeys, late, timeout=10) == ABORTED
    finish_honestly(d, shares)
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_replayed_advertise_keys_is_refused(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> None:
    """d sends the same AdvertiseKeys twice while the phase is open (scripted e holds
    it open): exactly one is taken, the other is a duplicate. A replay after the phase
    closed is out of order."""
    live, e = open_round_with_holder(coordinator, honest_sites, pki_layout)
    d = live.hostile
    request = d.advertise_request()
    one_done = threading.Event()
    calls = [d.stub.AdvertiseKeys.future(request, timeout=30) for _ in range(2)]
    for call in calls:
        call.add_done_callback(lambda _call: one_done.set())
    # Whichever copy the server saw second is refused at once; the first one is
    # accepted and long-polls until e closes the phase.
    assert one_done.wait(20)
    refused = [call for call in calls if call.done()]
    assert len(refused) == 1
    assert refused[0].code() == FAILED_PRECONDITION
    assert "duplicate" in (refused[0].details() or "")
    accepted = next(call for call in calls if call is not refused[0])
    e_shares = e.send_advertise(e.advertise_request())  # closes the phase
    roster = accepted.result()
    assert status_of(d.stub.AdvertiseKeys, request, timeout=10) == ABORTED
    d_shares = d.accept_roster(roster)
    # d and e go on concurrently: every phase waits for both.
    e_thread = threading.Thread(target=finish_honestly, args=(e, e_shares), daemon=True)
    e_thread.start()
    finish_honestly(d, d_shares)
    e_thread.join(30)
    assert not e_thread.is_alive()
    assert_round_completed(live, survivors=["a", "b", "d", "e"], extra=[e])


def test_declined_participant_cannot_rejoin_the_round(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> None:
    """d declines (so nobody waits for it), then tries to take part after all while the
    phase is still open (scripted e has not advertised yet)."""
    live, e = open_round_with_holder(coordinator, honest_sites, pki_layout)
    d = live.hostile
    request = d.advertise_request()
    decline = pb.DeclineRoundRequest(round=live.number, reason=pb.DeclineRoundRequest.NOT_READY)
    assert status_of(d.stub.DeclineRound, decline, timeout=10) == OK
    error = rpc_error(d.stub.AdvertiseKeys, request, timeout=10)
    assert error.code() == FAILED_PRECONDITION
    assert "dropped" in (error.details() or "")
    finish_honestly(e, e.send_advertise(e.advertise_request()))
    assert_round_completed(live, survivors=["a", "b", "e"], extra=[e])


def test_vector_of_wrong_length_is_aborted(live_round: LiveRound) -> None:
    live, d = live_round, live_round.hostile
    masked = d.send_shares(d.send_advertise(d.advertise_request()))
    length = masked.size
    for claimed in (length - 1, length + 1, 0):
        chunks = d.upload_chunks(masked, length=claimed)
        assert status_of(d.stub.UploadMaskedInput, iter(chunks), timeout=10) == ABORTED
    # A length no vector can have is refused at the boundary (common.rounds.wire).
    huge = d.upload_chunks(masked, length=2**64 - 1)
    assert status_of(d.stub.UploadMaskedInput, iter(huge), timeout=10) == INVALID_ARGUMENT
    # Header right, data one element short: truncated.
    short = d.upload_chunks(masked[:-1], length=length)
    assert status_of(d.stub.UploadMaskedInput, iter(short), timeout=10) == INVALID_ARGUMENT
    # Header right, data one element long: runs past the declared length.
    long = d.upload_chunks(np.append(masked, np.uint32(7)), length=length)
    assert status_of(d.stub.UploadMaskedInput, iter(long), timeout=10) == INVALID_ARGUMENT
    unmask = d.send_consistency(d.send_upload(d.upload_chunks(masked)))
    assert d.send_unmask(unmask).completed
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_upload_chunk_larger_than_limit_is_refused(live_round: LiveRound) -> None:
    live, d = live_round, live_round.hostile
    masked = d.send_shares(d.send_advertise(d.advertise_request()))
    header = d.upload_chunks(masked)[0]
    for size, code in (
        (MAX_CHUNK_BYTES + 4, INVALID_ARGUMENT),  # over our chunk limit
        (MAX_CHUNK_BYTES * 3, RESOURCE_EXHAUSTED),  # over gRPC's message limit too
    ):
        oversized = pb.MaskedInputChunk(chunk=pb.ModelChunk(offset=0, data=bytes(size)))
        assert status_of(d.stub.UploadMaskedInput, iter([header, oversized]), timeout=10) == code
    unmask = d.send_consistency(d.send_upload(d.upload_chunks(masked)))
    assert d.send_unmask(unmask).completed
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_chunk_offset_gap_overlap_and_reorder_are_refused(live_round: LiveRound) -> None:
    live, d = live_round, live_round.hostile
    masked = d.send_shares(d.send_advertise(d.advertise_request()))
    header, *chunks = d.upload_chunks(masked, chunk_bytes=64)
    assert len(chunks) >= 3
    attacks = {
        "gap": [chunks[0], *chunks[2:]],
        "overlap": [chunks[0], chunks[0], *chunks[1:]],
        "reorder": [chunks[1], chunks[0], *chunks[2:]],
        "second header": [chunks[0], header, *chunks[1:]],
        "empty chunk": [pb.MaskedInputChunk(chunk=pb.ModelChunk(offset=0)), *chunks],
    }
    for name, body in attacks.items():
        code = status_of(d.stub.UploadMaskedInput, iter([header, *body]), timeout=10)
        assert code == INVALID_ARGUMENT, name
    assert status_of(d.stub.UploadMaskedInput, iter(chunks), timeout=10) == INVALID_ARGUMENT
    assert status_of(d.stub.UploadMaskedInput, iter([]), timeout=10) == INVALID_ARGUMENT
    unmask = d.send_consistency(d.send_upload(d.upload_chunks(masked)))
    assert d.send_unmask(unmask).completed
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_truncated_upload_drops_the_site_and_round_completes(live_round: LiveRound) -> None:
    """d's stream ends early (twice), then d goes silent: it is dropped at MaskedInput,
    its masks are recovered and the sum of a, b, c is exact."""
    live, d = live_round, live_round.hostile
    masked = d.send_shares(d.send_advertise(d.advertise_request()))
    header, *chunks = d.upload_chunks(masked, chunk_bytes=64)
    assert status_of(d.stub.UploadMaskedInput, iter([header]), timeout=10) == INVALID_ARGUMENT
    truncated = iter([header, *chunks[:-1]])
    assert status_of(d.stub.UploadMaskedInput, truncated, timeout=10) == INVALID_ARGUMENT
    assert_round_completed(live, survivors=["a", "b", "c"])


def test_garbage_bytes_in_every_field_are_refused(live_round: LiveRound) -> None:
    """Per phase: unparseable bytes, then each field garbled in turn; all refused with
    INVALID_ARGUMENT, after which d's real message is still accepted."""
    live, d = live_round, live_round.hostile
    channel = raw_channel(d.pki_layout, live.coordinator.address, cert_of="d")

    def raw(method: str) -> Callable[..., object]:
        return channel.unary_unary(f"/medfed.v1.Federation/{method}")

    for method in ("Enroll", "WaitForRound", "DeclineRound", "Heartbeat", "AdvertiseKeys",
                   "ShareKeys", "ConsistencyCheck", "Unmask"):
        assert status_of(raw(method), UNPARSEABLE, timeout=10) == INVALID_ARGUMENT, method
    download = channel.unary_stream("/medfed.v1.Federation/DownloadModel")
    assert status_of(lambda: list(download(UNPARSEABLE, timeout=10))) == INVALID_ARGUMENT
    upload = channel.stream_unary("/medfed.v1.Federation/UploadMaskedInput")
    assert status_of(upload, iter([UNPARSEABLE]), timeout=10) == INVALID_ARGUMENT

    def garbled(message: object, **fields: object) -> list[object]:
        out = []
        for name, value in fields.items():
            copy = type(message)()  # type: ignore[operator]
            copy.CopyFrom(message)  # type: ignore[attr-defined]
            setattr(copy, name, value)
            out.append(copy)
        return out

    nan_budget = pb.BudgetStatus(epsilon_budget=float("nan"))
    assert status_of(d.stub.Enroll, pb.EnrollRequest(budget=nan_budget), timeout=10) \
        == INVALID_ARGUMENT

    advertise = d.advertise_request()
    junk = os.urandom(32)
    for bad in garbled(
        advertise,
        round_nonce=os.urandom(15),
        encryption_public_key=os.urandom(31),
        masking_public_key=os.urandom(33),
        signature=os.urandom(200),
    ) + garbled(advertise, signature=os.urandom(64), encryption_public_key=junk) + garbled(
        advertise, masking_public_key=advertise.encryption_public_key
    ):
        assert status_of(d.stub.AdvertiseKeys, bad, timeout=10) == INVALID_ARGUMENT, bad
    shares = d.send_advertise(advertise)

    def share_variant(peer: str, ciphertext: bytes) -> pb.ShareKeysRequest:
        bad = pb.ShareKeysRequest()
        bad.CopyFrom(shares)
        bad.shares[0].peer_site_id = peer
        bad.shares[0].ciphertext = ciphertext
        return bad

    good_cipher = shares.shares[0].ciphertext
    first_peer = shares.shares[0].peer_site_id
    for bad in (
        share_variant("NOT A SITE\x00", good_cipher),
        share_variant("zz", good_cipher),  # a site that is not a neighbour
        share_variant(first_peer, os.urandom(len(good_cipher) - 1)),
        share_variant(first_peer, os.urandom(600)),
    ):
        assert status_of(d.stub.ShareKeys, bad, timeout=10) == INVALID_ARGUMENT
    masked = d.send_shares(shares)
    consistency = d.send_upload(d.upload_chunks(masked))
    for bad in garbled(consistency, signature=os.urandom(64)) + garbled(
        consistency, signature=os.urandom(161)
    ):
        assert status_of(d.stub.ConsistencyCheck, bad, timeout=10) == INVALID_ARGUMENT
    unmask = d.send_consistency(consistency)

    def unmask_variant(**fields: object) -> pb.UnmaskRequest:
        bad = pb.UnmaskRequest()
        bad.CopyFrom(unmask)
        for name, value in fields.items():
            setattr(bad.shares[0], name, value)
        return bad

    for bad in (
        unmask_variant(owner_site_id="??"),
        unmask_variant(owner_site_id="zz"),
        unmask_variant(kind=pb.RevealedShare.KIND_UNSPECIFIED),
        unmask_variant(kind=pb.RevealedShare.MASKING_KEY),  # owner survived
        unmask_variant(kind=7),
        unmask_variant(share=os.urandom(7)),
        unmask_variant(share=os.urandom(129)),
    ):
        assert status_of(d.stub.Unmask, bad, timeout=10) == INVALID_ARGUMENT, bad
    assert d.send_unmask(unmask).completed
    channel.close()
    assert_round_completed(live, survivors=["a", "b", "c", "d"])


def test_stalled_concurrent_uploads_do_not_block_honest_sites(live_round: LiveRound) -> None:
    """Slow loris: d opens two uploads that send a header and then stall. Each upload
    holds a staging buffer; the coordinator must refuse the second stream of the same
    site and cut the first when the phase closes, so honest uploads still get through."""
    live, d = live_round, live_round.hostile
    masked = d.send_shares(d.send_advertise(d.advertise_request()))
    header = d.upload_chunks(masked)[0]
    release = threading.Event()

    def stalled() -> Iterator[pb.MaskedInputChunk]:
        yield header
        release.wait(30)  # the stream stays open, sending nothing

    try:
        first = d.stub.UploadMaskedInput.future(stalled(), timeout=30)
        second = d.stub.UploadMaskedInput.future(stalled(), timeout=30)
        codes = sorted(status_of(future.result).name for future in (first, second))
    finally:
        release.set()
    # One is refused at once; the other is cut when MaskedInput closes without d.
    assert codes == ["ABORTED", "FAILED_PRECONDITION"]
    assert_round_completed(live, survivors=["a", "b", "c"])


def test_model_download_held_open_past_the_round_ends_with_a_clear_status(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> None:
    """d starts a multi-chunk model download, stops reading, completes the round, then
    reads on: the old round's model is no longer served, with a status, not UNKNOWN."""
    dim = 4 * (CHUNK_BYTES // 4) + 16  # just over four 1 MiB chunks
    coord = coordinator(model_dim=dim, limits={"max_chunk_bytes": CHUNK_BYTES})
    d = ScriptedSite(pki_layout, coord.address, "d")
    d.enroll()
    honest = honest_sites(coord.address, ["a", "b", "c"])
    ann = d.wait_for_round()
    # No BDP probing: the receive window stays small, so the server cannot run ahead.
    slow = raw_channel(pki_layout, coord.address, cert_of="d",
                       options=[("grpc.http2.bdp_probe", 0)])
    download = pb_grpc.FederationStub(slow).DownloadModel(
        pb.DownloadModelRequest(round=ann.round), timeout=60
    )
    first = next(download)
    assert first.offset == 0 and len(first.data) == CHUNK_BYTES
    finish_honestly(d, d.send_advertise(d.advertise_request()))
    live = LiveRound(coord, honest, d, ann)
    assert_round_completed(live, survivors=["a", "b", "c", "d"])
    assert status_of(lambda: list(download)) == FAILED_PRECONDITION
    slow.close()


def test_garbage_unmask_shares_never_yield_a_wrong_aggregate(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    pki_layout: PkiLayout,
) -> None:
    """Hostile "a" (sorted first, so its shares are among the first t) follows the
    protocol but reveals random share values. Acceptable outcomes: the round aborts,
    or its aggregate is exact. Not acceptable: a completed round with a wrong sum."""
    live = open_live_round(
        coordinator, honest_sites, pki_layout, hostile="a", honest_ids=("b", "c", "d"),
        deadlines={"round_start_timeout_seconds": 2.0},
    )
    a = live.hostile
    masked = a.send_shares(a.send_advertise(a.advertise_request()))
    unmask = a.send_consistency(a.send_upload(a.upload_chunks(masked)))
    for share in unmask.shares:
        # Valid field elements (< 2**256 < PRIME), just not the real y-values.
        share.share = bytes(1) + os.urandom(len(share.share) - 1)
    status_of(a.stub.Unmask, unmask, timeout=30)
    live.honest.join(60)
    assert live.coordinator.engine_done.wait(30)
    # Whatever the outcome, the forger is named to the operator.
    reports = live.coordinator.engine.metrics.registry.get_sample_value(
        "medfed_coordinator_misbehaving_reports_total", {"site": "a"}
    )
    assert reports == 1.0
    folder = live.coordinator.settings.state / "aggregates"
    if not (folder / f"round-{live.number:06d}.u32").exists():
        return  # aborted: nothing revealed, nothing wrong
    aggregate, survivors = read_aggregate(live.coordinator.settings.state, live.number)
    vectors = [a.plain_vector if s == "a" else live.honest.update(s, live.number)
               for s in survivors]
    assert np.array_equal(aggregate, ring_sum(vectors))  # type: ignore[arg-type]
