"""How a round's sum is collected (SecAgg+ or plain) and decoded into the mean update.

`SecureAggregator` and `PlainAggregator` are what the phase loop (`phases.drive`) and
the upload handler talk to; `decode_round_sum` is pure: ring sum in, mean delta and
evaluation metrics out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from common.core.errors import AbortReason, ProtocolAbort, StateError, ValidationError
from common.crypto.quantize import dequantize_sum
from common.protocol.secagg import messages as sm
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.params import ThreatModel, validate_against_threat_model
from common.protocol.secagg.server import SecAggServer
from common.releases.egress import EVALUATION_HISTOGRAM, WEIGHT, round_manifest
from common.releases.evaluation import denoised_histogram, multiclass_metrics_from_histogram
from common.releases.evaluation_edges import block_bins, next_block_edges, round_edges
from common.releases.evaluation_interval import auc_interval, interval_text
from common.releases.evaluation_threshold import operating_point_metrics
from common.rounds.announcement import secagg_params
from coordinator.metrics import CoordinatorMetrics
from coordinator.optimizers import weighted_mean
from coordinator.phases import PLAIN_PHASES, SECURE_PHASES, ActiveRound, PhaseState, RoundPhase
from coordinator.uploads import release_freed_memory

log = logging.getLogger("medfed.coordinator")

UPDATE_CHUNK_ELEMENTS = 1 << 18
"""Window of the decode/optimizer pass: float64 temporaries stay at 2 MiB, not 2 x d."""


@dataclass(frozen=True)
class DecodedSum:
    mean_delta: np.ndarray | None  # float32; None when the round trains nothing
    weight_sum: int
    metrics: dict[str, float]
    histogram: np.ndarray | None = None  # the summed score histogram (int64, 2 * bins)
    # The bucket edges the histogram was counted with, one array per block.
    edges: tuple[np.ndarray, ...] = ()

    def next_histogram_edges(
        self, *, max_bins: int | None = None, before: np.ndarray | None = None,
        after: np.ndarray | None = None,
    ) -> tuple[float, ...] | None:
        """The next round's announced edges, from this round's released histogram
        (`common.releases.evaluation_edges.next_edges`), as many buckets per block as its class
        totals
        and noise allow (`common.releases.evaluation_edges.block_bins`, at most `max_bins`: the
        study's; default: as many as this round's); None when this round evaluated
        nothing. `before`/`after`: a public probe of the model this round evaluated and
        of the model the next round evaluates (`common.models.probe.probe_logits`, one
        logit per block): the edges follow the model's move (`next_edges`' shift)."""
        if self.histogram is None or not self.edges or self.histogram.sum() <= 0:
            return None
        bins = block_bins(
            self.histogram, blocks=len(self.edges),
            noise_std=float(self.metrics.get("auc_noise_std", 0.0)),
            max_bins=self.edges[0].size - 1 if max_bins is None else max_bins)
        shifts = anchors = None
        if before is not None and after is not None:
            anchors = [float(v) for v in np.asarray(before, dtype=np.float64).reshape(-1)]
            shifts = [float(a) - b for a, b in zip(
                np.asarray(after, dtype=np.float64).reshape(-1), anchors, strict=True)]
        blocks = next_block_edges(self.histogram, edges=self.edges, bins=bins,
                                  shifts=shifts, anchors=anchors)
        return tuple(float(v) for block in blocks for v in block)


def decode_round_sum(
    aggregate: np.ndarray,
    *,
    model_dim: int,
    count: int,
    clip: float,
    bits: int,
    weight_cap: int,
    histogram_bins: int,
    evaluation_only: bool,
    histogram_classes: int = 1,
    histogram_edges: tuple[float, ...] = (),
    noise_std: float | None = None,
    interval_seed: int = 0,
) -> DecodedSum:
    """Decode the ring sum of `count` sites into the float32 weighted mean delta
    (`noise_std`, `interval_seed`: `evaluation_metrics`).

    Window by window, elementwise the same arithmetic as decoding the whole vector at
    once, without d-sized float64 temporaries (2 x 8 bytes per parameter at d = 10^7).
    The mean is written over the ring sum itself (same 4 bytes per element, each
    window decoded into a scratch buffer first): `aggregate` is consumed.
    """
    if aggregate.dtype != np.uint32 or aggregate.ndim != 1 or aggregate.size < model_dim:
        raise ValidationError("aggregate must be a uint32 vector covering the model")
    # Validates clip, bits and that `count` sums cannot have wrapped (decode_sum's checks).
    dequantize_sum(aggregate[:0], clip=clip, bits=bits, count=count)
    # The same segment list the sites encoded with (common.releases.egress).
    manifest = round_manifest(model_elements=model_dim, histogram_bins=histogram_bins)
    integers = manifest.decode_integers(aggregate)
    weight_sum = max(int(integers[WEIGHT][0]), 0)
    metrics: dict[str, float] = {"contributors": float(count)}
    edges = evaluation_edges(histogram_edges, bins=histogram_bins, classes=histogram_classes)
    histogram = evaluation_metrics(
        integers[EVALUATION_HISTOGRAM], edges=edges, classes=histogram_classes,
        metrics=metrics, noise_std=noise_std, interval_seed=interval_seed,
    )
    if evaluation_only or weight_sum == 0:
        return DecodedSum(None, weight_sum, metrics, histogram, edges)
    mean_delta = aggregate[:model_dim].view(np.float32)
    scratch = np.empty(min(model_dim, UPDATE_CHUNK_ELEMENTS), dtype=np.float64)
    for start in range(0, model_dim, UPDATE_CHUNK_ELEMENTS):
        stop = min(start + UPDATE_CHUNK_ELEMENTS, model_dim)
        floats = dequantize_sum(
            aggregate[start:stop], clip=clip, bits=bits, count=count,
            out=scratch[: stop - start],
        )
        # Sites send delta * n_k / weight_cap (so each element stays inside the clip
        # range) plus n_k; undo the scale on the SUM only.
        floats *= weight_cap
        mean_delta[start:stop] = weighted_mean(floats, float(weight_sum))
    return DecodedSum(mean_delta, weight_sum, metrics, histogram, edges)


def evaluation_edges(
    announced: tuple[float, ...], *, bins: int, classes: int
) -> tuple[np.ndarray, ...]:
    """The bucket edges of each block of a round's histogram (`round_edges`)."""
    return round_edges(announced, bins=bins, blocks=classes if classes > 2 else 1)


