"""Hypothesis fuzzing of every Federation RPC on a live coordinator.

One secure coordinator per module holds round 1 open in AdvertiseKeys for scripted
sites a, b and d (long deadlines, so the round state is stable); a second, plain
(no SecAgg) coordinator holds a round open in MaskedInput so fuzzed uploads reach the
chunk assembler. Requests are random bytes parsed as the message, or messages with
random field values (round numbers biased towards the live one), sent by a
participant (a), an enrolled bystander (c) or a never-enrolled site (f).

Every call must end with a deliberate status code: never INTERNAL or UNKNOWN. After
each RPC's examples the coordinator still answers health checks, and at the end the
secure round still completes with the exact sum (fuzzing left no trace in its state).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.crypto.shamir import SHARE_BYTES
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol.secagg.messages import CIPHERTEXT_BYTES
from tests.network.conftest import (
    InProcessCoordinator,
    PkiLayout,
    ScriptedSite,
    coordinator_settings,
    health_status,
    raw_channel,
    read_aggregate,
    ring_sum,
)

EXAMPLES = 120  # x 10 fuzzed RPC targets = 1,200 cases
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SERVICE = "/medfed.v1.Federation/"
DELIBERATE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
}
# Long-polls that a fuzzed request may legitimately enter: the client gives up first.
LONG_POLL = DELIBERATE | {grpc.StatusCode.DEADLINE_EXCEEDED}
SERVING = 1


@dataclass
class FuzzTarget:
    secure: InProcessCoordinator
    plain: InProcessCoordinator
    pki_layout: PkiLayout
    secure_sites: dict[str, ScriptedSite]
    round_number: int
    nonce: bytes
    vector_length: int
    plain_vector_length: int
    channels: dict[tuple[str, str], grpc.Channel]

    def channel(self, which: str, caller: str) -> grpc.Channel:
        return self.channels[(which, caller)]


def _open_round(coord: InProcessCoordinator, pki_layout: PkiLayout,
                sites: tuple[str, ...]) -> dict[str, ScriptedSite]:
    scripted = {s: ScriptedSite(pki_layout, coord.address, s) for s in sites}
    for site in scripted.values():
        site.enroll()
    waits = {
        s: site.stub.WaitForRound.future(pb.WaitForRoundRequest(wait_seconds=30), timeout=35)
        for s, site in scripted.items()
    }
    for s, future in waits.items():
        reply = future.result()
        assert reply.has_round and list(reply.round.participants) == sorted(sites)
        if coord.settings.aggregation.secure_aggregation:
            scripted[s].join_round(reply.round)
        else:
            scripted[s].announcement = reply.round
    return scripted


@pytest.fixture(scope="module")
def target(
    pki_layout: PkiLayout, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FuzzTarget]:
    base: Path = tmp_path_factory.mktemp("fuzz")
    long = {"train_seconds": 600.0, "phase_seconds": 600.0,
            "round_start_timeout_seconds": 600.0}
    secure = InProcessCoordinator(
        coordinator_settings(pki_layout, base / "secure", min_sites=3, deadlines=long)
    ).__enter__()
    plain = InProcessCoordinator(
        coordinator_settings(
            pki_layout, base / "plain", min_sites=2, deadlines=long,
            aggregation={"secure_aggregation": False},
        )
    ).__enter__()
    try:
        secure_sites = _open_round(secure, pki_layout, ("a", "b", "d"))
        plain_sites = _open_round(plain, pki_layout, ("a", "b"))
        for coord in (secure, plain):  # c: enrolled, never selected
            ScriptedSite(pki_layout, coord.address, "c").enroll()
        channels = {
            (which, caller): raw_channel(pki_layout, coord.address, cert_of=caller)
            for which, coord in (("secure", secure), ("plain", plain))
            for caller in ("a", "c", "f")
        }
        ann = secure_sites["a"].ann
        yield FuzzTarget(
            secure=secure,
            plain=plain,
            pki_layout=pki_layout,
            secure_sites=secure_sites,
            round_number=int(ann.round),
            nonce=bytes(ann.round_nonce),
            vector_length=int(ann.vector_length),
            plain_vector_length=int(plain_sites["a"].ann.vector_length),
            channels=channels,
        )
        for channel in channels.values():
            channel.close()
    finally:
        plain.__exit__(None, None, None)
        secure.__exit__(None, None, None)


# --------------------------------------------------------------------- strategies

CALLERS = st.sampled_from(["a", "c", "f"])
ROUNDS = st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 2**64 - 1))
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


def _exactly(n: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=n, max_size=n)


# Mostly well-sized values (so requests get past the size checks into the protocol),
# sometimes any bytes at all.
BLOBS = st.binary(max_size=80)
KEYS = st.one_of(_exactly(32), BLOBS)
SIGNATURES = st.one_of(_exactly(64), st.integers(68, 72).flatmap(_exactly), BLOBS)
SESSIONS = st.one_of(_exactly(32), st.just(b""), BLOBS)
NONCES = st.one_of(_exactly(16), BLOBS)
CIPHERTEXTS = st.one_of(_exactly(CIPHERTEXT_BYTES), BLOBS)
SHARES = st.one_of(_exactly(SHARE_BYTES), BLOBS)
SITE_IDS = st.one_of(st.sampled_from(["a", "b", "c", "d", "f", "zz"]), st.text(max_size=24))
TEXT = st.one_of(st.just(""), st.text(max_size=24))
FLOATS = st.one_of(st.floats(0, 100), st.floats(allow_nan=True, allow_infinity=True))
BUDGETS = st.one_of(
    st.just(pb.BudgetStatus()),
    st.builds(pb.BudgetStatus, epsilon_budget=FLOATS, epsilon_spent=FLOATS, delta=FLOATS,
              privacy_unit=TEXT),
)
RAW = st.binary(max_size=200)


def _as_bytes(messages: st.SearchStrategy[object]) -> st.SearchStrategy[bytes]:
    """Either a structured message with random fields, serialized, or raw bytes."""
    structured = messages.map(lambda m: m.SerializeToString())  # type: ignore[attr-defined]
    return st.one_of(structured, structured, RAW)


REQUESTS: dict[str, st.SearchStrategy[bytes]] = {
    "Enroll": _as_bytes(st.builds(
        pb.EnrollRequest, agent_version=TEXT, budget=BUDGETS, device=TEXT)),
    "WaitForRound": _as_bytes(st.builds(
        pb.WaitForRoundRequest, wait_seconds=U32, after_round=ROUNDS, budget=BUDGETS)),
    "DeclineRound": _as_bytes(st.builds(
        pb.DeclineRoundRequest, round=ROUNDS, reason=st.integers(-5, 5), budget=BUDGETS)),
    "DownloadModel": _as_bytes(st.builds(pb.DownloadModelRequest, round=ROUNDS)),
    "Heartbeat": _as_bytes(st.builds(pb.HeartbeatRequest, round=ROUNDS)),
    "AdvertiseKeys": _as_bytes(st.builds(
        pb.AdvertiseKeysRequest, round=ROUNDS, round_nonce=NONCES,
        encryption_public_key=KEYS, masking_public_key=KEYS, signature=SIGNATURES)),
    "ShareKeys": _as_bytes(st.builds(
        pb.ShareKeysRequest, round=ROUNDS, session_id=SESSIONS,
        shares=st.lists(st.builds(pb.EncryptedShare, peer_site_id=SITE_IDS,
                                  ciphertext=CIPHERTEXTS),
                        max_size=4),
        self_mask_commitment=st.one_of(st.binary(min_size=32, max_size=32), RAW))),
    "ConsistencyCheck": _as_bytes(st.builds(
        pb.ConsistencyCheckRequest, round=ROUNDS, session_id=SESSIONS, signature=SIGNATURES)),
    "Unmask": _as_bytes(st.builds(
        pb.UnmaskRequest, round=ROUNDS, session_id=SESSIONS,
        shares=st.lists(st.builds(pb.RevealedShare, owner_site_id=SITE_IDS,
                                  kind=st.integers(-3, 5), share=SHARES), max_size=4))),
}


def _with_live_values(target: FuzzTarget, data: bytes, method: str) -> bytes:
    """Half the structured requests carry the live round (and nonce), so the fuzz gets
    past the round check into the phase logic."""
    message_class = getattr(pb, f"{method}Request")
    try:
        message = message_class.FromString(data)
    except DecodeError:
        return data
    if hasattr(message, "round") and message.round % 2 == 0:
        message.round = target.round_number
        if hasattr(message, "round_nonce"):
            message.round_nonce = target.nonce
    return bytes(message.SerializeToString())


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _unary(target: FuzzTarget, method: str, caller: str, data: bytes,
           timeout: float = 5) -> grpc.StatusCode:
    call = target.channel("secure", caller).unary_unary(SERVICE + method)
    return _code(lambda: call(data, timeout=timeout))


def _still_serving(target: FuzzTarget) -> None:
    for coord in (target.secure, target.plain):
        assert health_status(target.pki_layout, coord.address) == SERVING
        assert not coord.engine_done.is_set(), coord.engine_error()


# ------------------------------------------------------------------------ fuzzing


@pytest.mark.parametrize(
    "method", ["Enroll", "Heartbeat", "AdvertiseKeys", "ShareKeys", "ConsistencyCheck",
               "Unmask"]
)
def test_fuzzed_unary_rpc_ends_with_a_deliberate_status(target: FuzzTarget, method: str) -> None:
    seen: set[grpc.StatusCode] = set()

    @FUZZ
    @given(caller=CALLERS, data=REQUESTS[method])
    def run(caller: str, data: bytes) -> None:
        code = _unary(target, method, caller, _with_live_values(target, data, method))
        seen.add(code)
        assert code in DELIBERATE, code

    run()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    _still_serving(target)


def test_fuzzed_wait_for_round_ends_with_a_deliberate_status(target: FuzzTarget) -> None:
    @FUZZ
    @given(caller=CALLERS, data=REQUESTS["WaitForRound"])
    def run(caller: str, data: bytes) -> None:
        # The server holds polls for >= 1 s; the client stops waiting much earlier.
        code = _unary(target, "WaitForRound", caller, data, timeout=0.05)
        assert code in LONG_POLL, code

    run()
    _still_serving(target)


def test_fuzzed_decline_round_ends_with_a_deliberate_status(target: FuzzTarget) -> None:
    @FUZZ
    @given(caller=st.sampled_from(["c", "f"]), data=REQUESTS["DeclineRound"])
    def run(caller: str, data: bytes) -> None:
        # Participant a never declines: the round must stay intact for the final check.
        code = _unary(target, "DeclineRound", caller, data)
        assert code in DELIBERATE, code

    run()
    _still_serving(target)


def test_fuzzed_download_model_ends_with_a_deliberate_status(target: FuzzTarget) -> None:
    @FUZZ
    @given(caller=CALLERS, data=REQUESTS["DownloadModel"])
    def run(caller: str, data: bytes) -> None:
        call = target.channel("secure", caller).unary_stream(SERVICE + "DownloadModel")
        live = _with_live_values(target, data, "DownloadModel")
        code = _code(lambda: call(live, timeout=5))
        assert code in DELIBERATE, code

    run()
    _still_serving(target)


def _chunk_items(target: FuzzTarget, length: int) -> st.SearchStrategy[list[bytes]]:
    header = st.builds(
        pb.MaskedInputHeader,
        round=st.one_of(st.just(target.round_number), ROUNDS),
        session_id=SESSIONS,
        vector_length=st.one_of(st.just(length), U64),
    ).map(lambda h: pb.MaskedInputChunk(header=h).SerializeToString())
    chunk = st.builds(
        pb.ModelChunk,
        offset=st.one_of(st.sampled_from([0, 4, 64, length * 4]), U64),
        data=st.binary(max_size=length * 4 + 8),
    ).map(lambda c: pb.MaskedInputChunk(chunk=c).SerializeToString())
    item = st.one_of(header, chunk, chunk, RAW)
    return st.one_of(
        st.lists(item, max_size=5),
        st.tuples(header, st.lists(chunk, max_size=4)).map(lambda t: [t[0], *t[1]]),
    )


@pytest.mark.parametrize("which", ["secure", "plain"])
def test_fuzzed_upload_stream_ends_with_a_deliberate_status(
    target: FuzzTarget, which: str
) -> None:
    length = target.vector_length if which == "secure" else target.plain_vector_length

    @FUZZ
    @given(caller=CALLERS, items=_chunk_items(target, length))
    def run(caller: str, items: list[bytes]) -> None:
        call = target.channel(which, caller).stream_unary(SERVICE + "UploadMaskedInput")
        # A (vanishingly unlikely) well-formed plain upload long-polls: allowed.
        code = _code(lambda: call(iter(items), timeout=2))
        assert code in LONG_POLL, code

    run()
    _still_serving(target)


def test_round_completes_exactly_after_fuzzing(target: FuzzTarget) -> None:
    """a, b and d, untouched by the fuzz (it could not move the round), finish round 1;
    the unmasked aggregate is the exact ring sum of their inputs."""
    sites = target.secure_sites
    errors: list[BaseException] = []

    def behave(site: ScriptedSite) -> None:
        try:
            masked = site.send_shares(site.send_advertise(site.advertise_request()))
            unmask = site.send_consistency(site.send_upload(site.upload_chunks(masked)))
            assert site.send_unmask(unmask).completed
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=behave, args=(s,), daemon=True) for s in sites.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    target.secure.wait_engine_done(20)
    aggregate, survivors = read_aggregate(target.secure.settings.state, target.round_number)
    assert survivors == ("a", "b", "d")
    vectors = [sites[s].plain_vector for s in survivors]
    assert all(isinstance(v, np.ndarray) for v in vectors)
    assert np.array_equal(aggregate, ring_sum(vectors))  # type: ignore[arg-type]
