"""protobuf <-> dataclass translation with validation at the trust boundary.

Both services use these functions, so a message is checked the same way whichever
side reads it: every string, byte field and list is bounded before anything else
looks at it. Problems raise `ValidationError` (gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import grpc

from common.core.codec import TensorSpec
from common.core.errors import (
    CertificateRejected,
    ConfigError,
    CryptoError,
    MedfedError,
    ProtocolAbort,
    ResourceExhausted,
    StateError,
    Unauthenticated,
    Unavailable,
    ValidationError,
)
from common.privacy.budget import BudgetReport
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol.secagg import messages as sm
from common.releases.seam import KIND_HOSPITAL, KIND_RELEASE, KIND_STATISTICS, KIND_TRAINING
from common.rounds.announcement import (
    MAX_HISTOGRAM_EDGES,
    MAX_RELEASE_NAME,
    MAX_RELEASE_PAYLOAD_BYTES,
    MAX_STATISTICS_BYTES,
    Announcement,
)

SITE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_SITES = 10_000
MAX_SIGNATURE_BYTES = 160  # DER ECDSA P-256 is <= 72, Ed25519 is 64
MAX_CERTIFICATE_BYTES = 16 * 1024
MAX_CIPHERTEXT_BYTES = 512
MAX_SHARE_BYTES = 128
X25519_KEY_BYTES = 32
SESSION_ID_BYTES = 32
COMMITMENT_BYTES = sm.COMMITMENT_BYTES
MAX_TENSORS = 10_000
LEDGER_HEAD_RE = re.compile(r"[0-9a-f]{64}")
# Integers a site sends are bounded here, before any of them reaches arithmetic or the
# database: the coordinator derives its next round number from the
# largest ledger round a site reports, so an unbounded one (2^63 - 1) would overflow
# SQLite's signed 64-bit integers and stop the federation at every restart. 2^53 - 1
# is exact in a double (JSON, Prometheus) and leaves room for +1 anywhere.
MAX_ROUND_NUMBER = (1 << 53) - 1
MAX_LEDGER_ENTRIES = 1 << 40
MAX_VECTOR_LENGTH = 1 << 28  # 1 GiB of uint32: the largest policy.max_vector_length default

# The one table from the errors medfed raises on purpose to gRPC status codes (first
# match wins, so subclasses come before their bases).
STATUS_FOR_ERROR: tuple[tuple[type[MedfedError], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CertificateRejected, grpc.StatusCode.PERMISSION_DENIED),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (CryptoError, grpc.StatusCode.INVALID_ARGUMENT),
    (ProtocolAbort, grpc.StatusCode.ABORTED),
    (StateError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (MedfedError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """gRPC status for an exception; INTERNAL for anything not raised on purpose."""
    for cls, code in STATUS_FOR_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def site_id(value: str, what: str = "site id") -> str:
    if not isinstance(value, str) or not SITE_ID_RE.match(value):
        raise ValidationError(f"{what}: invalid site id {value[:80]!r}")
    return value


def site_ids(values: Iterable[str], what: str) -> tuple[str, ...]:
    out = tuple(values)
    if len(out) > MAX_SITES:
        raise ValidationError(f"{what}: too many entries")
    return tuple(site_id(v, what) for v in out)


def uint(value: int, *, what: str, maximum: int) -> int:
    """An integer field from a site, refused (INVALID_ARGUMENT) outside 0..maximum."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise ValidationError(f"{what}: {value!r} outside 0..{maximum}")
    return value


def round_number(value: int, what: str = "round") -> int:
    """A round number from a site (request.round, after_round, ledger_last_round)."""
    return uint(value, what=what, maximum=MAX_ROUND_NUMBER)


def bounded(value: bytes, *, what: str, exact: int | None = None, maximum: int = 0) -> bytes:
    if exact is not None and len(value) != exact:
        raise ValidationError(f"{what}: expected {exact} bytes, got {len(value)}")
    if maximum and len(value) > maximum:
        raise ValidationError(f"{what}: longer than {maximum} bytes")
    return bytes(value)


def bounded_text(value: str, *, what: str, maximum: int) -> str:
    if len(value) > maximum:
        raise ValidationError(f"{what}: longer than {maximum} characters")
    return str(value)


def session_id(value: bytes) -> bytes:
    return bounded(value, what="session_id", exact=SESSION_ID_BYTES)


# ---------------------------------------------------------------- layouts


def layout_to_pb(layout: Sequence[TensorSpec]) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in layout]


