"""A round as both services see it: the one announcement dataclass, its digest, and the
checks a site runs on it before computing anything.

The coordinator builds an `Announcement`; `common.rounds.wire` carries it as a
RoundAnnouncement; a site turns it back into the same dataclass and calls
`validate_for_site`, which returns a `VerifiedRound` or raises. No other module defines
what a round is.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from common.core.codec import CHUNK_BYTES, TensorSpec
from common.core.config import SitePolicySection
from common.core.errors import AbortReason, ProtocolAbort, RoundFailed, ValidationError
from common.crypto.quantize import max_integer_for_sites
from common.privacy.hospital import HospitalTerms
from common.privacy.rotation import padded_length
from common.protocol.secagg.params import (
    SecAggParams,
    ThreatModel,
    round_floor,
    validate_against_threat_model,
)
from common.releases.egress import EgressManifest, VectorSegment, round_manifest
from common.releases.evaluation_edges import announced_edge_blocks
from common.releases.seam import (
    KIND_HOSPITAL,
    KIND_RELEASE,
    KIND_TRAINING,
    ROUND_KINDS,
    release_for_round,
)
from common.study import Study, study_round_terms
from common.study.hospital_terms import intermediaries_cap

ANNOUNCEMENT_DOMAIN = b"medfed/v1/announcement"
MAX_RELEASE_NAME = 64
MAX_HOSPITAL_LIMBS = 8
MAX_INTERMEDIARIES = 10_000  # the study schema's bound on a fixed v
MAX_STATISTICS_BYTES = 1 << 20
MAX_RELEASE_PAYLOAD_BYTES = 1 << 20
MAX_HISTOGRAM_EDGES = 2_000
"""Most bucket edges a round announces: histogram_bins (<= 1000) plus one per block."""
ROUND_NONCE_LENGTH = 16
MIN_CHUNK_BYTES = 1 << 16
DEFAULT_HEARTBEAT_MS = 5_000
MIN_HEARTBEAT_MS = 200
MAX_HEARTBEAT_MS = 300_000
"""Heartbeat intervals a site accepts: a coordinator can neither make it call many
times a second nor leave a silent site undetected for long."""


@dataclass(frozen=True)
class Announcement:
    """Everything a site is told about a round (RoundAnnouncement on the wire)."""

    round_number: int
    round_nonce: bytes
    participants: tuple[str, ...]
    threshold: int
    neighbours: int
    vector_length: int
    quantization_bits: int
    clip: float
    histogram_bins: int
    secure_aggregation: bool
    model_layout: tuple[TensorSpec, ...]
    model_sha256: bytes
    model_bytes: int
    local_epochs: int
    learning_rate: float
    fedprox_mu: float
    planned_rounds: int
    train_deadline_ms: int
    phase_timeout_ms: int
    weight_cap: int
    max_chunk_bytes: int = CHUNK_BYTES
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS
    study_sha256: bytes = b""  # SHA-256 of the study's canonical bytes (empty: none)
    kind: str = KIND_TRAINING  # KIND_STATISTICS: the once-per-study DP release;
    # KIND_HOSPITAL: training under hospital-level DP (clip = the update clip norm S)
    statistics: bytes = b""  # GlobalStatistics canonical JSON (empty before release)
    hospital_noise_multiplier: float = 0.0  # z of a HOSPITAL round (0 otherwise)
    # v of a HOSPITAL round: intermediaries per hospital this round
    # (0 otherwise); with the norm segment each unit also carries its clipped norm.
    hospital_intermediaries: int = 0
    hospital_norm_segment: bool = False
    # The evaluation histogram's bucket edges, block after block (empty: the default
    # layout; common.releases.evaluation_edges.round_edges reads and checks them).
    histogram_edges: tuple[float, ...] = ()
    # KIND_RELEASE: the registered DP release the round carries alone ("" otherwise).
    release_name: str = ""
    # KIND_RELEASE of a release built from approved bytes (a query): those bytes.
    release_payload: bytes = b""

    @property
    def release(self) -> str:
        """The DP release this round carries alone (`common.releases.seam`; "" for a model
        round or a release name nothing registered)."""
        kind = release_for_round(self.kind, self.release_name)
        return kind.name if kind is not None else ""

    @property
    def is_hospital(self) -> bool:
        return self.kind == KIND_HOSPITAL

    @property
    def model_elements(self) -> int:
        return sum(s.elements for s in self.model_layout)

    @property
    def hospital_dimension(self) -> int:
        """Length of a hospital round's unit vector before padding: d, or d + 1 with the
        norm coordinate of "auto" intermediaries (common.privacy.hospital)."""
        return max(self.model_elements, 1) + (1 if self.hospital_norm_segment else 0)

    @property
    def hospital_limbs(self) -> int:
        """Words per ring element of a hospital round's update segment, read off the
        announced length (each site checks it against the ring it plans itself;
        0 when the length fits no whole number of limbs)."""
        padded = padded_length(self.hospital_dimension)
        words = self.vector_length - 1 - 2 * self.histogram_bins
        if words <= 0 or words % padded or not 1 <= words // padded <= MAX_HOSPITAL_LIMBS:
            return 0
        return words // padded

    def manifest(self) -> EgressManifest:
        """The segments of this round's masked vector (common.releases.egress)."""
        release = self.release
        if release:
            return EgressManifest((VectorSegment(release, self.vector_length),))
        hospital_words = None
        if self.is_hospital:
            hospital_words = max(self.hospital_limbs, 1) * padded_length(
                self.hospital_dimension)
        return round_manifest(
            model_elements=self.model_elements,
            histogram_bins=self.histogram_bins,
            hospital_words=hospital_words,
        )

    def digest(self) -> bytes:
        """SHA-256 over a canonical, length-prefixed encoding of every field.

        Mixed into the SecAgg+ session id, so sites that were told different things
        about a round (a split view) end up in different sessions and the round aborts
        instead of aggregating under inconsistent terms.
        """
        out = bytearray()
        _put_bytes(out, ANNOUNCEMENT_DOMAIN)
        _put_uint(out, self.round_number)
        _put_bytes(out, self.round_nonce)
        _put_uint(out, len(self.participants))
        for site in self.participants:
            _put_bytes(out, site.encode())
        for number in (self.threshold, self.neighbours, self.vector_length,
                       self.quantization_bits):
            _put_uint(out, number)
        _put_float(out, self.clip)
        _put_uint(out, self.histogram_bins)
        _put_uint(out, int(self.secure_aggregation))
        _put_uint(out, len(self.model_layout))
        for spec in self.model_layout:
            _put_bytes(out, spec.name.encode())
            _put_bytes(out, spec.dtype.encode())
            _put_uint(out, len(spec.shape))
            for dim in spec.shape:
                _put_uint(out, dim)
        _put_bytes(out, self.model_sha256)
        _put_uint(out, self.model_bytes)
        _put_uint(out, self.local_epochs)
        _put_float(out, self.learning_rate)
        _put_float(out, self.fedprox_mu)
        for number in (self.planned_rounds, self.train_deadline_ms, self.phase_timeout_ms,
                       self.weight_cap, self.max_chunk_bytes, self.heartbeat_ms):
            _put_uint(out, number)
        _put_bytes(out, self.study_sha256)
        _put_bytes(out, self.kind.encode())
        # The statistics by hash: every site of a round standardises with the same ones.
        _put_bytes(out, hashlib.sha256(self.statistics).digest())
        _put_float(out, self.hospital_noise_multiplier)
        _put_uint(out, self.hospital_intermediaries)
        _put_uint(out, int(self.hospital_norm_segment))
        _put_uint(out, len(self.histogram_edges))
        for edge in self.histogram_edges:
            _put_float(out, edge)
        if self.kind == KIND_RELEASE or self.release_name:
            # Only then: every other announcement's digest is as it always was.
            _put_bytes(out, self.release_name.encode())
        if self.release_payload:
            # Only then, as above: the payload by hash, as the statistics.
            _put_bytes(out, hashlib.sha256(self.release_payload).digest())
        return hashlib.sha256(bytes(out)).digest()


