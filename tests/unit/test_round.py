"""`common.rounds.announcement`: the one announcement, its digest, and its wire round trip."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import pytest

from common.core.codec import TensorSpec
from common.core.config import SitePolicySection
from common.core.errors import (
    AbortReason,
    CertificateRejected,
    MedfedError,
    ProtocolAbort,
    RoundFailed,
    StateError,
    Unauthenticated,
    Unavailable,
    ValidationError,
)
from common.core.modelfile import flat_layout
from common.rounds import wire
from common.rounds.announcement import Announcement, validate_for_site

ANN = Announcement(
    round_number=7, round_nonce=bytes(range(16)), participants=("alpha", "beta", "gamma"),
    threshold=2, neighbours=0, vector_length=8 + 1 + 4, quantization_bits=20, clip=1.0,
    histogram_bins=2, secure_aggregation=True, model_layout=flat_layout(8),
    model_sha256=bytes(32), model_bytes=32, local_epochs=1, learning_rate=0.1,
    fedprox_mu=0.0, planned_rounds=5, train_deadline_ms=1_700_000_000_000,
    phase_timeout_ms=30_000, weight_cap=100, max_chunk_bytes=1 << 20,
)

# One changed value per field: every field a site is told changes the digest.
CHANGES: dict[str, Any] = {
    "round_number": 8, "round_nonce": bytes(16), "participants": ("alpha", "beta"),
    "threshold": 3, "neighbours": 2, "vector_length": 14, "quantization_bits": 21,
    "clip": 0.5, "histogram_bins": 3, "secure_aggregation": False,
    "model_layout": (TensorSpec("w", "<f4", (2, 4)),), "model_sha256": b"\x01" * 32,
    "model_bytes": 33, "local_epochs": 0, "learning_rate": 0.2, "fedprox_mu": 0.1,
    "planned_rounds": 6, "train_deadline_ms": 1_700_000_000_001, "phase_timeout_ms": 30_001,
    "weight_cap": 99, "max_chunk_bytes": 1 << 16, "heartbeat_ms": 2_000,
    "study_sha256": b"\x02" * 32, "kind": "statistics", "statistics": b"{}",
    "hospital_noise_multiplier": 1.5, "hospital_intermediaries": 3,
    "hospital_norm_segment": True, "histogram_edges": (0.0, 0.5, 1.0),
    "release_name": "statistics", "release_payload": b"{}",
}


def test_every_field_is_in_the_digest() -> None:
    assert {f.name for f in dataclasses.fields(Announcement)} == set(CHANGES)
    digests = {ANN.digest()}
    for name, value in CHANGES.items():
        digests.add(dataclasses.replace(ANN, **{name: value}).digest())
    assert len(digests) == 1 + len(CHANGES)
    assert len(ANN.digest()) == 32


def test_length_prefixes_keep_participant_lists_apart() -> None:
    split = dataclasses.replace(ANN, participants=("ab", "c"))
    joined = dataclasses.replace(ANN, participants=("a", "bc"))
    assert split.digest() != joined.digest()


def test_the_wire_round_trip_keeps_the_announcement_and_its_digest() -> None:
    back = wire.announcement_from_pb(wire.announcement_to_pb(ANN))
    assert back == ANN
    assert back.digest() == ANN.digest()


def test_validate_for_site_returns_the_secagg_parameters() -> None:
    rnd = validate_for_site(ANN, policy=SitePolicySection(max_colluding_sites=0),
                            site_id="beta")
    assert rnd.number == 7 and rnd.announcement is ANN
    assert rnd.params is not None and rnd.params.participants == ANN.participants
    assert rnd.phase_timeout == 30.0
    # The announcement digest is bound into the session.
    assert rnd.params.announcement_digest == ANN.digest()


@pytest.mark.parametrize(
    ("participants", "policy"),
    [
        (("beta", "gamma"), SitePolicySection(max_colluding_sites=0)),  # default floor 3
        (("alpha", "beta", "gamma"), SitePolicySection(min_round_sites=4)),
        # T = 2 colluders need T + 2 = 4 sites, whatever min_round_sites says.
        (("alpha", "beta", "gamma"),
         SitePolicySection(min_round_sites=2, max_colluding_sites=2, min_threshold=3)),
    ],
)
def test_abort_when_round_has_only_two_sites(
    participants: tuple[str, ...], policy: SitePolicySection
) -> None:
    """A sum of two hands each party the other's update: refused before anything is
    computed, with the abort reason the site logs."""
    with pytest.raises(ProtocolAbort) as caught:
        validate_for_site(
            dataclasses.replace(ANN, participants=participants, threshold=2),
            policy=policy, site_id="beta",
        )
    assert caught.value.reason is AbortReason.ROUND_TOO_SMALL


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"participants": ("alpha", "gamma")}, RoundFailed),
        ({"round_nonce": bytes(15)}, ValidationError),
        ({"vector_length": 12}, ValidationError),
        ({"secure_aggregation": False}, RoundFailed),  # this site's policy needs SecAgg
    ],
)
def test_validate_for_site_refuses(changes: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        validate_for_site(dataclasses.replace(ANN, **changes),
                          policy=SitePolicySection(max_colluding_sites=0), site_id="beta")


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (CertificateRejected("x"), grpc.StatusCode.PERMISSION_DENIED),
        (ValidationError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (ProtocolAbort(AbortReason.WRONG_ROUND, "x"), grpc.StatusCode.ABORTED),
        (StateError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (MedfedError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_one_table_maps_errors_to_status_codes(exc: BaseException, code: grpc.StatusCode
                                               ) -> None:
    assert wire.status_for(exc) is code