def layout_from_pb(specs: Sequence[pb.TensorSpec]) -> tuple[TensorSpec, ...]:
    if len(specs) > MAX_TENSORS:
        raise ValidationError("model layout has too many tensors")
    for spec in specs:
        if len(spec.shape) > 32 or any(not 0 <= d < 1 << 40 for d in spec.shape):
            raise ValidationError(f"model layout: tensor {spec.name[:80]!r} has a bad shape")
    return tuple(TensorSpec(s.name, s.dtype, tuple(int(d) for d in s.shape)) for s in specs)


# ---------------------------------------------------------------- rounds


def announcement_to_pb(ann: Announcement) -> pb.RoundAnnouncement:
    return pb.RoundAnnouncement(
        round=ann.round_number,
        round_nonce=ann.round_nonce,
        participants=list(ann.participants),
        threshold=ann.threshold,
        neighbours=ann.neighbours,
        vector_length=ann.vector_length,
        quantization_bits=ann.quantization_bits,
        clip=ann.clip,
        histogram_bins=ann.histogram_bins,
        secure_aggregation=ann.secure_aggregation,
        model=layout_to_pb(ann.model_layout),
        model_sha256=ann.model_sha256,
        model_bytes=ann.model_bytes,
        local_epochs=ann.local_epochs,
        learning_rate=ann.learning_rate,
        fedprox_mu=ann.fedprox_mu,
        planned_rounds=ann.planned_rounds,
        train_deadline_ms=ann.train_deadline_ms,
        phase_timeout_ms=ann.phase_timeout_ms,
        weight_cap=ann.weight_cap,
        max_chunk_bytes=ann.max_chunk_bytes,
        heartbeat_ms=ann.heartbeat_ms,
        study_sha256=ann.study_sha256,
        kind=_ROUND_KIND_TO_PB[ann.kind],
        statistics=ann.statistics,
        hospital_noise_multiplier=ann.hospital_noise_multiplier,
        hospital_intermediaries=ann.hospital_intermediaries,
        hospital_norm_segment=ann.hospital_norm_segment,
        histogram_edges=list(ann.histogram_edges),
        release=ann.release_name,
        release_payload=ann.release_payload,
    )


_ROUND_KIND_TO_PB = {
    KIND_TRAINING: pb.RoundAnnouncement.TRAINING,
    KIND_STATISTICS: pb.RoundAnnouncement.STATISTICS,
    KIND_HOSPITAL: pb.RoundAnnouncement.HOSPITAL,
    KIND_RELEASE: pb.RoundAnnouncement.RELEASE,
}
_KIND_FROM_PB_ROUND: dict[int, str] = {int(v): k for k, v in _ROUND_KIND_TO_PB.items()}


def announcement_from_pb(msg: pb.RoundAnnouncement) -> Announcement:
    """Bounded translation only; `common.rounds.announcement.validate_for_site` judges the
    content."""
    return Announcement(
        round_number=msg.round,
        round_nonce=bytes(msg.round_nonce),
        participants=site_ids(msg.participants, "participants"),
        threshold=msg.threshold,
        neighbours=msg.neighbours,
        vector_length=msg.vector_length,
        quantization_bits=msg.quantization_bits,
        clip=msg.clip,
        histogram_bins=msg.histogram_bins,
        secure_aggregation=msg.secure_aggregation,
        model_layout=layout_from_pb(msg.model),
        model_sha256=bytes(msg.model_sha256),
        model_bytes=msg.model_bytes,
        local_epochs=msg.local_epochs,
        learning_rate=msg.learning_rate,
        fedprox_mu=msg.fedprox_mu,
        planned_rounds=msg.planned_rounds,
        train_deadline_ms=msg.train_deadline_ms,
        phase_timeout_ms=msg.phase_timeout_ms,
        weight_cap=msg.weight_cap,
        max_chunk_bytes=msg.max_chunk_bytes,
        heartbeat_ms=msg.heartbeat_ms,
        study_sha256=bounded(msg.study_sha256, what="study_sha256", maximum=32),
        kind=_round_kind(msg.kind),
        statistics=bounded(msg.statistics, what="statistics", maximum=MAX_STATISTICS_BYTES),
        hospital_noise_multiplier=msg.hospital_noise_multiplier,
        hospital_intermediaries=msg.hospital_intermediaries,
        hospital_norm_segment=msg.hospital_norm_segment,
        histogram_edges=_edges(msg.histogram_edges),
        release_name=bounded_text(msg.release, what="release", maximum=MAX_RELEASE_NAME),
        release_payload=bounded(msg.release_payload, what="release_payload",
                                maximum=MAX_RELEASE_PAYLOAD_BYTES),
    )


def _edges(values: Sequence[float]) -> tuple[float, ...]:
    if len(values) > MAX_HISTOGRAM_EDGES:
        raise ValidationError(f"histogram_edges: more than {MAX_HISTOGRAM_EDGES} values")
    return tuple(float(v) for v in values)


