"""Regression tests for fixes from the product review (site agent side).

Real PKI files, a real SQLite privacy ledger and the real SiteAgent; the coordinator
stub only records whether the agent contacted it.
"""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import ConfigError, RoundFailed, ValidationError
from common.core.modelfile import flat_layout
from common.privacy.accountant import Segment
from common.privacy.ledger import LedgerSigner, PrivacyLedger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol import pki
from common.rounds import wire
from common.rounds.announcement import Announcement, RoundPlan, VerifiedRound, validate_for_site
from site_agent.agent import SiteAgent
from site_agent.metrics import SiteMetrics
from site_agent.site_training import DpTrainingHook, LocalUpdate

SEGMENT = Segment(noise_multiplier=1.2, sample_rate=0.05, steps=20)


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.ABORTED

    def details(self) -> str:
        return "refused"


class RecordingStub:
    """Any RPC the agent makes is recorded and refused (heartbeats with an RPC error,
    as a coordinator that is gone would answer them)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "Heartbeat":
                raise Refused()
            raise ConnectionError(f"{name} must not be called")

        return call


class CountingHook:
    privacy_unit = "record"
    device = "cpu"

    def __init__(self) -> None:
        self.trained = 0

    def planned_segments(self, plan: RoundPlan, *, evaluation: object = ()) -> list[Segment]:
        return [SEGMENT]

    def train(self, plan: RoundPlan, global_flat: np.ndarray) -> LocalUpdate:
        self.trained += 1
        return LocalUpdate(np.zeros_like(global_flat), 10, np.zeros(4, np.int64), 0.0)


@pytest.fixture()
def agent_and_ledger(tmp_path: Path) -> tuple[SiteAgent, PrivacyLedger, CountingHook]:
    now = dt.datetime.now(dt.UTC)
    root = tmp_path / "pki"
    pki.init_ca(root, now=now - dt.timedelta(days=1))
    pki.issue_site(root, "alpha", now=now)
    settings = SiteSettings(
        site="alpha", coordinator="127.0.0.1:9", state=tmp_path / "state", pki=root
    )
    settings.state.mkdir()
    ledger = PrivacyLedger(
        settings.state / "privacy-ledger.db",
        site_id="alpha",
        budget_epsilon=8.0,
        delta=1e-5,
        accountant="rdp",
        privacy_unit="record",
        signer=LedgerSigner.from_files(*pki.site_paths(root, "alpha")),
    )
    hook = CountingHook()
    agent = SiteAgent(settings, hook, metrics=SiteMetrics("alpha"), ledger=ledger)
    return agent, ledger, hook


def plain_round(number: int) -> VerifiedRound:
    ann = Announcement(
        round_number=number,
        round_nonce=bytes(16),
        participants=("alpha", "beta"),
        threshold=0,
        neighbours=0,
        vector_length=8 + 1 + 4,
        quantization_bits=20,
        clip=1.0,
        histogram_bins=2,
        secure_aggregation=False,
        model_layout=flat_layout(8),
        model_sha256=bytes(32),
        model_bytes=32,
        local_epochs=1,
        learning_rate=0.1,
        fedprox_mu=0.0,
        planned_rounds=5,
        train_deadline_ms=0,
        phase_timeout_ms=1000,
        weight_cap=100,
    )
    return validate_for_site(
        ann, policy=SitePolicySection(allow_plain_aggregation=True), site_id="alpha"
    )


def test_round_already_on_the_ledger_is_refused_before_any_rpc(
    agent_and_ledger: tuple[SiteAgent, PrivacyLedger, CountingHook],
) -> None:
    """A re-announced round number would otherwise train and release a second noisy
    update while reserve() returns the existing entry (no new spend recorded)."""
    agent, ledger, hook = agent_and_ledger
    ledger.reserve(3, [SEGMENT], now=dt.datetime.now(dt.UTC))
    spent_before = ledger.spent()
    stub = RecordingStub()
    with pytest.raises(RoundFailed, match="already on this site's privacy ledger"):
        agent.rounds.run(stub, plain_round(3))  # type: ignore[arg-type]
    assert stub.calls == []
    assert hook.trained == 0
    assert ledger.spent() == spent_before
    assert len(ledger.entries()) == 1


def test_new_round_number_still_goes_to_the_coordinator(
    agent_and_ledger: tuple[SiteAgent, PrivacyLedger, CountingHook],
) -> None:
    """The refusal is specific to recorded rounds: round 4 proceeds to the download."""
    agent, ledger, _ = agent_and_ledger
    ledger.reserve(3, [SEGMENT], now=dt.datetime.now(dt.UTC))
    stub = RecordingStub()
    with pytest.raises(ConnectionError):
        agent.rounds.run(stub, plain_round(4))  # type: ignore[arg-type]
    # (Heartbeats, from their own thread, may come first.)
    assert [call for call in stub.calls if call != "Heartbeat"] == ["DownloadModel"]


def announcement(**changes: Any) -> pb.RoundAnnouncement:
    """A well-formed plain-aggregation announcement for site alpha, with `changes`."""
    fields: dict[str, Any] = {
        "round": 1,
        "round_nonce": bytes(16),
        "participants": ["alpha", "beta"],
        "vector_length": 8 + 1 + 2 * 2,
        "quantization_bits": 20,
        "clip": 1.0,
        "histogram_bins": 2,
        "secure_aggregation": False,
        "model": wire.layout_to_pb(flat_layout(8)),
        "model_sha256": bytes(32),
        "model_bytes": 32,
        "local_epochs": 1,
        "learning_rate": 0.1,
        "fedprox_mu": 0.0,
        "planned_rounds": 5,
        "phase_timeout_ms": 1000,
        "weight_cap": 100,
        "heartbeat_ms": 5000,
    }
    fields.update(changes)
    return pb.RoundAnnouncement(**fields)


PLAIN_POLICY = SitePolicySection(allow_plain_aggregation=True)


def verify(msg: pb.RoundAnnouncement) -> VerifiedRound:
    return validate_for_site(wire.announcement_from_pb(msg), policy=PLAIN_POLICY,
                             site_id="alpha")


def test_well_formed_announcement_is_accepted() -> None:
    rnd = verify(announcement())
    assert rnd.plan.learning_rate == pytest.approx(0.1)
    assert rnd.plan.local_epochs == 1
    assert rnd.plan == RoundPlan.of(rnd.announcement)


@pytest.mark.parametrize(
    "changes",
    [
        {"learning_rate": float("nan")},
        {"learning_rate": 0.0},
        {"learning_rate": -0.1},
        {"learning_rate": float("inf")},
        {"fedprox_mu": float("nan")},
        {"fedprox_mu": -1.0},
        {"local_epochs": 100_000},
        {"planned_rounds": 4_000_000_000},
        {"round": 1 << 63},
        {"heartbeat_ms": 0},
        {"heartbeat_ms": 10},
        {"heartbeat_ms": 3_600_000},
    ],
)
def test_training_plan_out_of_range_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        verify(announcement(**changes))


def test_site_setting_must_match_the_certificate(tmp_path: Path) -> None:
    """Otherwise the agent runs, but the coordinator knows it under another id and every
    announcement fails with "does not list this site"."""
    now = dt.datetime.now(dt.UTC)
    root = tmp_path / "pki"
    pki.init_ca(root, now=now - dt.timedelta(days=1))
    pki.issue_site(root, "beta", now=now)
    cert, key = pki.site_paths(root, "beta")
    settings = SiteSettings(
        site="alpha",
        coordinator="127.0.0.1:9",
        state=tmp_path / "state",
        tls_ca=root / pki.CA_CERT,
        tls_cert=cert,
        tls_key=key,
    )
    with pytest.raises(ConfigError) as caught:
        SiteAgent(settings, CountingHook(), metrics=SiteMetrics("alpha"), ledger=None)
    assert caught.value.field == "site"
    assert "'beta'" in str(caught.value)


@pytest.mark.parametrize("seed", [None, 3])
def test_fixed_dp_seed_is_loudly_flagged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seed: int | None
) -> None:
    """A fixed seed makes the DP noise predictable; the site operator must be told."""
    settings = SiteSettings(
        site="alpha",
        coordinator="127.0.0.1:9",
        state=tmp_path,
        pki=tmp_path,
        training={"seed": seed, "device": "cpu"},
    )
    with caplog.at_level(logging.WARNING, logger="medfed.site"):
        DpTrainingHook(settings, dp=True)
    flagged = any("training.seed is set" in r.getMessage() for r in caplog.records)
    assert flagged == (seed is not None)
