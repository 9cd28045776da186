"""The evaluation buckets a round chose for the next survive a coordinator restart.

A real coordinator (mTLS sockets, SQLite state) runs a round with honest site agents,
stops, and a new one on the same state announces the next round: its announcement
carries the edges the last round chose (common.releases.evaluation_edges.next_edges), not the
default
layout a fresh coordinator would start from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from common.proto.medfed.v1 import federation_pb2 as pb
from common.releases.evaluation_edges import default_edges, round_edges
from tests.network.conftest import (
    HISTOGRAM_BINS,
    HonestSites,
    InProcessCoordinator,
    PkiLayout,
    ScriptedSite,
    coordinator_settings,
)

SITES = ("a", "b", "c", "d")


def test_restarted_coordinator_announces_the_edges_the_last_round_chose(
    pki_layout: PkiLayout, tmp_path: Path,
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
) -> None:
    state = tmp_path / "coordinator"
    with InProcessCoordinator(coordinator_settings(pki_layout, state, rounds=1)) as first:
        group = honest_sites(first.address, SITES)
        first.wait_engine_done(120)
        chosen = first.engine.model.histogram_edges
        stored = first.engine.store.evaluation_edges()
        # The sites learn that the study ended from this coordinator: join them before
        # it stops, or a site that had not yet heard would retry a closed port.
        group.join(60)
    # The round released a histogram; the next layout follows it, not the default.
    assert chosen and stored == chosen
    (edges,) = round_edges(chosen, bins=len(chosen) - 1)
    assert not np.array_equal(edges, default_edges(len(chosen) - 1))
    assert len(chosen) - 1 <= HISTOGRAM_BINS

    with InProcessCoordinator(coordinator_settings(pki_layout, state, rounds=3)) as second:
        assert second.engine.model.histogram_edges == chosen
        scripted = [ScriptedSite(pki_layout, second.address, s) for s in SITES]
        for site in scripted:
            site.enroll()
        waits = [site.stub.WaitForRound.future(pb.WaitForRoundRequest(wait_seconds=30),
                                               timeout=35) for site in scripted]
        replies = [w.result() for w in waits]
    for reply in replies:
        assert reply.has_round and reply.round.round > 1
        assert tuple(reply.round.histogram_edges) == chosen
        assert reply.round.histogram_bins == len(chosen) - 1