def evaluation_metrics(
    summed: np.ndarray, *, edges: tuple[np.ndarray, ...], classes: int,
    metrics: dict[str, float], noise_std: float | None = None, interval_seed: int = 0,
) -> np.ndarray:
    """The round's DP evaluation: the summed histogram (it carries the sites' discrete
    Gaussian noise, so counts can be negative) reduced to its credible buckets
    (`denoised_histogram`), AUC and operating point into `metrics` with the noise
    indication and the AUC's 95% interval
    (`common.releases.evaluation_interval.auc_interval`, drawn with
    a generator seeded by `interval_seed`: the round number, so anyone holding the
    release recomputes the same interval) beside them, and a warning when the noise
    dominates. `noise_std`: the per-count noise std of the sum as the sites' ledgers
    record it (`coordinator.ledger_gate.evaluation_noise_std`); None: estimated from
    the negative counts. Returns the histogram the bundle's threshold is chosen from."""
    raw = np.asarray(summed, dtype=np.int64)
    if not raw.any():
        return np.zeros_like(raw)  # no evaluation this round
    blocks = classes if classes > 2 else 1
    noisy = denoised_histogram(raw, blocks=blocks, noise_std=noise_std)
    histogram = noisy.counts
    metrics.update(noisy.metrics())
    if histogram.sum() > 0:
        interval = auc_interval(raw, edges=edges, noise_std=noisy.noise_std,
                                rng=np.random.default_rng(interval_seed))
        metrics.update(interval.metrics())
        metrics["auc_buckets"] = float(edges[0].size - 1)
        if not interval.readable:
            log.warning(
                "the federated evaluation is too noisy to read: AUC %s; with DP noise std "
                "%.3g per count on %d buckets the bucketed AUC alone lies in %.2f-%.2f, "
                "and %.0f%% of the positive-negative pairs share a bucket (evaluate "
                "locally with `medfed predict`)",
                interval_text(interval.auc, interval.low, interval.high),
                noisy.noise_std, edges[0].size - 1, interval.noise_low, interval.noise_high,
                200 * interval.resolution,
                extra={"event": "evaluation_unreadable", "auc_interval_low": interval.low,
                       "auc_interval_high": interval.high})
    if histogram.sum() > 0 and classes > 2:
        metrics.update(multiclass_round_metrics(histogram, edges, classes))
    elif histogram.sum() > 0:
        m = operating_point_metrics(histogram, edges=edges[0])
        metrics.update(
            auc=m.auc, sensitivity=m.sensitivity, specificity=m.specificity, ppv=m.ppv,
            evaluated=float(m.n),
        )
    if noisy.noise_dominated:
        share = noisy.relative_noise
        log.warning(
            "the federated evaluation is noise-dominated: DP noise std %.3g per score "
            "bucket, %s; AUC %s and the threshold chosen from it are unreliable "
            "(evaluate locally with `medfed predict`)",
            noisy.noise_std,
            f"{100 * share:.0f}% of the smaller class's count" if share <= 1.0
            else "more than the smaller class's count",
            f"{metrics['auc']:.3f}" if "auc" in metrics else "undefined",
            extra={"event": "evaluation_noise_dominated",
                   "noise_std": noisy.noise_std, "relative_noise": noisy.relative_noise},
        )
    return histogram


