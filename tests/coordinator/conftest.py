"""A real RoundEngine over a real SQLite state database, without sockets: for the
long-poll and selection bookkeeping the coordinator modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings, load_settings
from common.core.errors import CryptoError
from common.crypto.signing import VerifyingKey
from coordinator.engine import RoundEngine
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import CoordinatorStore


def refuse_identity(site_id: str, certificate_der: bytes) -> VerifyingKey:
    raise CryptoError("no identities in this test")


@pytest.fixture()
def engine(tmp_path: Path) -> Iterator[RoundEngine]:
    settings = load_settings(
        CoordinatorSettings,
        overrides={"pki": tmp_path, "state": tmp_path, "min_sites": 2},
    )
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    built = RoundEngine(settings, store, identity=refuse_identity, metrics=CoordinatorMetrics(),
                        model_without_study=flat_model(8))
    yield built
    store.close()