def _put_uint(out: bytearray, value: int) -> None:
    if not 0 <= value < 1 << 64:
        raise ValidationError(f"announcement field {value} outside 0..2^64-1")
    out += value.to_bytes(8, "big")


def _put_float(out: bytearray, value: float) -> None:
    out += struct.pack(">d", value)


def _put_bytes(out: bytearray, value: bytes) -> None:
    _put_uint(out, len(value))
    out += value


@dataclass(frozen=True)
class RoundPlan:
    """The part of an announcement a training hook needs (a projection, not a copy of
    the protocol: build it with `RoundPlan.of`)."""

    round_number: int
    planned_rounds: int
    local_epochs: int
    learning_rate: float
    fedprox_mu: float
    histogram_bins: int
    layout: tuple[TensorSpec, ...]
    # Intermediaries per hospital announced for this round (1 outside hospital rounds).
    intermediaries: int = 1
    # The announced bucket edges of the evaluation histogram (empty: default layout).
    histogram_edges: tuple[float, ...] = ()

    @classmethod
    def of(cls, ann: Announcement) -> RoundPlan:
        return cls(
            round_number=ann.round_number,
            planned_rounds=max(ann.planned_rounds, 1),
            local_epochs=ann.local_epochs,
            learning_rate=ann.learning_rate,
            fedprox_mu=ann.fedprox_mu,
            histogram_bins=ann.histogram_bins,
            layout=ann.model_layout,
            intermediaries=max(ann.hospital_intermediaries, 1),
            histogram_edges=ann.histogram_edges,
        )