def multiclass_round_metrics(
    histogram: np.ndarray, edges: tuple[np.ndarray, ...], num_classes: int
) -> dict[str, float]:
    """Macro one-vs-rest AUC (and per class) of a K-block summed histogram."""
    m = multiclass_metrics_from_histogram(histogram, edges=edges, num_classes=num_classes)
    out = {"auc": m.macro_auc, "evaluated": float(m.n)}
    out.update({f"auc_class_{k}": auc for k, auc in enumerate(m.per_class_auc)})
    return out


class PlainAggregator:
    """Plain FedAvg over the same transport (benchmarks): a running uint32 sum."""

    phases = PLAIN_PHASES

    def __init__(self, rnd: ActiveRound) -> None:
        self.rnd = rnd
        self.total = np.zeros(rnd.announcement.vector_length, dtype=np.uint32)
        self.survivors: tuple[str, ...] = ()
        self.dropped: tuple[str, ...] = ()
        self.result: np.ndarray | None = None

    def check_session(self, session_id: bytes) -> None:
        if session_id:
            raise ValidationError("plain rounds carry no session id")

    def add(self, site_id: str, vector: np.ndarray) -> None:
        np.add(self.total, vector, out=self.total)

    def add_windows(self, site_id: str, windows: Iterable[np.ndarray]) -> None:
        position = 0
        for window in windows:
            part = self.total[position : position + window.size]
            np.add(part, window, out=part)
            position += window.size

    async def close(self, phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        ann = self.rnd.announcement
        self.survivors = tuple(sorted(state.arrived))
        self.dropped = tuple(sorted(set(ann.participants) - state.arrived - self.rnd.declined))
        if not self.survivors:
            raise ProtocolAbort(AbortReason.TOO_FEW_PARTICIPANTS, "no site uploaded")
        self.result = self.total  # uploads have ended: no copy needed
        release_freed_memory()
        return sm.SurvivorList(survivors=self.survivors, dropped=self.dropped), set()


class SecureAggregator:
    """SecAgg+ (Bell et al. 2020) through `SecAggServer`: one closer per phase."""

    phases = SECURE_PHASES

    def __init__(
        self, rnd: ActiveRound, server: SecAggServer, *, metrics: CoordinatorMetrics
    ) -> None:
        self.rnd = rnd
        self.server = server
        self.metrics = metrics
        self.survivors: tuple[str, ...] = ()
        self.dropped: tuple[str, ...] = ()
        self.result: np.ndarray | None = None

    def check_session(self, session_id: bytes) -> None:
        expected = self.server.session_id
        if expected is None or session_id != expected:
            raise ProtocolAbort(AbortReason.WRONG_SESSION, "session id does not match")

    def add(self, site_id: str, vector: np.ndarray) -> None:
        self.server.receive_masked_input(site_id, sm.MaskedInput(vector=vector))

    def add_windows(self, site_id: str, windows: Iterable[np.ndarray]) -> None:
        self.server.receive_masked_input_windows(site_id, windows)

    async def close(self, phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        server = self.server
        if phase is RoundPhase.ADVERTISE_KEYS:
            roster = server.close_advertise()
            return roster, {e.site_id for e in roster.entries}
        if phase is RoundPhase.SHARE_KEYS:
            per_site = server.close_shares()
            return per_site, set(per_site)
        if phase is RoundPhase.MASKED_INPUT:
            listing = server.close_masked_input()
            self.survivors, self.dropped = listing.survivors, listing.dropped
            release_freed_memory()
            return listing, set(listing.survivors)
        if phase is RoundPhase.CONSISTENCY_CHECK:
            signatures = server.close_consistency()
            return signatures, {site for site, _ in signatures.signatures}
        if phase is RoundPhase.UNMASK:
            return await self._unmask(state), set()
        raise StateError(f"no secure closer for phase {phase.value}")

    async def _unmask(self, state: PhaseState) -> int:
        started = time.perf_counter()
        try:
            self.result = await asyncio.to_thread(self.server.close_unmask)
        finally:
            self._report_misbehaving()
        self.metrics.unmask_seconds.observe(time.perf_counter() - started)
        log.debug("round %d unmasked in %.3f s", self.rnd.number, time.perf_counter() - started)
        self.metrics.quorum_margin.set(len(self.survivors) - self.rnd.announcement.threshold)
        # Sites whose input is in the sum but that vanished before unmasking: their
        # self-masks were removed with the other survivors' shares.
        self.rnd.dropped_after_input = set(self.survivors) - state.arrived
        return len(self.survivors)

    def _report_misbehaving(self) -> None:
        """Name the sites whose Unmask shares were wrong (corrected, or the round
        aborted): they are malicious or broken, and an operator should know."""
        number = self.rnd.number
        for holder, owners in sorted(self.server.misbehaving_sites.items()):
            log.warning(
                "round %d: %s revealed wrong unmask shares of %s",
                number, holder, ",".join(owners),
                extra={"event": "misbehaving_site", "round_number": number,
                       "site": holder, "owners": ",".join(owners)},
            )
            self.metrics.misbehaving_total.labels(site=holder).inc()


Aggregator = PlainAggregator | SecureAggregator


def aggregator_for(
    rnd: ActiveRound,
    *,
    identity: IdentityVerifier,
    metrics: CoordinatorMetrics,
    max_colluding_sites: int,
) -> Aggregator:
    """The aggregator of a round: SecAgg+ with parameters checked against the
    coordinator's own threat model, or the plain sum."""
    ann = rnd.announcement
    if not ann.secure_aggregation:
        return PlainAggregator(rnd)
    params = secagg_params(ann)
    validate_against_threat_model(params, ThreatModel(max_colluding_sites, 0))
    return SecureAggregator(rnd, SecAggServer(params, identity=identity), metrics=metrics)