def _round_kind(value: int) -> str:
    kind = _KIND_FROM_PB_ROUND.get(int(value))
    if kind is None:
        raise ValidationError(f"unknown round kind {value}")
    return kind


def budget_from_pb(msg: pb.BudgetStatus) -> BudgetReport | None:
    """A site's budget report; None when the message carried none."""
    if not msg.ByteSize():
        return None
    values = (msg.epsilon_budget, msg.epsilon_spent, msg.delta)
    if not all(v == v and 0 <= v < 1e9 for v in values):  # NaN fails v == v
        raise ValidationError("budget: values must be finite and non-negative")
    if msg.ledger_head and not LEDGER_HEAD_RE.fullmatch(msg.ledger_head):
        raise ValidationError("budget: ledger_head must be a hex SHA-256")
    uint(msg.ledger_entries, what="budget.ledger_entries", maximum=MAX_LEDGER_ENTRIES)
    # The next round must still fit: ledger_last_round + 1 <= MAX_ROUND_NUMBER.
    uint(msg.ledger_last_round, what="budget.ledger_last_round", maximum=MAX_ROUND_NUMBER - 1)
    return BudgetReport(
        budget_epsilon=msg.epsilon_budget,
        spent_epsilon=msg.epsilon_spent,
        delta=msg.delta,
        privacy_unit=msg.privacy_unit[:16],
        exhausted=msg.exhausted,
        ledger_entries=msg.ledger_entries,
        ledger_head=msg.ledger_head,
        last_round=msg.ledger_last_round if msg.ledger_entries else None,
    )


def budget_to_pb(status: BudgetReport | None, *, privacy_unit: str, exhausted: bool
                 ) -> pb.BudgetStatus:
    """A site's ledger status as reported with every poll (None: the site keeps no
    ledger)."""
    if status is None:
        return pb.BudgetStatus(privacy_unit=privacy_unit)
    return pb.BudgetStatus(
        epsilon_budget=status.budget_epsilon,
        epsilon_spent=status.spent_epsilon,
        delta=status.delta,
        privacy_unit=status.privacy_unit,
        exhausted=status.exhausted or exhausted,
        ledger_entries=status.ledger_entries,
        ledger_head=status.ledger_head,
        ledger_last_round=status.last_round or 0,
    )


# ---------------------------------------------------------------- phase 1


def advertise_from_pb(req: pb.AdvertiseKeysRequest, *, caller: str) -> sm.AdvertiseKeys:
    return sm.AdvertiseKeys(
        site_id=caller,
        encryption_public_key=bounded(
            req.encryption_public_key, what="encryption_public_key", exact=X25519_KEY_BYTES
        ),
        masking_public_key=bounded(
            req.masking_public_key, what="masking_public_key", exact=X25519_KEY_BYTES
        ),
        signature=bounded(req.signature, what="signature", maximum=MAX_SIGNATURE_BYTES),
    )


def advertise_to_pb(msg: sm.AdvertiseKeys, *, round_number: int, nonce: bytes) -> (
    pb.AdvertiseKeysRequest
):
    return pb.AdvertiseKeysRequest(
        round=round_number,
        round_nonce=nonce,
        encryption_public_key=msg.encryption_public_key,
        masking_public_key=msg.masking_public_key,
        signature=msg.signature,
    )


def roster_to_pb(roster: sm.Roster) -> pb.AdvertiseKeysResponse:
    return pb.AdvertiseKeysResponse(
        roster=[
            pb.RosterEntry(
                site_id=e.site_id,
                encryption_public_key=e.encryption_public_key,
                masking_public_key=e.masking_public_key,
                signature=e.signature,
                certificate_der=e.certificate_der,
            )
            for e in roster.entries
        ]
    )


def roster_from_pb(resp: pb.AdvertiseKeysResponse) -> sm.Roster:
    if len(resp.roster) > MAX_SITES:
        raise ValidationError("roster: too many entries")
    return sm.Roster(
        entries=tuple(
            sm.RosterEntry(
                site_id=site_id(e.site_id, "roster"),
                encryption_public_key=bounded(
                    e.encryption_public_key, what="roster key", exact=X25519_KEY_BYTES
                ),
                masking_public_key=bounded(
                    e.masking_public_key, what="roster key", exact=X25519_KEY_BYTES
                ),
                signature=bounded(
                    e.signature, what="roster signature", maximum=MAX_SIGNATURE_BYTES
                ),
                certificate_der=bounded(
                    e.certificate_der, what="roster certificate", maximum=MAX_CERTIFICATE_BYTES
                ),
            )
            for e in resp.roster
        )
    )


# ---------------------------------------------------------------- phase 2


