"""Two coordinators on one state folder: the second is refused before it binds a port
or touches the state database, naming the folder and the first (real mTLS coordinator,
real SQLite state); once the first stops, the folder is free again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.core.errors import StateError
from tests.network.conftest import InProcessCoordinator, PkiLayout, coordinator_settings


def test_a_second_coordinator_on_the_same_state_folder_is_refused(
    pki_layout: PkiLayout, tmp_path: Path
) -> None:
    state = tmp_path / "coordinator"
    with InProcessCoordinator(coordinator_settings(pki_layout, state)) as first:
        second = InProcessCoordinator(coordinator_settings(pki_layout, state))
        with pytest.raises(StateError) as refused:
            second.__enter__()
        message = str(refused.value)
        assert str(state) in message and f"pid {os.getpid()}" in message
        assert "coordinator" in message
        # The first is untouched: still serving its round.
        assert first.engine.store.next_round_number() >= 1
    with InProcessCoordinator(coordinator_settings(pki_layout, state)) as again:
        assert again.port > 0
