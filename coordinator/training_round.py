"""Finishing a training round once its sum is unmasked: decode the sum, step the global
model, then record the round. The record is written checkpoint first, store second,
pruning third, so the store's latest checkpoint never names a missing file."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from common.core.codec import TensorSpec
from common.core.config import CoordinatorSettings
from common.core.errors import AbortReason, ProtocolAbort, ValidationError
from common.core.observer import NoObserver, RoundObserver
from common.models import network_code_installed
from common.privacy.budget import BudgetReport
from common.privacy.hospital import HospitalTerms
from common.releases.evaluation_edges import probe_edges, round_edges
from common.study import Study
from coordinator import checkpoints, hospital_sum
from coordinator.aggregation import UPDATE_CHUNK_ELEMENTS, Aggregator, decode_round_sum
from coordinator.bundles import write_round_bundle
from coordinator.metrics import CoordinatorMetrics
from coordinator.optimizers import ServerOptimizer, apply_step, build_optimizer
from coordinator.phases import ActiveRound
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun

log = logging.getLogger("medfed.coordinator")


@dataclass(frozen=True)
class RoundResult:
    round_number: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    mean_delta: np.ndarray
    metrics: dict[str, float]
    histogram: np.ndarray | None = None
    statistics: bool = False  # the study's statistics release (no model update)
    edges: tuple[np.ndarray, ...] = ()  # the bucket edges `histogram` was counted with


@dataclass
class GlobalModel:
    """The model the federation trains: its layout, flat float32 parameters and the
    server optimizer whose state is checkpointed with them."""

    layout: tuple[TensorSpec, ...]
    flat: np.ndarray
    optimizer: ServerOptimizer
    # "auto" intermediaries: the v the next hospital round
    # announces, chosen from the last decoded round; None before any was measured.
    intermediaries: int | None = None
    # The evaluation buckets the next round announces: set from the last released score
    # histogram (common.releases.evaluation_edges.next_edges); empty before any (the default
    # layout).
    # Kept in the store with the round that chose them, so a restart goes on with them.
    histogram_edges: tuple[float, ...] = ()

    @classmethod
    def load(
        cls, store: CoordinatorStore, settings: CoordinatorSettings, study: StudyRun | None,
        *, model_without_study: checkpoints.InitialModel | None = None,
    ) -> GlobalModel:
        """The latest good checkpoint, else the study's initial model (without a study:
        `model_without_study`, a transport test's); with the v its round chose for the
        next, so a restart continues with it."""
        optimizer = build_optimizer(settings.optimizer)
        layout, flat = checkpoints.load_model(
            store, optimizer, state=settings.state,
            initial=study.initial_model if study is not None else model_without_study,
        )
        edges = stored_edges(store, settings)
        if not edges and study is not None:
            edges = first_edges(study.study, flat, bins=study_bins(settings))
        return cls(layout, flat, optimizer, intermediaries=stored_intermediaries(store),
                   histogram_edges=edges)

    def payload(self) -> bytes | memoryview:
        return checkpoints.model_payload(self.layout, self.flat)


def study_bins(settings: CoordinatorSettings) -> int:
    """The buckets per block the study asks for: the most a round announces."""
    agg = settings.aggregation
    classes = agg.histogram_classes
    return agg.histogram_bins // classes if classes > 2 else agg.histogram_bins


def stored_edges(store: CoordinatorStore, settings: CoordinatorSettings) -> tuple[float, ...]:
    """The evaluation edges the last completed round chose for the next (the store's),
    or () (the default layout) when there are none or they no longer fit the study's
    bins and classes (an operator changed them), which is logged."""
    edges = store.evaluation_edges()
    if not edges:
        return ()
    classes = settings.aggregation.histogram_classes
    blocks = classes if classes > 2 else 1
    try:
        round_edges(edges, bins=len(edges) - blocks, blocks=blocks)
    except ValidationError as exc:
        log.warning("stored evaluation edges ignored (%s): the next round counts with the "
                    "default layout", exc, extra={"event": "evaluation_edges_ignored"})
        return ()
    if (len(edges) - blocks) // blocks > study_bins(settings):
        log.warning("stored evaluation edges have more buckets than the study's "
                    "histogram_bins: the next round counts with the default layout",
                    extra={"event": "evaluation_edges_ignored"})
        return ()
    return edges


def stored_intermediaries(store: CoordinatorStore) -> int | None:
    """The v chosen by the last completed round that measured one (its metrics hold
    "next_intermediaries", written with its checkpoint), or None."""
    for rnd in reversed(store.rounds()):
        chosen = rnd.metrics.get("next_intermediaries") if rnd.status == "completed" else None
        if chosen is not None:
            return int(chosen)
    return None


def apply_update(
    rnd: ActiveRound, aggregator: Aggregator, *, model: GlobalModel,
    settings: CoordinatorSettings, hospital_terms: HospitalTerms | None = None,
    evaluation_noise_std: float | None = None, study: Study | None = None,
    observer: RoundObserver | None = None,
) -> RoundResult:
    """Decode the sum and step the model (worker thread; the model is no longer
    served, so an elementwise optimizer may update it in place). `evaluation_noise_std`:
    the per-count noise of the evaluation histogram as the ledgers record it (None:
    estimated from the release). With a `study`, the next round's evaluation edges
    move with the model (a public probe before and after the step, `next_edges`' shift).
    `observer` is shown the unmasked sum first (`common.core.observer`)."""
    observer = observer or NoObserver()
    ann = rnd.announcement
    aggregate = aggregator.result
    if aggregate is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
    survivors = aggregator.survivors
    # Shown the ring sum itself before it is decoded in place (a copy would add a
    # model-sized vector to the coordinator's peak); the product's observer does nothing.
    observer.aggregate_unmasked(ann.round_number, aggregate, survivors)
    decoded = hospital_sum.decode(
        aggregate, ann=ann, count=len(survivors),
        histogram_classes=settings.aggregation.histogram_classes, terms=hospital_terms,
        noise_std=evaluation_noise_std,
    ) if ann.is_hospital else decode_round_sum(
        aggregate, model_dim=model.flat.size, count=len(survivors), clip=ann.clip,
        bits=ann.quantization_bits, weight_cap=ann.weight_cap,
        histogram_bins=ann.histogram_bins, evaluation_only=ann.local_epochs == 0,
        histogram_classes=settings.aggregation.histogram_classes,
        histogram_edges=ann.histogram_edges,
        noise_std=evaluation_noise_std, interval_seed=ann.round_number,
    )
    mean_delta = decoded.mean_delta
    chosen = decoded.metrics.get("next_intermediaries")
    if chosen is not None:
        model.intermediaries = int(chosen)
    before = after = None
    if mean_delta is None:
        mean_delta = np.zeros(model.flat.size, dtype=np.float32)
    else:
        # The model the round evaluated, probed before the step may update it in place.
        evaluated = study is not None and decoded.histogram is not None
        before = probe(study, model.flat) if evaluated and study is not None else None
        model.flat = apply_step(
            model.optimizer, model.flat, mean_delta, window=UPDATE_CHUNK_ELEMENTS
        )
        if study is not None:
            clamp_to_bound(model.flat, bound=study.model.max_abs_weight,
                           round_number=ann.round_number)
        if before is not None and study is not None:
            after = probe(study, model.flat)
        if before is not None and after is not None:
            log.info("next evaluation edges follow the model: a public probe moved %s "
                     "logits", ", ".join(f"{v:+.3f}" for v in after - before))
    next_edges = decoded.next_histogram_edges(
        max_bins=study_bins(settings), before=before, after=after)
    if next_edges is not None:
        model.histogram_edges = next_edges
    return RoundResult(ann.round_number, survivors, rnd.dropped_sites(survivors),
                       mean_delta, decoded.metrics, decoded.histogram, edges=decoded.edges)


def clamp_to_bound(flat: np.ndarray, *, bound: float, round_number: int) -> int:
    """Clamp the next global model into the study's public bound [-bound, bound]
    (``[model] max_abs_weight``), in place; returns how many weights it moved. Every
    site refuses a model beyond the bound, so the coordinator never serves one: an
    honest run stays far inside it (`DEFAULT_MAX_ABS_WEIGHT` says why), and one that
    reaches it has diverged, which the warning logged here says. Clamping is
    post-processing of the released sum (no privacy cost), and keeps the study going
    where failing it would throw away every site's spent budget."""
    beyond = 0
    for start in range(0, flat.size, UPDATE_CHUNK_ELEMENTS):
        window = flat[start : start + UPDATE_CHUNK_ELEMENTS]
        outside = ~(np.abs(window) <= bound)  # NaN too
        count = int(np.count_nonzero(outside))
        if count:
            beyond += count
            np.clip(window, -bound, bound, out=window)
            window[np.isnan(window)] = 0.0
    if beyond:
        log.warning("round %d: %d weights of the next global model are beyond the study's "
                    "model.max_abs_weight = %g and were clamped to it (training diverged: "
                    "lower training.learning_rate or the server learning rate)",
                    round_number, beyond, bound,
                    extra={"event": "model_clamped", "round_number": round_number,
                           "clamped_weights": beyond})
    return beyond


def first_edges(study: Study, flat: np.ndarray, *, bins: int) -> tuple[float, ...]:
    """The first evaluated round's edges, each block's around where a public probe of
    the model puts its scores (`common.releases.evaluation_edges.probe_edges`); () (the default
    layout) without torch."""
    anchors = probe(study, flat)
    if anchors is None:
        return ()
    return tuple(float(v) for anchor in anchors for v in probe_edges(float(anchor), bins=bins))


def probe(study: Study, flat: np.ndarray) -> np.ndarray | None:
    """`common.models.probe.probe_logits` (imports torch: only when a round steps), or
    None where torch is not installed (the coordinator image) or the model's probe
    logits are not finite (a model that overflows on the public probe inputs): the next
    round's buckets then follow the released histogram alone (`next_edges` without a
    shift), or the default layout."""
    if not network_code_installed():
        if not _NO_PROBE_SAID.is_set():
            _NO_PROBE_SAID.set()
            log.info("no torch here: evaluation buckets follow the released histograms "
                     "without the public probe of the model",
                     extra={"event": "evaluation_probe_unavailable"})
        return None
    # torch: common.models.probe builds the network; loaded only where a round steps.
    from common.models.probe import probe_logits

    logits = probe_logits(study, flat)
    if not np.all(np.isfinite(logits)):
        log.warning("the public probe of the global model gives non-finite logits: "
                    "evaluation buckets follow the released histograms alone",
                    extra={"event": "evaluation_probe_not_finite"})
        return None
    return logits


_NO_PROBE_SAID = threading.Event()


def record(
    result: RoundResult,
    *,
    model: GlobalModel,
    settings: CoordinatorSettings,
    store: CoordinatorStore,
    metrics: CoordinatorMetrics,
    now: float,
) -> None:
    """Checkpoint the stepped model and record the completed round in the store."""
    checkpoint = checkpoints.write_checkpoint(
        settings.state, result.round_number, layout=model.layout, flat=model.flat,
        optimizer_name=settings.optimizer.name, optimizer=model.optimizer,
    )
    store.finish_round(
        result.round_number, status="completed", now=now, survivors=result.survivors,
        dropped=result.dropped, metrics=result.metrics, checkpoint=checkpoint,
        evaluation_edges=model.histogram_edges or None,
    )
    # Only after the new checkpoint is recorded: the store's latest record never
    # points at a deleted file.
    checkpoints.prune_checkpoints(
        settings.state, keep=settings.checkpoints.keep, protected=checkpoint.path
    )
    if "auc" in result.metrics:
        metrics.model_auc.set(result.metrics["auc"])
        metrics.model_auc_interval_low.set(result.metrics.get("auc_interval_low", math.nan))
        metrics.model_auc_interval_high.set(result.metrics.get("auc_interval_high", math.nan))
    chosen = result.metrics.get("next_intermediaries")
    if chosen is not None:
        metrics.hospital_intermediaries.set(chosen)
        log.info(
            "round %d: %d intermediaries per hospital; the next round trains %d "
            "(adaptive rule of Jiang et al. 2023 on the noisy sum of unit norms)",
            result.round_number, int(result.metrics.get("intermediaries", 1)), int(chosen),
            extra={"event": "intermediaries_chosen", "round_number": result.round_number,
                   "intermediaries": int(result.metrics.get("intermediaries", 1)),
                   "next_intermediaries": int(chosen)},
        )


def record_and_bundle(
    result: RoundResult,
    *,
    model: GlobalModel,
    settings: CoordinatorSettings,
    store: CoordinatorStore,
    metrics: CoordinatorMetrics,
    now: float,
    run: StudyRun | None,
    budgets: Callable[[], list[BudgetReport]],
    secagg: tuple[int, int],
    final: Callable[[], bool],
    hospital_epsilons: Callable[
        [], Mapping[str, tuple[float, float] | hospital_sum.HospitalEpsilons]
    ],
) -> None:
    """`record`, then (in a study) the round's bundle; `budgets`, `final` and
    `hospital_epsilons` are read after the record, as the bundle must describe it."""
    record(result, model=model, settings=settings, store=store, metrics=metrics, now=now)
    if run is not None:
        bundle(run, result, model=model, settings=settings, budgets=budgets(),
               secagg=secagg, final=final(), hospital_epsilons=hospital_epsilons())
    metrics.rounds_total.labels(outcome="completed").inc()


def bundle(
    run: StudyRun,
    result: RoundResult,
    *,
    model: GlobalModel,
    settings: CoordinatorSettings,
    budgets: list[BudgetReport],
    secagg: tuple[int, int],
    final: bool,
    hospital_epsilons: Mapping[str, tuple[float, float] | hospital_sum.HospitalEpsilons]
    | None = None,
) -> None:
    """The study's bundle of the model after this round; an evaluation histogram moves
    the bundle's decision threshold."""
    if result.histogram is not None and result.histogram.sum() > 0:
        run.last_histogram = result.histogram
        run.last_edges = result.edges
        run.last_evaluation = {k: v for k, v in result.metrics.items() if k.startswith("auc")}
    write_round_bundle(
        run, round_number=result.round_number, layout=model.layout, flat=model.flat,
        settings=settings, budgets=budgets, secagg=secagg, final=final,
        hospital_epsilons=hospital_epsilons,
    )