def _shares(items: Sequence[pb.EncryptedShare], what: str) -> tuple[sm.EncryptedShare, ...]:
    if len(items) > MAX_SITES:
        raise ValidationError(f"{what}: too many shares")
    return tuple(
        sm.EncryptedShare(
            peer_site_id=site_id(s.peer_site_id, what),
            ciphertext=bounded(
                s.ciphertext, what=f"{what} ciphertext", maximum=MAX_CIPHERTEXT_BYTES
            ),
        )
        for s in items
    )


def _shares_to_pb(shares: Sequence[sm.EncryptedShare]) -> list[pb.EncryptedShare]:
    return [pb.EncryptedShare(peer_site_id=s.peer_site_id, ciphertext=s.ciphertext) for s in shares]


def share_keys_from_pb(req: pb.ShareKeysRequest) -> sm.ShareKeysOut:
    return sm.ShareKeysOut(
        shares=_shares(req.shares, "shares"),
        self_mask_commitment=bounded(
            req.self_mask_commitment, what="self_mask_commitment", exact=COMMITMENT_BYTES
        ),
    )


def share_keys_to_pb(msg: sm.ShareKeysOut, *, round_number: int, session: bytes) -> (
    pb.ShareKeysRequest
):
    return pb.ShareKeysRequest(
        round=round_number,
        session_id=session,
        shares=_shares_to_pb(msg.shares),
        self_mask_commitment=msg.self_mask_commitment,
    )


def shares_for_recipient_to_pb(msg: sm.SharesForRecipient) -> pb.ShareKeysResponse:
    return pb.ShareKeysResponse(shares=_shares_to_pb(msg.shares))


def shares_for_recipient_from_pb(resp: pb.ShareKeysResponse) -> sm.SharesForRecipient:
    return sm.SharesForRecipient(shares=_shares(resp.shares, "received shares"))


# ---------------------------------------------------------------- phase 3/4


def survivors_to_pb(msg: sm.SurvivorList) -> pb.MaskedInputResponse:
    return pb.MaskedInputResponse(survivors=list(msg.survivors), dropped=list(msg.dropped))


def survivors_from_pb(resp: pb.MaskedInputResponse) -> sm.SurvivorList:
    return sm.SurvivorList(
        survivors=site_ids(resp.survivors, "survivors"),
        dropped=site_ids(resp.dropped, "dropped"),
    )


def consistency_from_pb(req: pb.ConsistencyCheckRequest) -> sm.ConsistencySignature:
    return sm.ConsistencySignature(
        signature=bounded(req.signature, what="signature", maximum=MAX_SIGNATURE_BYTES)
    )


def signatures_to_pb(msg: sm.ConsistencySignatures) -> pb.ConsistencyCheckResponse:
    return pb.ConsistencyCheckResponse(
        signatures=[pb.SurvivorSignature(site_id=s, signature=sig) for s, sig in msg.signatures]
    )


def signatures_from_pb(resp: pb.ConsistencyCheckResponse) -> sm.ConsistencySignatures:
    if len(resp.signatures) > MAX_SITES:
        raise ValidationError("signatures: too many entries")
    return sm.ConsistencySignatures(
        signatures=tuple(
            (
                site_id(s.site_id, "signatures"),
                bounded(s.signature, what="signature", maximum=MAX_SIGNATURE_BYTES),
            )
            for s in resp.signatures
        )
    )


# ---------------------------------------------------------------- phase 5

_KIND_FROM_PB = {
    pb.RevealedShare.SELF_MASK_SEED: sm.ShareKind.SELF_MASK_SEED,
    pb.RevealedShare.MASKING_KEY: sm.ShareKind.MASKING_KEY,
}
_KIND_TO_PB = {v: k for k, v in _KIND_FROM_PB.items()}


def unmask_from_pb(req: pb.UnmaskRequest) -> sm.UnmaskShares:
    if len(req.shares) > MAX_SITES:
        raise ValidationError("unmask: too many shares")
    shares = []
    for s in req.shares:
        kind = _KIND_FROM_PB.get(s.kind)
        if kind is None:
            raise ValidationError(f"unmask: unknown share kind {s.kind}")
        shares.append(
            sm.RevealedShare(
                owner_site_id=site_id(s.owner_site_id, "unmask owner"),
                kind=kind,
                share=bounded(s.share, what="unmask share", maximum=MAX_SHARE_BYTES),
            )
        )
    return sm.UnmaskShares(shares=tuple(shares))


def unmask_to_pb(msg: sm.UnmaskShares, *, round_number: int, session: bytes) -> pb.UnmaskRequest:
    return pb.UnmaskRequest(
        round=round_number,
        session_id=session,
        shares=[
            pb.RevealedShare(owner_site_id=s.owner_site_id, kind=_KIND_TO_PB[s.kind], share=s.share)
            for s in msg.shares
        ],
    )
