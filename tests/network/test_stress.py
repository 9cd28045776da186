"""Load and stall behaviour of the live coordinator.

- A masked-input upload that stalls after its header is cut after
  `limits.upload_idle_seconds`, frees the only staging slot and is dropped, so the
  honest sites' round completes long before the MaskedInput deadline; a stream that
  never sends its header is cut after the same idle time.
- 100 concurrent WaitForRound long-polls (100 distinct site certificates, grpc.aio on
  one event loop) stay open while Health.Check and Enroll of another site answer, and
  every one of them is answered when its wait ends and when a round opens.
- `RunningCoordinator.stop()` releases the gRPC and the Prometheus ports.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.core.state_lock import LOCK_FILE
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol import pki
from tests.network.conftest import (
    InProcessCoordinator,
    PkiLayout,
    ScriptedSite,
    coordinator_settings,
    health_status,
    raw_stub,
    read_aggregate,
    ring_sum,
    status_of,
)

SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
LONG_POLLERS = 100
PROBE_SITE = "e"  # the "other" site whose RPCs must answer while the 100 wait


# ------------------------------------------------------------ stalled upload


def test_stalled_upload_holding_the_only_slot_is_cut_and_the_round_completes_early(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    """Slow loris on a coordinator with ONE upload slot: d sends its header, takes the
    slot and stalls. Without an idle cut the honest uploads would wait for the slot
    until MaskedInput closes (20 s) and then be cut themselves; with a 1 s idle limit
    d is cut (ABORTED, upload_idle), dropped, and a, b, c finish the round at once."""
    phase_seconds = 20.0
    coord = coordinator(
        limits={"max_concurrent_uploads": 1, "upload_idle_seconds": 1.0},
        deadlines={"phase_seconds": phase_seconds},
    )
    sites = {s: ScriptedSite(pki_layout, coord.address, s) for s in ("a", "b", "c", "d")}
    for site in sites.values():
        site.enroll()
    with ThreadPoolExecutor(len(sites)) as pool:
        announcements = list(pool.map(lambda s: s.wait_for_round(), sites.values()))
        assert {tuple(a.participants) for a in announcements} == {("a", "b", "c", "d")}
        masked = dict(
            zip(
                sites,
                pool.map(lambda s: s.send_shares(s.send_advertise(s.advertise_request())),
                         sites.values()),
                strict=True,
            )
        )
        d = sites["d"]
        header = d.upload_chunks(masked["d"])[0]
        release = threading.Event()

        def stalled() -> Iterator[pb.MaskedInputChunk]:
            yield header
            release.wait(60)  # the stream stays open and sends nothing

        try:
            started = time.monotonic()
            stall = hold_the_upload_slot(d, header, stalled)
            # a, b, c start only now, so they queue behind d for the single slot.
            honest = [sites[s] for s in ("a", "b", "c")]
            replies = list(pool.map(
                lambda s: s.send_unmask(
                    s.send_consistency(s.send_upload(s.upload_chunks(masked[s.site_id])))
                ),
                honest,
            ))
            with pytest.raises(grpc.RpcError) as cut:
                stall.result(timeout=30)
        finally:
            release.set()
    assert cut.value.code() == grpc.StatusCode.ABORTED
    assert "upload_idle" in (cut.value.details() or "")
    assert all(reply.completed and reply.contributors == 3 for reply in replies)
    coord.wait_engine_done(phase_seconds)
    assert time.monotonic() - started < phase_seconds  # the deadline never had to fire
    number = announcements[0].round
    aggregate, survivors = read_aggregate(coord.settings.state, number)
    assert survivors == ("a", "b", "c")
    vectors = [sites[s].plain_vector for s in survivors]
    assert all(v is not None for v in vectors)
    assert np.array_equal(aggregate, ring_sum(vectors))  # type: ignore[arg-type]
    # d was dropped when cut: it may not upload again in this round.
    assert status_of(d.stub.UploadMaskedInput, iter([header]), timeout=10) in (
        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED
    )
    assert health_status(pki_layout, coord.address) == SERVING


def test_upload_that_never_sends_its_header_is_cut_after_the_idle_time(
    coordinator: Callable[..., InProcessCoordinator], pki_layout: PkiLayout
) -> None:
    """A stream that opens and sends nothing holds no staging slot, but it is still cut
    (ABORTED, upload_idle) instead of living until the client's own deadline."""
    coord = coordinator(limits={"upload_idle_seconds": 0.5})
    release = threading.Event()

    def silent() -> Iterator[pb.MaskedInputChunk]:
        release.wait(60)
        yield from ()

    stub = raw_stub(pki_layout, coord.address, cert_of="d")
    try:
        with pytest.raises(grpc.RpcError) as cut:
            stub.UploadMaskedInput(silent(), timeout=30)
    finally:
        release.set()
    assert cut.value.code() == grpc.StatusCode.ABORTED
    assert "upload_idle" in (cut.value.details() or "")
    assert health_status(pki_layout, coord.address) == SERVING


