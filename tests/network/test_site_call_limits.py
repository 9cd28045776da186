"""One site certificate cannot starve the coordinator, over real mTLS.

A site that opens many calls at once (here: upload streams that never send a byte, each
held by the coordinator until `upload_idle_seconds`) gets its share of calls in flight
(`coordinator.call_limits.MAX_CALLS_PER_SITE`); every call beyond it, whatever the
method, is refused at once with RESOURCE_EXHAUSTED and counted, while the honest sites'
shares are untouched and they train their rounds. The share frees as the calls end.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from common.errors import ResourceExhausted
from common.proto.medfed.v1 import federation_pb2 as pb
from coordinator.call_limits import MAX_CALLS_PER_SITE, CallLimits
from tests.network.conftest import InProcessCoordinator, PkiLayout, raw_stub, status_of

FLOOD = MAX_CALLS_PER_SITE + 24


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
    coord = coordinator(rounds=2, min_sites=3, limits={"upload_idle_seconds": 120})
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
            if len(ended) == FLOOD - MAX_CALLS_PER_SITE:
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
        assert "calls in flight, the most one site may hold" in (early[0].details() or "")
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
            assert len(ended) == FLOOD - MAX_CALLS_PER_SITE  # the held ones still open
    finally:
        release.set()
    for call in calls:
        with pytest.raises(grpc.RpcError):
            call.result(timeout=30)
    assert _refused(coord, "d") == FLOOD - MAX_CALLS_PER_SITE + 1
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
