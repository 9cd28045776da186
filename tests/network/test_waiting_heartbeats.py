"""A site waiting between rounds is alive only while it beats, over real mTLS.

Enroll tells a site the heartbeat interval; a WaitForRound long-poll that promises
heartbeats (round 0) and gets none is `silent` in the coordinator's status after 1.5
intervals, also once the poll timed out and the site did not renew it (a live agent
polls again at once); a site that beats and polls is `waiting`. (A real agent process
frozen between rounds: tests/e2e/test_status_silent.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from common.proto.medfed.v1 import federation_pb2 as pb
from tests.network.conftest import InProcessCoordinator, PkiLayout, raw_stub, status_of

HEARTBEAT_SECONDS = 0.5


def state_of(coord: InProcessCoordinator, site: str) -> str:
    """The site's word in the coordinator's status, read on its event loop."""

    async def read() -> str:
        return {s.site_id: s.state for s in coord.engine.status().sites}[site]

    return asyncio.run_coroutine_threadsafe(read(), coord.loop).result(10)


def until_state(coord: InProcessCoordinator, site: str, wanted: str, *, timeout: float,
                meanwhile: Callable[[], object] = lambda: None) -> None:
    end = time.monotonic() + timeout
    while (state := state_of(coord, site)) != wanted:
        assert time.monotonic() < end, f"site {site} stayed {state}, never {wanted}"
        meanwhile()


def test_a_poll_holder_that_stops_beating_is_silent_until_it_beats_again(
    pki_layout: PkiLayout,
    coordinator: Callable[..., InProcessCoordinator],
) -> None:
    coord = coordinator(min_sites=3, deadlines={"heartbeat_seconds": HEARTBEAT_SECONDS})
    site = raw_stub(pki_layout, coord.address, cert_of="d")
    enrolled = site.Enroll(pb.EnrollRequest(agent_version="poll/1"), timeout=10)
    assert enrolled.heartbeat_ms == HEARTBEAT_SECONDS * 1000

    # The poll promises beats and none come: silent while it is open ...
    poll = site.WaitForRound.future(
        pb.WaitForRoundRequest(wait_seconds=1, heartbeats=True), timeout=30)
    until_state(coord, "d", "silent", timeout=30)
    # ... and after it timed out with no new poll.
    assert not poll.result(timeout=30).has_round
    assert state_of(coord, "d") == "silent"

    # Polling and beating again: waiting.
    renewed = site.WaitForRound.future(
        pb.WaitForRoundRequest(wait_seconds=60, heartbeats=True), timeout=90)
    try:
        until_state(coord, "d", "waiting", timeout=30, meanwhile=lambda: site.Heartbeat(
            pb.HeartbeatRequest(round=0), timeout=10))
    finally:
        renewed.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        renewed.result(timeout=30)

    # A waiting beat needs an enrolled site.
    stranger = raw_stub(pki_layout, coord.address, cert_of="e")
    assert status_of(stranger.Heartbeat, pb.HeartbeatRequest(round=0),
                     timeout=10) == grpc.StatusCode.FAILED_PRECONDITION
