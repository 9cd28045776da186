"""Non-private baselines for the demo's privacy/utility table (seed 002's table):
centralized logistic regression on the pooled data (the reference for tables), and
federated averaging of the study's network (or the demo's MLP) without DP or secure
aggregation. Both use the federation's splits; being non-private and centralised, they
are measured on the exact held-out scores (AUC and Youden's operating point,
`common.releases.evaluation_threshold.operating_point_metrics_from_scores`). `bins` is accepted
and unused: no histogram is involved."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.models.layout import flatten_parameters
from common.models.tables.mlp import TabularMLP
from common.releases.evaluation_threshold import operating_point_metrics_from_scores
from site_agent.data import SiteData, Standardizer, prepare_site_split
from site_agent.trainer import LocalTrainer, predict_scores
from site_agent.training_config import TrainingConfig
from site_agent.training_plan import fit_batch_size
from site_agent.unit_split import split_by_patient

if TYPE_CHECKING:
    from common.study import Study


def _config(o: Any, *, epochs: int, records: int) -> TrainingConfig:
    return TrainingConfig(
        batch_size=fit_batch_size(o.batch_size, units=records),
        max_physical_batch_size=4096,
        local_epochs=epochs,
        lr=o.learning_rate,
        dp=False,
        device="cpu",
    )


def _pool(parts: list[SiteData]) -> SiteData:
    return SiteData(
        features=np.concatenate([p.features for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
        patient_ids=None,
        feature_names=parts[0].feature_names,
    )


def _metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """AUC and Youden's operating point on the exact scores (non-private baselines)."""
    m = operating_point_metrics_from_scores(scores, labels)
    return {"auc": m.auc, "sensitivity": m.sensitivity, "specificity": m.specificity,
            "ppv": m.ppv}


def _initial_model(n_features: int, seed: int) -> TabularMLP:
    torch.manual_seed(seed)  # same initial weights as the federation's initial model
    return TabularMLP(n_features)


def centralized_nodp(
    datasets: dict[str, SiteData], o: Any, *, keys: dict[str, bytes],
    units: dict[str, Any] | None = None, bins: int | None = None,
) -> dict[str, float]:
    """Logistic regression fitted to convergence (`common.models.logistic_reference.fit_logistic`,
    Newton's method) on every site's training split pooled in one place (what federation
    avoids): the non-private reference a tabular model is judged against (the demo's
    MLP trained for the study's epochs underfit a real cohort, rotterdam 0.660, and put
    the DP model above centralized training). `keys`: each site's split key (and
    `units`, a site's unit ids when they are not its records' own:
    `unit_split.split_by_patient`), so the held-out patients are the sites'."""
    from common.models.logistic_reference import fit_logistic

    splits = [split_by_patient(d, held_out_fraction=0.2, key=keys[site],
                               units=(units or {}).get(site))
              for site, d in datasets.items()]
    train = _pool([t for t, _ in splits])
    held_out = _pool([h for _, h in splits])
    standardizer = Standardizer.fit(train.features)
    train, held_out = standardizer.transform(train), standardizer.transform(held_out)

    def design(features: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(features)), features.astype(np.float64)])

    weights = fit_logistic(design(train.features), train.labels.astype(np.float64))
    scores = 1.0 / (1.0 + np.exp(-(design(held_out.features) @ weights)))
    return _metrics(scores, held_out.labels)


def federated_nodp(
    datasets: dict[str, SiteData], o: Any, *, keys: dict[str, bytes],
    units: dict[str, Any] | None = None, bins: int | None = None,
    study: Study | None = None,
) -> dict[str, float]:
    """FedAvg (sample-weighted) over the same sites, splits and rounds, without DP or
    SecAgg. With `study`: its network from the coordinator's public initial weights and
    its training settings (rounds, local epochs, learning rate, batch), so the row
    differs from the DP model's by DP alone (a drafted study trains logistic regression
    at learning rate 1.0 for its rounds; the demo's MLP settings were another model);
    without, the demo's MLP and options."""
    prepared = {
        site: prepare_site_split(d, held_out_fraction=0.2, key=keys[site],
                                 units=(units or {}).get(site))
        for site, d in datasets.items()
    }
    n_features = next(iter(prepared.values()))[0].features.shape[1]
    if study is not None:
        from common.models.build import initial_model
        from common.models.initial_file import INITIAL_MODEL_SEED

        def factory() -> torch.nn.Module:
            return initial_model(study, seed=INITIAL_MODEL_SEED)

        settings = dataclasses.replace(o, rounds=study.study.rounds,
                                       local_epochs=study.training.local_epochs,
                                       learning_rate=study.training.learning_rate,
                                       batch_size=study.training.batch_size)
    else:
        def factory() -> torch.nn.Module:
            return _initial_model(n_features, o.seed)

        settings = o
    model = factory()
    global_flat = flatten_parameters(model)
    trainers = {
        site: LocalTrainer(factory, train,
                           _config(settings, epochs=settings.local_epochs, records=len(train)),
                           seed=o.seed)
        for site, (train, _, _) in prepared.items()
    }
    for _ in range(settings.rounds):
        total = np.zeros_like(global_flat, dtype=np.float64)
        weight = 0
        for trainer in trainers.values():
            result = trainer.train_round(global_flat)
            total += result.num_samples * result.delta_flat.astype(np.float64)
            weight += result.num_samples
        global_flat = (global_flat + total / weight).astype(np.float32)
    from common.models.layout import load_flat_parameters

    load_flat_parameters(model, global_flat)
    scores = np.concatenate([predict_scores(model, h.features) for _, h, _ in prepared.values()])
    labels = np.concatenate([h.labels for _, h, _ in prepared.values()])
    return _metrics(scores, labels)