def hold_the_upload_slot(
    d: ScriptedSite,
    header: pb.MaskedInputChunk,
    stalled: Callable[[], Iterator[pb.MaskedInputChunk]],
) -> grpc.Future:
    """Start d's stalled stream and return once it holds the staging slot.

    Proof by the public API: a second header-only stream from d is refused with
    "already in progress" only while the first is registered, and the engine takes the
    (free) slot in the same step, without yielding. If the probe itself won the race it
    ends at once (an empty upload is INVALID_ARGUMENT) and, if it made the stalled stream
    fail as a duplicate, that stream is started again.
    """
    stall = d.stub.UploadMaskedInput.future(stalled(), timeout=60)
    for _ in range(50):
        try:
            d.stub.UploadMaskedInput(iter([header]), timeout=10)
        except grpc.RpcError as probe:
            details = probe.details() or ""
            if probe.code() == grpc.StatusCode.FAILED_PRECONDITION and "in progress" in details:
                return stall
            assert probe.code() == grpc.StatusCode.INVALID_ARGUMENT, details
        else:
            raise AssertionError("a header-only upload was accepted")
        if stall.done():
            stall = d.stub.UploadMaskedInput.future(stalled(), timeout=60)
    raise AssertionError("the stalled upload never took the slot")


# ------------------------------------------------------------ long-polls at scale


@pytest.fixture(scope="module")
def poller_ids(pki_layout: PkiLayout) -> list[str]:
    """100 more site certificates in the session PKI (ECDSA P-256: milliseconds each)."""
    now = dt.datetime.now(dt.UTC)
    ids = [f"poll{i:03d}" for i in range(LONG_POLLERS)]
    for site in ids:
        pki.issue_site(pki_layout.root, site, now=now)
    return ids


def aio_channel(pki_layout: PkiLayout, address: str, site: str) -> grpc.aio.Channel:
    cert_pem, key_pem = pki_layout.site_pair(site)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki_layout.ca_pem, private_key=key_pem, certificate_chain=cert_pem
    )
    return grpc.aio.secure_channel(address, credentials)


async def other_site_answers(
    health: health_pb2_grpc.HealthStub,
    stub: pb_grpc.FederationStub,
    pending: Sequence[grpc.aio.UnaryUnaryCall],
) -> None:
    """Health.Check and Enroll of another site answer while every long-poll is open."""
    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == SERVING
    enrolled = await stub.Enroll(pb.EnrollRequest(agent_version="probe/1"), timeout=10)
    assert enrolled.federation_id == "medfed"
    assert sum(not call.done() for call in pending) == len(pending)


