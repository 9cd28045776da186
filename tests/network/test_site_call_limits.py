"""One site certificate cannot starve the coordinator, over real mTLS.

A site that opens many calls at once (here: upload streams that never send a byte, each
held by the coordinator until `upload_idle_seconds`) gets its share of calls in flight
(`limits.max_calls_per_site`, lowered here from its default); every call beyond it,
whatever the method, is refused at once with RESOURCE_EXHAUSTED and counted, while the
honest sites' shares are untouched and they train their rounds. The share frees as the
calls end. Request bytes in flight are shared out the same way
(`limits.max_request_bytes_per_site`, `limits.max_request_bytes`).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from common.core.config import CoordinatorSettings, LimitsSection, load_settings
from common.core.errors import ConfigError, ResourceExhausted
from common.proto.medfed.v1 import federation_pb2 as pb
from coordinator.call_limits import MAX_CALLS_PER_SITE, CallLimits
from tests.network.conftest import InProcessCoordinator, PkiLayout, raw_stub, status_of

SHARE = 8
"""`limits.max_calls_per_site` in the flooding test: the lowest the settings accept."""
FLOOD = SHARE + 24


def _refused(coord: InProcessCoordinator, site: str) -> float:
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    prefix = f'medfed_coordinator_calls_refused_total{{site="{site}"}} '
    values = [float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


def test_site_flooding_calls_is_refused_and_honest_sites_are_served(
    pki_layout: PkiLayout,
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[..., Any],
) -> None:
    coord = coordinator(rounds=2, min_sites=3,
                        limits={"upload_idle_seconds": 120, "max_calls_per_site": SHARE})
    assert SHARE < MAX_CALLS_PER_SITE  # the setting, not the default, is what refuses
    flooder = raw_stub(pki_layout, coord.address, cert_of="d")
    release = threading.Event()

    def silent_stream() -> Iterator[pb.MaskedInputChunk]:
        release.wait(90)  # the stream stays open and sends nothing until released
        yield from ()

    ended: list[Any] = []
    lock = threading.Lock()
    refused_all = threading.Event()

    def on_done(call: Any) -> None:
        with lock:
            ended.append(call)
            if len(ended) == FLOOD - SHARE:
                refused_all.set()

    calls = [flooder.UploadMaskedInput.future(silent_stream(), timeout=100)
             for _ in range(FLOOD)]
    try:
        for call in calls:
            call.add_done_callback(on_done)
        assert refused_all.wait(60), "the calls beyond the share were not refused"
        with lock:
            early = list(ended)
        assert {call.code() for call in early} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert (f"has {SHARE} calls in flight, the most one site may hold "
                "(limits.max_calls_per_site)") in (early[0].details() or "")
        # While its share is full, every further call of "d" is refused at once ...
        assert status_of(flooder.Enroll, pb.EnrollRequest(agent_version="flood/1"),
                         timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
        # ... and the honest sites, each with its own share, train both rounds.
        sites = honest_sites(coord.address, ["a", "b", "c"])
        assert sites.join(120) == {"a": 0, "b": 0, "c": 0}
        coord.wait_engine_done(30)
        rounds = coord.engine.store.rounds()
        assert [r.status for r in rounds] == ["completed", "completed"]
        with lock:
            assert len(ended) == FLOOD - SHARE  # the held ones still open
    finally:
        release.set()
    for call in calls:
        with pytest.raises(grpc.RpcError):
            call.result(timeout=30)
    assert _refused(coord, "d") == FLOOD - SHARE + 1
    # The share is free again once its calls ended.
    assert status_of(flooder.Enroll, pb.EnrollRequest(agent_version="flood/1"),
                     timeout=10) == grpc.StatusCode.OK


def test_request_bytes_in_flight_are_bounded_per_site_and_in_all() -> None:
    limits = CallLimits(max_calls_per_site=8, max_bytes_per_site=10, max_bytes=15)
    with limits.hold("a", nbytes=6), limits.hold("a", nbytes=4):
        assert limits.in_flight("a") == (2, 10)
        with pytest.raises(ResourceExhausted, match="site a has 10 request bytes"), \
                limits.hold("a", nbytes=1):
            pass
        with pytest.raises(ResourceExhausted, match="budget of 15"), limits.hold("b", nbytes=6):
            pass
        with limits.hold("b", nbytes=5):  # b's own share, within the budget
            assert limits.in_flight("b") == (1, 5)
    assert limits.in_flight("a") == (0, 0) and limits.in_flight("b") == (0, 0)
    calls = CallLimits(max_calls_per_site=2)
    with calls.hold("a", nbytes=0), calls.hold("a", nbytes=0):
        with pytest.raises(ResourceExhausted, match="2 calls in flight"), \
                calls.hold("a", nbytes=0):
            pass
        with calls.hold("b", nbytes=0):
            pass


def _until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll `condition` until it holds or `timeout` passes (a deadline, not a sleep)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        threading.Event().wait(0.05)
    return True


def padded_poll(nbytes: int) -> pb.WaitForRoundRequest:
    """A long poll carrying `nbytes` of an unknown field: gRPC and protobuf parse and
    keep it, so the coordinator holds it while the poll waits."""
    def varint(value: int) -> bytes:
        out = bytearray()
        while value > 0x7F:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return bytes([*out, value])

    pad = varint(1000 << 3 | 2) + varint(nbytes) + b"x" * nbytes  # field 1000, bytes
    base = pb.WaitForRoundRequest(wait_seconds=60).SerializeToString()
    return pb.WaitForRoundRequest.FromString(base + pad)


def test_request_bytes_beyond_a_lowered_share_are_refused_over_mtls(
    pki_layout: PkiLayout,
    coordinator: Callable[..., InProcessCoordinator],
) -> None:
    """Long polls held open with large bodies: the second of site d passes d's share of
    request bytes, site e's first passes the coordinator's budget (both lowered to one
    largest message), each refused with RESOURCE_EXHAUSTED naming its setting."""
    largest = LimitsSection(max_chunk_bytes=1 << 16).max_message_bytes
    coord = coordinator(min_sites=3, limits={
        "max_chunk_bytes": 1 << 16, "max_request_bytes_per_site": largest,
        "max_request_bytes": largest})
    body = padded_poll(largest // 2 + 1)
    assert body.ByteSize() <= largest < 2 * body.ByteSize()
    held = []
    try:
        for site in ("d", "e"):
            stub = raw_stub(pki_layout, coord.address, cert_of=site)
            assert status_of(stub.Enroll, pb.EnrollRequest(agent_version="bytes/1"),
                             timeout=10) == grpc.StatusCode.OK
            if site == "d":
                held.append(stub.WaitForRound.future(body, timeout=60))
                # The poll is held (no round can open): its bytes stay in d's share.
                assert _until(lambda: coord.engine.sessions.sites["d"].is_waiting, 30), \
                    "d's poll never opened"
                with pytest.raises(grpc.RpcError) as refused:
                    stub.WaitForRound(body, timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "(limits.max_request_bytes_per_site)" in (refused.value.details() or "")
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    stub.WaitForRound(body, timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "(limits.max_request_bytes)" in (refused.value.details() or "")
                # A small call of e fits the budget still.
                assert status_of(stub.Heartbeat, pb.HeartbeatRequest(round=0),
                                 timeout=10) != grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for call in held:
            call.cancel()
    assert _refused(coord, "d") == 1 and _refused(coord, "e") == 1


def test_call_limits_are_settings_with_validated_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults are the shares above; the environment overrides them like any setting;
    a share below one largest message, or a budget below one site's share, is refused
    naming the field."""
    base = {"pki": "pki", "state": "state"}
    default = load_settings(CoordinatorSettings, overrides=base).limits
    assert (default.max_calls_per_site, default.max_request_bytes_per_site,
            default.max_request_bytes) == (16, 16 << 20, 256 << 20)
    monkeypatch.setenv("MEDFED_COORDINATOR_LIMITS__MAX_CALLS_PER_SITE", "32")
    assert load_settings(CoordinatorSettings, overrides=base).limits.max_calls_per_site == 32
    monkeypatch.delenv("MEDFED_COORDINATOR_LIMITS__MAX_CALLS_PER_SITE")
    with pytest.raises(ConfigError, match=r"limits\.max_calls_per_site"):
        load_settings(CoordinatorSettings, overrides={**base, "limits": {"max_calls_per_site": 4}})
    with pytest.raises(ConfigError, match="below one largest message"):
        load_settings(CoordinatorSettings, overrides={
            **base, "limits": {"max_request_bytes_per_site": 1 << 20}})
    with pytest.raises(ConfigError, match="budget must hold at least one site's share"):
        load_settings(CoordinatorSettings, overrides={
            **base, "limits": {"max_request_bytes": 8 << 20}})
