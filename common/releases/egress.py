"""The egress manifest: every value a site sends the coordinator, and what protects it.

Two tables, both checked by tests against the code that sends:

* `SITE_FIELDS`: every field of every site -> coordinator message of
  protos/medfed/v1/federation.proto (`tests/privacy/test_egress_manifest.py` walks the
  proto descriptor and fails on a field missing here, so a new field cannot leak
  unnoticed);
* `SEGMENT_KINDS`: the segments of the masked vector a site uploads. A round's vector is
  an `EgressManifest` (an ordered list of `VectorSegment`); the site builds its upload
  from it (`EgressManifest.encode`) and the coordinator splits the sum with the same
  list (`EgressManifest.decode_integers`), so `vector_length` derives from it alone.

docs/privacy.md carries `render_markdown()` between the egress-manifest markers
(`python -m common.releases.seam` prints it, every release registered; a test keeps
the two equal).

Segments are ``quantized`` floats (clipped, stochastically rounded, Bonawitz et
al. 2017 fixed-point encoding), signed ``integer`` counts, or ``ring`` words a site
encoded itself (the DDGauss-encoded update of hospital-level DP, already reduced into the
ring: `common.privacy.hospital`). Integers go into the ring
Z_{2^32} as two's complement, so DP noise added by the site (which can make a count
negative) sums correctly; the coordinator reads the sum back as a signed int32.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal

import numpy as np

from common.core.errors import ValidationError
from common.crypto.quantize import max_integer_for_sites, quantize
from common.privacy.purpose import PURPOSES


class Protection(StrEnum):
    """How a value that leaves a site is protected."""

    PUBLIC = "public"  # configuration / protocol state the coordinator already holds
    CRYPTO = "crypto"  # SecAgg+ key material, signatures, encrypted shares: no data
    MASKED = "masked"  # inside the SecAgg+ masked vector: see its segments
    DP = "dp"  # a DP release, recorded on the site's ledger before it leaves
    DP_DERIVED = "dp-derived"  # computed only from DP releases and public configuration


@dataclass(frozen=True)
class FieldEntry:
    protection: Protection
    description: str
    ledger_purpose: str = ""  # for DP / DP_DERIVED: the ledger purpose it comes from


def _f(protection: Protection, description: str, purpose: str = "") -> FieldEntry:
    return FieldEntry(protection, description, purpose)


ALL_PURPOSES: Final = ", ".join(PURPOSES)
"""The composed spend and the signed history: every purpose."""

P, C, M, D, DD = (
    Protection.PUBLIC,
    Protection.CRYPTO,
    Protection.MASKED,
    Protection.DP,
    Protection.DP_DERIVED,
)

SITE_FIELDS: Final[dict[str, FieldEntry]] = {
    # --- Membership
    "EnrollRequest.agent_version": _f(P, "software version string"),
    "EnrollRequest.budget": _f(DD, "BudgetStatus (below)"),
    "EnrollRequest.device": _f(P, "cpu / cuda:N, for dashboards"),
    "WaitForRoundRequest.wait_seconds": _f(P, "long-poll length"),
    "WaitForRoundRequest.after_round": _f(P, "last round number the site heard of"),
    "WaitForRoundRequest.budget": _f(DD, "BudgetStatus (below)"),
    "WaitForRoundRequest.heartbeats": _f(P, "whether the site beats while this poll is open"),
    "DeclineRoundRequest.round": _f(P, "announced round number"),
    "DeclineRoundRequest.reason": _f(
        DD, "budget exhausted / evaluations used / query not approved / model out of "
        "bounds / not ready: follows from the ledger (DP mechanisms only), the site's "
        "approvals, and the served model against the study's public weight bound"
    ),
    "DeclineRoundRequest.budget": _f(DD, "BudgetStatus (below)"),
    "BudgetStatus.epsilon_budget": _f(P, "the site's own configured budget"),
    "BudgetStatus.epsilon_spent": _f(
        DD,
        "composed epsilon of the ledger: its mechanisms' parameters (sample rates from "
        "the DP cohort count, never from N)",
        ALL_PURPOSES,
    ),
    "BudgetStatus.delta": _f(P, "the site's configured delta"),
    "BudgetStatus.privacy_unit": _f(P, "record / patient / hospital (configuration)"),
    "BudgetStatus.exhausted": _f(DD, "whether the ledger can pay the next round"),
    "BudgetStatus.ledger_entries": _f(DD, "how many ledger entries (releases) exist"),
    "BudgetStatus.ledger_head": _f(DD, "hash of the last signed ledger entry"),
    "BudgetStatus.ledger_last_round": _f(DD, "round of the last ledger entry"),
    # --- Ledger replica
    "ReplicateLedgerRequest.history": _f(
        DD,
        "signed ledger entries after the replica's head: mechanism parameters and "
        "composed epsilons only, never data",
        ALL_PURPOSES,
    ),
    # --- Model download
    "DownloadModelRequest.round": _f(P, "announced round number"),
    "DownloadFinalModelRequest.study_sha256": _f(P, "hash of the study the site joined"),
    "HeartbeatRequest.round": _f(
        P, "announced round number (0: waiting in its long-poll); the beat itself says "
        "only that the site is alive"
    ),
    # --- SecAgg+ (Bell et al. 2020)
    "AdvertiseKeysRequest.round": _f(P, "announced round number"),
    "AdvertiseKeysRequest.round_nonce": _f(P, "echo of the announced nonce"),
    "AdvertiseKeysRequest.encryption_public_key": _f(C, "fresh X25519 public key"),
    "AdvertiseKeysRequest.masking_public_key": _f(C, "fresh X25519 public key"),
    "AdvertiseKeysRequest.signature": _f(C, "signature over the advertised keys"),
    "ShareKeysRequest.round": _f(P, "announced round number"),
    "ShareKeysRequest.session_id": _f(P, "hash of the signed roster"),
    "ShareKeysRequest.shares": _f(C, "EncryptedShare (below)"),
    "ShareKeysRequest.self_mask_commitment": _f(C, "hash commitment to the self-mask seed"),
    "EncryptedShare.peer_site_id": _f(P, "recipient site id (from the roster)"),
    "EncryptedShare.ciphertext": _f(C, "AEAD ciphertext of Shamir shares for a peer"),
    "MaskedInputChunk.header": _f(P, "MaskedInputHeader (below)"),
    "MaskedInputChunk.chunk": _f(M, "ModelChunk of the masked vector (segments below)"),
    "MaskedInputHeader.round": _f(P, "announced round number"),
    "MaskedInputHeader.session_id": _f(P, "hash of the signed roster"),
    "MaskedInputHeader.vector_length": _f(P, "length of the round's manifest"),
    "ModelChunk.offset": _f(P, "byte offset (the vector's layout is public)"),
    "ModelChunk.data": _f(M, "masked ring elements: see the masked vector's segments"),
    "ConsistencyCheckRequest.round": _f(P, "announced round number"),
    "ConsistencyCheckRequest.session_id": _f(P, "hash of the signed roster"),
    "ConsistencyCheckRequest.signature": _f(C, "signature over the survivor list"),
    "UnmaskRequest.round": _f(P, "announced round number"),
    "UnmaskRequest.session_id": _f(P, "hash of the signed roster"),
    "UnmaskRequest.shares": _f(C, "RevealedShare (below)"),
    "RevealedShare.owner_site_id": _f(P, "whose secret the share belongs to"),
    "RevealedShare.kind": _f(P, "self-mask seed or masking key (protocol rule)"),
    "RevealedShare.share": _f(C, "Shamir share, only as the protocol allows"),
}
"""Every field of every site -> coordinator message (request types of the Federation
service, and every message type they contain)."""


# ------------------------------------------------------------------ masked vector

Encoding = Literal["quantized", "integer", "ring"]


@dataclass(frozen=True)
class SegmentKind:
    """One kind of masked-vector segment and what protects it beyond the masking."""

    name: str
    encoding: Encoding
    protection: Protection  # MASKED (only the secure sum leaves), DP, or DP_DERIVED
    mechanism: str  # what makes it DP ("" for MASKED)
    ledger_purpose: str  # "" for MASKED
    description: str


MODEL_UPDATE: Final = "model_update"
WEIGHT: Final = "weight"
EVALUATION_HISTOGRAM: Final = "evaluation_histogram"
STATISTICS: Final = "statistics"
HOSPITAL_UPDATE: Final = "hospital_update"

SEGMENT_KINDS: Final[dict[str, SegmentKind]] = {}


def register_segment_kind(kind: SegmentKind) -> SegmentKind:
    """Add a segment kind (idempotent for an identical kind; a clash is an error)."""
    existing = SEGMENT_KINDS.get(kind.name)
    if existing is not None and existing != kind:
        raise ValidationError(f"segment kind {kind.name!r} registered twice, differently")
    if kind.protection in (Protection.DP, Protection.DP_DERIVED) and not kind.ledger_purpose:
        raise ValidationError(f"segment kind {kind.name!r}: a DP segment names its ledger purpose")
    SEGMENT_KINDS[kind.name] = kind
    return kind


register_segment_kind(SegmentKind(
    MODEL_UPDATE, "quantized", Protection.DP,
    "DP-SGD (sampled Gaussian, noise planned by the site)", "training",
    "local model delta x weight / weight_cap, clipped and quantized",
))
register_segment_kind(SegmentKind(
    WEIGHT, "integer", Protection.DP_DERIVED,
    "min(DP cohort count, weight_cap): post-processing of the count release", "count",
    "FedAvg weight of the site (0 in evaluation-only rounds)",
))
register_segment_kind(SegmentKind(
    EVALUATION_HISTOGRAM, "integer", Protection.DP,
    "distributed discrete Gaussian on integer counts, one score per privacy unit "
    "(Kairouz et al. 2021)", "evaluation",
    "held-out score histogram of the global model, 2 x bins (negatives, positives), "
    "counted with the round's announced bucket edges",
))


register_segment_kind(SegmentKind(
    STATISTICS, "integer", Protection.DP,
    "distributed discrete Gaussian on integer counts and randomly rounded clipped sums, "
    "one value per privacy unit and feature (Kairouz et al. 2021; common/releases/statistics.py)",
    "statistics",
    "the study's once-per-study preprocessing release (statistics round only): units, "
    "per-feature clipped sums and squares, missing counts, log-bin histograms, level counts",
))

register_segment_kind(SegmentKind(
    HOSPITAL_UPDATE, "ring", Protection.DP,
    "distributed discrete Gaussian on the whole update, clipped to L2 <= S per hospital "
    "(Kairouz et al. 2021: rotation, conditional rounding, noise shares, modular clipping)",
    "training",
    "hospital-level DP rounds only (privacy.unit = hospital): the local model delta, "
    "clipped to update_clip_norm, DDGauss-encoded into ring words (limbs when the ring "
    "is wider than 32 bits); per intermediary under intermediaries = auto, each with "
    "its norm coordinate c * min(||delta||, S) appended before the rotation (masked "
    "and noised with the update; sensitivity S sqrt(1 + c^2))",
))


@dataclass(frozen=True)
class VectorSegment:
    kind: str
    length: int


@dataclass(frozen=True)
class EgressManifest:
    """The ordered segments of one round's masked vector (quantized ones first)."""

    segments: tuple[VectorSegment, ...]

    def __post_init__(self) -> None:
        names = [s.kind for s in self.segments]
        if len(set(names)) != len(names):
            raise ValidationError(f"manifest repeats a segment: {names}")
        seen_integer = False
        for segment in self.segments:
            kind = SEGMENT_KINDS.get(segment.kind)
            if kind is None:
                raise ValidationError(f"segment {segment.kind!r} is not in the egress manifest")
            if isinstance(segment.length, bool) or not isinstance(segment.length, int) or (
                segment.length < 0
            ):
                raise ValidationError(f"segment {segment.kind!r} has a bad length")
            if kind.encoding != "quantized":
                seen_integer = True
            elif seen_integer:
                raise ValidationError("quantized segments must precede integer segments")

    @property
    def vector_length(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def float_length(self) -> int:
        return sum(s.length for s in self.segments if SEGMENT_KINDS[s.kind].encoding == "quantized")

    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.segments)

    def slice_of(self, name: str) -> slice:
        start = 0
        for segment in self.segments:
            if segment.kind == name:
                return slice(start, start + segment.length)
            start += segment.length
        raise ValidationError(f"segment {name!r} is not in this round's manifest")

    def encode(
        self,
        values: Mapping[str, np.ndarray | Sequence[int]],
        *,
        clip: float,
        bits: int,
        n_sites: int,
        rng: np.random.Generator,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The plaintext ring vector of one site: every segment, nothing else.

        Refuses a value for a segment not in the manifest, a missing one, or a wrong
        length. Integers saturate at +-half of `max_integer_for_sites` (the signed range
        whose sum over `n_sites` cannot wrap) instead of being refused: they are public
        values or noised DP releases, so saturating is post-processing, and a count
        that a site's data pushes past the range is still sent, never a refusal (a
        dropout the coordinator could read as a fact about the data)."""
        extra = sorted(set(values) - set(self.kinds()))
        missing = sorted(set(self.kinds()) - set(values))
        if extra or missing:
            raise ValidationError(
                f"egress values do not match the manifest: extra {extra}, missing {missing}"
            )
        if out is None:
            out = np.empty(self.vector_length, dtype=np.uint32)
        if out.dtype != np.uint32 or out.ndim != 1 or out.size != self.vector_length:
            raise ValidationError("egress output must be a uint32 vector of vector_length")
        limit = max_integer_for_sites(n_sites) // 2
        for segment in self.segments:
            part = out[self.slice_of(segment.kind)]
            value = values[segment.kind]
            if SEGMENT_KINDS[segment.kind].encoding == "quantized":
                floats = np.asarray(value)
                if floats.size != segment.length:
                    raise ValidationError(
                        f"segment {segment.kind!r}: {floats.size} values, expected "
                        f"{segment.length}"
                    )
                quantize(floats, clip=clip, bits=bits, rng=rng, out=part)
                continue
            if SEGMENT_KINDS[segment.kind].encoding == "ring":
                words = np.asarray(value)
                if words.dtype != np.uint32 or words.shape != (segment.length,):
                    raise ValidationError(
                        f"segment {segment.kind!r}: expected {segment.length} uint32 ring words"
                    )
                part[:] = words
                continue
            integers = np.asarray(value)
            if integers.shape != (segment.length,) or (
                integers.size and not np.issubdtype(integers.dtype, np.integer)
            ):
                raise ValidationError(
                    f"segment {segment.kind!r}: expected {segment.length} integers"
                )
            wide = np.clip(integers.astype(np.int64), -limit, limit)
            part[:] = (wide % (1 << 32)).astype(np.uint32)
        return out

    def decode_integers(self, aggregate: np.ndarray) -> dict[str, np.ndarray]:
        """The signed int64 sums of every integer segment of a ring sum."""
        if aggregate.dtype != np.uint32 or aggregate.ndim != 1 or (
            aggregate.size != self.vector_length
        ):
            raise ValidationError("aggregate does not match the round's manifest")
        return {
            segment.kind: aggregate[self.slice_of(segment.kind)].view(np.int32).astype(np.int64)
            for segment in self.segments
            if SEGMENT_KINDS[segment.kind].encoding == "integer"
        }


def round_manifest(
    *, model_elements: int, histogram_bins: int, extra: Sequence[VectorSegment] = (),
    hospital_words: int | None = None,
) -> EgressManifest:
    """A training/evaluation round's vector: model update, weight, score histogram
    (then any `extra` integer segments a round type adds, e.g. statistics). With
    `hospital_words`, the update is the DDGauss-encoded ring segment of that length."""
    update = (VectorSegment(MODEL_UPDATE, model_elements) if hospital_words is None
              else VectorSegment(HOSPITAL_UPDATE, hospital_words))
    return EgressManifest((
        update,
        VectorSegment(WEIGHT, 1),
        VectorSegment(EVALUATION_HISTOGRAM, 2 * histogram_bins),
        *extra,
    ))


# ---------------------------------------------------------------------- docs table

DOCS_BEGIN: Final = (
    "<!-- egress-manifest:begin (generated by `python -m common.releases.seam`) -->")
DOCS_END: Final = "<!-- egress-manifest:end -->"


def render_markdown() -> str:
    """The docs/privacy.md tables (fields per RPC message, then segments)."""
    lines = [
        "| Message field (site -> coordinator) | Protection | What it is | Ledger purpose |",
        "|---|---|---|---|",
    ]
    for name, entry in SITE_FIELDS.items():
        lines.append(
            f"| `{name}` | {entry.protection.value} | {entry.description} | "
            f"{entry.ledger_purpose or '-'} |"
        )
    lines += [
        "",
        "| Masked-vector segment | Encoding | Protection | Mechanism | Ledger purpose | "
        "What it is |",
        "|---|---|---|---|---|---|",
    ]
    for kind in SEGMENT_KINDS.values():
        lines.append(
            f"| `{kind.name}` | {kind.encoding} | masked + {kind.protection.value} | "
            f"{kind.mechanism or '-'} | {kind.ledger_purpose or '-'} | {kind.description} |"
        )
    return "\n".join(lines) + "\n"
