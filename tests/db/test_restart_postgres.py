"""A coordinator whose state lives in PostgreSQL is restarted and resumes from it.

Run 1: a coordinator on a real PostgreSQL database completes round 1 with four honest
sites over mTLS, then stops; the crash of a second run is simulated by writing round 2 as
in flight (what `begin_round` leaves behind when the process dies mid-round). Run 2 starts
with a state folder holding only the checkpoints (a shared volume) on the same
database URL: it must abandon round 2, resume from
the round-1 checkpoint and continue numbering at 3.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from coordinator.store import CoordinatorStore
from tests.network.conftest import (
    HonestSites,
    InProcessCoordinator,
    PkiLayout,
    coordinator_settings,
)

SITES = ("a", "b", "c", "d")
T = TypeVar("T")


def on_loop(coordinator: InProcessCoordinator, function: Callable[[], T]) -> T:
    """Run `function` on the coordinator's event loop (its state is not thread-safe)."""

    async def call() -> T:
        return function()

    return asyncio.run_coroutine_threadsafe(call(), coordinator.loop).result(10)


def test_coordinator_restart_resumes_from_postgresql(
    pki_layout: PkiLayout,
    tmp_path: Path,
    postgres_url: str,
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
) -> None:
    first_settings = coordinator_settings(
        pki_layout, tmp_path / "first", database_url=postgres_url, rounds=1
    )
    with InProcessCoordinator(first_settings) as first:
        sites = honest_sites(first.address, SITES)
        first.wait_engine_done(120)
        assert sites.join(60) == dict.fromkeys(SITES, 0)
        model_after_round_1 = on_loop(first, lambda: first.engine.global_flat.copy())
    assert np.any(model_after_round_1 != 0)  # round 1 really moved the model

    crashed = CoordinatorStore(postgres_url)
    crashed.begin_round(2, list(SITES), now=1e9)
    crashed.close()

    second_settings = coordinator_settings(
        pki_layout, tmp_path / "second", database_url=postgres_url, rounds=2
    )
    # A standby on another host shares the checkpoints folder (the deployment docs'
    # shared volume) but nothing else: no local state database to resume from.
    assert not (tmp_path / "second").exists()
    shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / "second" / "checkpoints")
    with InProcessCoordinator(second_settings) as second:
        engine = second.engine
        # The engine task ran `recover()` before this call reached the loop.
        last_round, start_model = on_loop(
            second, lambda: (engine.last_round_number, engine.global_flat.copy())
        )
        assert last_round == 2
        np.testing.assert_array_equal(start_model, model_after_round_1)
        assert engine.store.round_status(2) == "abandoned"
        assert engine.metrics.registry.get_sample_value(
            "medfed_coordinator_rounds_total", {"outcome": "abandoned"}
        ) == 1.0
        assert engine.store.enrolled_sites() == list(SITES)  # remembered from run 1

        sites = honest_sites(second.address, SITES)
        second.wait_engine_done(120)
        assert sites.join(60) == dict.fromkeys(SITES, 0)
        final_model = on_loop(second, lambda: engine.global_flat.copy())

    reopened = CoordinatorStore(postgres_url)
    rounds = reopened.rounds()
    assert [(r.round_number, r.status) for r in rounds] == [
        (1, "completed"), (2, "abandoned"), (3, "completed")
    ]
    assert rounds[2].survivors == SITES
    checkpoint = reopened.latest_checkpoint()
    assert checkpoint is not None and checkpoint.round_number == 3
    # Recorded relative to the state folder: found wherever that folder is mounted.
    assert checkpoint.path == Path("checkpoints/round-000003.mfm")
    assert (tmp_path / "second" / checkpoint.path).is_file()
    reopened.close()
    # Round 3 was applied on top of the round-1 model (FedAvg, server_lr 1), not on the
    # configured initial model.
    result = engine.last_result
    assert result is not None
    assert result.round_number == 3
    np.testing.assert_allclose(
        final_model, model_after_round_1 + result.mean_delta, rtol=1e-6, atol=1e-6
    )