async def long_poll_scenario(
    pki_layout: PkiLayout, address: str, pollers: Sequence[str]
) -> tuple[list[pb.WaitForRoundResponse], list[pb.WaitForRoundResponse]]:
    channels = {site: aio_channel(pki_layout, address, site) for site in pollers}
    probe_channel = aio_channel(pki_layout, address, PROBE_SITE)
    try:
        stubs = {site: pb_grpc.FederationStub(ch) for site, ch in channels.items()}
        probe = pb_grpc.FederationStub(probe_channel)
        health = health_pb2_grpc.HealthStub(probe_channel)
        await asyncio.gather(*(
            stub.Enroll(pb.EnrollRequest(agent_version="poller/1"), timeout=30)
            for stub in stubs.values()
        ))
        await probe_channel.channel_ready()

        # 1. No round can open (min_sites = 101, the probe is not waiting): every
        #    long-poll is answered "no round" when its own wait ends.
        calls = [
            stub.WaitForRound(pb.WaitForRoundRequest(wait_seconds=4), timeout=30)
            for stub in stubs.values()
        ]
        await other_site_answers(health, probe, calls)
        timed_out = list(await asyncio.gather(*calls))

        # 2. The 100 wait again; the probe's own long-poll makes 101 waiting sites, the
        #    round opens, and every waiting site gets the announcement.
        calls = [
            stub.WaitForRound(pb.WaitForRoundRequest(wait_seconds=60), timeout=90)
            for stub in stubs.values()
        ]
        await other_site_answers(health, probe, calls)
        probe_call = probe.WaitForRound(pb.WaitForRoundRequest(wait_seconds=60), timeout=90)
        announced = list(await asyncio.gather(*calls, probe_call))
        return timed_out, announced
    finally:
        await asyncio.gather(*(ch.close() for ch in (*channels.values(), probe_channel)))


def test_hundred_long_polls_are_held_while_other_rpcs_answer(
    coordinator: Callable[..., InProcessCoordinator],
    pki_layout: PkiLayout,
    poller_ids: list[str],
) -> None:
    coord = coordinator(
        min_sites=LONG_POLLERS + 1,
        deadlines={"round_start_timeout_seconds": 300.0, "selection_seconds": 0.5},
    )
    timed_out, announced = asyncio.run(long_poll_scenario(pki_layout, coord.address, poller_ids))
    assert len(timed_out) == LONG_POLLERS
    assert all(not r.has_round and not r.federation_finished for r in timed_out)
    everyone = sorted([*poller_ids, PROBE_SITE])
    assert len(announced) == LONG_POLLERS + 1
    assert all(r.has_round for r in announced)
    # One round for all 101: each of the 100 was still held open when the probe joined.
    assert {r.round.round for r in announced} == {1}
    assert {tuple(r.round.participants) for r in announced} == {tuple(everyone)}
    assert coord.engine_error() is None
    assert health_status(pki_layout, coord.address) == SERVING


# ------------------------------------------------------------------- shutdown


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_stop_releases_the_grpc_and_metrics_ports(pki_layout: PkiLayout, tmp_path: Path) -> None:
    running = InProcessCoordinator(coordinator_settings(pki_layout, tmp_path / "coordinator"))
    with running:
        grpc_port, metrics_port = running.port, running.metrics_port
        scrape = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=10)
        scrape.request("GET", "/metrics")
        response = scrape.getresponse()
        assert response.status == 200
        assert b"medfed_" in response.read()
        scrape.close()
        assert health_status(pki_layout, running.address) == SERVING
    assert running.stopped
    assert refuses_connections(grpc_port)
    assert refuses_connections(metrics_port)


def test_uploads_staged_on_disk_give_the_exact_sum(
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[[str, Sequence[str]], Any],
) -> None:
    """With `limits.upload_spool_bytes = 0` every masked vector is staged in a temporary
    file and added to the accumulator window by window (what very large models do, so the
    coordinator's memory does not hold an extra vector per upload): same exact sum."""
    coord = coordinator(model_dim=300_000, limits={"upload_spool_bytes": 0})
    sites = ["a", "b", "c", "d"]
    honest = honest_sites(coord.address, sites)
    assert coord.engine_done.wait(120)
    honest.join(60)
    aggregate, survivors = read_aggregate(coord.settings.state, 1)
    assert list(survivors) == sites
    assert np.array_equal(aggregate, ring_sum([honest.update(s, 1) for s in survivors]))
    # The staging files are anonymous (unlinked at creation): nothing is left behind.
    files = sorted(p.name for p in coord.settings.state.iterdir()
                   if p.is_file() and p.name != LOCK_FILE)
    assert all(name.startswith("coordinator.db") for name in files), files