@dataclass(frozen=True)
class VerifiedRound:
    """An announcement this site accepted, with what the site derived from it."""

    announcement: Announcement
    params: SecAggParams | None
    plan: RoundPlan
    phase_timeout: float  # seconds, at least 1
    train_deadline: float  # unix seconds
    chunk_bytes: int
    heartbeat_seconds: float  # interval of this site's Heartbeat calls

    @property
    def number(self) -> int:
        return self.announcement.round_number


def secagg_params(ann: Announcement) -> SecAggParams:
    """The SecAgg+ parameters of a round, with the announcement's digest bound into the
    session id and every AdvertiseKeys signature: both services build
    them here, so a site told another story than its neighbours aborts at the roster."""
    return SecAggParams(
        round_number=ann.round_number,
        round_nonce=ann.round_nonce,
        participants=ann.participants,
        threshold=ann.threshold,
        neighbours=ann.neighbours,
        vector_length=ann.vector_length,
        announcement_digest=ann.digest(),
    )


def validate_intermediaries(ann: Announcement, *, study: Study | None = None) -> None:
    """v and the norm segment belong to hospital rounds only; v in
    1..MAX_INTERMEDIARIES; with the site's study, v is the study's fixed v (and no norm
    segment), or under "auto" in 1..the public cap with the norm segment. ValidationError
    names the field and the bound."""
    v = ann.hospital_intermediaries
    if not ann.is_hospital:
        if v or ann.hospital_norm_segment:
            raise ValidationError(
                "hospital_intermediaries / hospital_norm_segment set on a round that is not "
                "a hospital-level round")
        return
    if not 1 <= v <= MAX_INTERMEDIARIES:
        raise ValidationError(
            f"hospital_intermediaries {v} outside 1..{MAX_INTERMEDIARIES}")
    if study is None or study.privacy.unit != "hospital":
        return
    fixed = study.privacy.intermediaries
    if isinstance(fixed, int):
        if v != fixed or ann.hospital_norm_segment:
            raise ValidationError(
                f"hospital_intermediaries {v} is not the study's fixed {fixed} intermediaries"
                + (" (and a fixed v carries no norm segment)" if ann.hospital_norm_segment
                   else ""))
        return
    cap = intermediaries_cap(study) or 1
    if not ann.hospital_norm_segment:
        raise ValidationError(
            'intermediaries = "auto" needs the norm segment (hospital_norm_segment)')
    if v > cap:
        raise ValidationError(
            f"hospital_intermediaries {v} outside 1..{cap} (the cap of \"auto\")")


