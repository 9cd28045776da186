"""Scoring the global model on a site's held-out split: the score histogram that rides
along in the round's secure sum (the federation's ROC, not the site's)."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.models import Task
from common.rounds.announcement import RoundPlan
from site_agent.site_dataset import Records


def held_out_histogram(
    model: Any,
    holdout: Records,
    plan: RoundPlan,
    *,
    per_unit: bool,
    device: str,
    task: Task,
    num_classes: int,
) -> np.ndarray:
    """Held-out score histogram of `model`: 2 * bins counts for a binary study, K
    one-vs-rest blocks of 2 * (bins / K) for K classes (the announced bins cover all
    blocks: `common.releases.evaluation_edges.announced_histogram_bins`), counted with
    the round's announced bucket edges (`common.releases.evaluation_edges.round_edges`,
    checked there). With `per_unit` (patient- or hospital-level privacy) one random
    encounter of each held-out patient is scored."""
    from common.releases.evaluation import multiclass_score_histogram, score_histogram
    from common.releases.evaluation_edges import round_edges
    from site_agent.dp_release import one_per_unit
    from site_agent.trainer import predict_scores

    # One score per privacy unit: each unit moves one count, the sensitivity the
    # agent's histogram noise is planned for.
    pick = one_per_unit(holdout.patient_ids if per_unit else None, size=len(holdout))
    scored = holdout.subset(pick)
    scores = finite_scores(predict_scores(model, scored, device=device, task=task,
                                          batch_size=256))
    labels = scored.labels
    if task == "binary":
        (edges,) = round_edges(plan.histogram_edges, bins=plan.histogram_bins)
        return score_histogram(scores, labels, edges=edges)
    blocks = round_edges(plan.histogram_edges, bins=plan.histogram_bins, blocks=num_classes)
    return multiclass_score_histogram(scores, labels, edges=blocks)


def finite_scores(scores: np.ndarray) -> np.ndarray:
    """`scores` with every score the model could not compute (NaN or infinite: its
    forward pass overflowed on that record) replaced by the uninformative one: 0.5 for a
    binary score, 1/K for each class of a multi-class row holding one. A fixed public
    bucket, so such a record still moves one count (the histogram's sensitivity), and the
    round goes on whatever the served model does to this site's records.

    >>> finite_scores(np.array([0.2, np.nan, 1.0])).tolist()
    [0.2, 0.5, 1.0]
    >>> finite_scores(np.array([[0.2, 0.8, 0.0], [np.nan, 0.5, 0.5]])).tolist()[1]
    [0.3333333333333333, 0.3333333333333333, 0.3333333333333333]
    """
    out = np.array(scores, dtype=np.float64)
    if out.ndim == 1:
        out[~np.isfinite(out)] = 0.5
        return out
    broken = ~np.isfinite(out).all(axis=1)
    if out.ndim == 2 and out.shape[1]:
        out[broken] = 1.0 / out.shape[1]
    return out