def validate_for_site(
    ann: Announcement, *, policy: SitePolicySection, site_id: str,
    study: Study | None = None,
) -> VerifiedRound:
    """Check a round against this site's policy (and the study it joined) before
    computing anything.

    Raises `RoundFailed` when the round is acceptable in form but not for this site,
    `ValidationError` when it is malformed, `ProtocolAbort(ROUND_TOO_SMALL)` when a
    secure round has fewer participants than this site's floor."""
    participants = ann.participants
    if site_id not in participants:
        raise RoundFailed(f"round {ann.round_number} does not list this site")
    if study is not None and study.members:
        # The study's hospitals, pinned by key: a roster naming anyone else (sybil sites
        # a CA holder minted) is refused before any key is advertised. The keys are
        # checked against the members' fingerprints at the roster (site_agent.membership).
        outsiders = sorted(set(participants) - set(study.member_fingerprints()))
        if outsiders:
            raise ProtocolAbort(
                AbortReason.UNKNOWN_MEMBER,
                f"round {ann.round_number} lists {outsiders}, not members of study "
                f"{study.study.name!r} (its [[members]]); refused before any key is sent",
            )
    if len(ann.round_nonce) != ROUND_NONCE_LENGTH:
        raise ValidationError("round nonce must be 16 bytes")
    if ann.kind not in ROUND_KINDS:
        raise ValidationError(f"unknown round kind {ann.kind!r}")
    if (ann.kind == KIND_RELEASE) != bool(ann.release_name):
        raise ValidationError("a release round, and only one, names its release")
    if ann.release_name and not ann.release:
        raise ValidationError(f"no DP release named {ann.release_name[:MAX_RELEASE_NAME]!r} "
                              "is registered at this site")
    if ann.study_sha256 and len(ann.study_sha256) != 32:
        raise ValidationError("study_sha256 must be 32 bytes")
    if len(ann.statistics) > MAX_STATISTICS_BYTES:
        raise ValidationError("statistics too large")
    if len(ann.release_payload) > MAX_RELEASE_PAYLOAD_BYTES:
        raise ValidationError("release_payload too large")
    if ann.release_payload and ann.kind != KIND_RELEASE:
        raise ValidationError("only a release round carries a release_payload")
    release = ann.release
    bins = ann.histogram_bins
    if not 2 <= bins <= 1000:
        raise ValidationError("histogram_bins out of range")
    if ann.histogram_edges:
        if release:
            raise ValidationError(f"a {release} round carries no histogram_edges")
        # Edges every site counts with alike: as many as the bins ask, each block
        # strictly increasing from 0 to 1 (the site checks the block count against
        # its study when it evaluates: common.releases.evaluation_edges.round_edges).
        announced_edge_blocks(ann.histogram_edges, bins=bins)
    if ann.is_hospital and not (
        0 < ann.hospital_noise_multiplier <= 1000 and ann.local_epochs > 0
    ):
        raise ValidationError("a hospital round trains, with a noise multiplier in (0, 1000]")
    validate_intermediaries(ann, study=study)
    if ann.is_hospital and ann.hospital_intermediaries > policy.max_intermediaries:
        # The study was accepted at enrolment against the same cap; a round asking for
        # more (a coordinator deviating from it) would make this hospital's
        # hospital-level epsilon v-fold beyond what its privacy officer allowed.
        raise RoundFailed(
            f"round {ann.round_number} splits this hospital into "
            f"{ann.hospital_intermediaries} intermediaries, more than this site's "
            f"policy.max_intermediaries = {policy.max_intermediaries}"
        )
    if release:
        # No model and no training: the vector is the release's layout, which the site
        # recomputes from the study it joined (site_agent checks the length).
        if ann.model_layout or ann.model_bytes or ann.local_epochs or not ann.study_sha256:
            raise ValidationError(f"a {release} round carries a study and no model")
        if not 1 <= ann.vector_length <= policy.max_vector_length:
            raise ValidationError("vector_length out of range")
    else:
        expected_length = ann.manifest().vector_length
        if ann.vector_length != expected_length or ann.vector_length > policy.max_vector_length:
            raise ValidationError(
                f"vector_length {ann.vector_length} does not match the model ({expected_length})"
            )
    if not (0 < ann.clip < 1e6) or not (1 <= ann.quantization_bits <= 31):
        raise ValidationError("clip or quantization bits out of range")
    if not 1 <= ann.weight_cap <= max_integer_for_sites(len(participants)):
        raise ValidationError("weight_cap out of range")
    # The training plan, within the bounds the coordinator's own config enforces
    # (NaN fails every comparison): a bad plan would spend budget on a wasted update.
    if not (0 < ann.learning_rate <= 10 and 0 <= ann.fedprox_mu <= 100):
        raise ValidationError("learning_rate or fedprox_mu out of range")
    if not (ann.local_epochs <= 1000 and ann.planned_rounds <= 1_000_000):
        raise ValidationError("local_epochs or planned_rounds out of range")
    if not MIN_HEARTBEAT_MS <= ann.heartbeat_ms <= MAX_HEARTBEAT_MS:
        raise ValidationError(
            f"heartbeat interval {ann.heartbeat_ms} ms outside "
            f"{MIN_HEARTBEAT_MS}..{MAX_HEARTBEAT_MS} ms"
        )
    if ann.round_number >= 1 << 63:  # the ledger stores round numbers as signed 64-bit
        raise ValidationError("round number out of range")
    params = None
    if ann.secure_aggregation:
        # A sum of too few sites gives one hospital's update away by subtraction:
        # refused before any key, model or training.
        # With a study, its threat terms (the same at every member, in the announced
        # study digest) size every site's noise; this site joined only if they are at
        # least its own policy's (`check_study_against_policy`).

        colluding, min_sites = study_round_terms(
            study, max_colluding_sites=policy.max_colluding_sites,
            min_round_sites=policy.min_round_sites,
        )
        floor = round_floor(min_round_sites=min_sites, max_colluding_sites=colluding)
        if len(participants) < floor:
            who = "the study" if study is not None else "this site's policy"
            raise ProtocolAbort(
                AbortReason.ROUND_TOO_SMALL,
                f"round {ann.round_number} has {len(participants)} participants; "
                f"{who} needs at least {floor}",
            )
        params = secagg_params(ann)
        if ann.threshold < policy.min_threshold:
            raise RoundFailed(
                f"threshold {ann.threshold} below this site's minimum {policy.min_threshold}"
            )
        # A coordinator cannot lower t below what this site's threat model needs.
        validate_against_threat_model(
            params, ThreatModel(max_colluding_sites=colluding, max_dropouts=0)
        )
    elif release:
        raise RoundFailed(f"the {release} release needs secure aggregation")
    elif not policy.allow_plain_aggregation:
        # Plain FedAvg shows the coordinator each update: for benchmarks only.
        raise RoundFailed("this site's policy requires secure aggregation")
    return VerifiedRound(
        announcement=ann,
        params=params,
        plan=RoundPlan.of(ann),
        phase_timeout=max(ann.phase_timeout_ms / 1000, 1.0),
        train_deadline=ann.train_deadline_ms / 1000,
        # Chunks as large as the coordinator accepts (1 MiB unless it says less),
        # never below 64 KiB (a coordinator cannot make us send a million messages).
        chunk_bytes=min(CHUNK_BYTES, max(ann.max_chunk_bytes or CHUNK_BYTES, MIN_CHUNK_BYTES)),
        heartbeat_seconds=ann.heartbeat_ms / 1000,
    )


def announced_terms(ann: Announcement) -> HospitalTerms:
    """S, z, v and the norm segment as a HOSPITAL round announces them."""
    return HospitalTerms(clip=ann.clip, noise_multiplier=ann.hospital_noise_multiplier,
                         intermediaries=max(ann.hospital_intermediaries, 1),
                         norm_segment=ann.hospital_norm_segment)
