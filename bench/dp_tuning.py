"""What trains well under DP on real clinical tables: the study behind the table defaults.

`python -m bench.dp_tuning flchain nwtco --out DIR` writes each dataset's three hospital
files (bench.utility_data), then, in one process and side by side, trains centralized
non-private logistic regression and DP federated averaging under several local settings
(model, learning rate, optimizer, rounds), printing the held-back AUC after every round.

This is a simulation of the product's training, for choosing defaults quickly: features
standardised with the exact pooled statistics (the product uses its DP statistics
release), per-unit clipping to C and Gaussian noise of std sigma*C on the summed
gradient with Poisson sampling at rate q = B/N (Abadi et al. 2016, the same DP-SGD the
sites run through Opacus), sigma planned with the RDP accountant for
`--epsilon` over every step of the study, FedAvg weighted by site size. The real path is
`medfed bench utility`, which runs `medfed demo --data` end to end.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus.accountants.utils import get_noise_multiplier
from torch.func import functional_call, grad, vmap

from bench.utility_data import DATASETS, write_dataset
from common.releases.evaluation import metrics_from_scores


@dataclass(frozen=True)
class Setting:
    """One local-training setting compared (keyword names follow the study file)."""

    model: str = "logistic"  # or "mlp" (64, 32)
    learning_rate: float = 1.0
    local_optimizer: str = "sgd"
    rounds: int = 10
    batch_size: int = 256
    local_epochs: int = 1
    max_grad_norm: float = 1.0
    dp: bool = True

    @property
    def label(self) -> str:
        return (f"{self.model} lr {self.learning_rate:g} {self.local_optimizer} "
                f"{self.rounds} rounds{'' if self.dp else ' (no DP)'}")


SETTINGS: tuple[Setting, ...] = (
    Setting(model="mlp", learning_rate=0.1),  # the study defaults before this study
    Setting(model="mlp", learning_rate=0.1, dp=False),
    Setting(model="mlp", learning_rate=1.0),
    Setting(model="mlp", learning_rate=0.01, local_optimizer="adam"),
    Setting(model="logistic", learning_rate=0.1),
    Setting(model="logistic", learning_rate=1.0),  # the defaults `study init` drafts
    Setting(model="logistic", learning_rate=2.0),
    Setting(model="logistic", learning_rate=1.0, rounds=3),
)


@dataclass
class Table:
    """One hospital's standardised training and held-back rows."""

    x: np.ndarray
    y: np.ndarray
    x_held: np.ndarray
    y_held: np.ndarray


def load_tables(folder: Path, *, label: str, patient: str, seed: int) -> dict[str, Table]:
    """Each hospital CSV of `folder`, one-hot levels, median-imputed and standardised
    with the pooled statistics; 20% of each hospital's patients held back."""
    # pandas: an optional extra ('bench'), loaded only when the tables are read
    import pandas as pd

    frames = {p.stem: pd.read_csv(p, na_values=["NA", ""]) for p in sorted(folder.glob("*.csv"))}
    pooled = pd.concat(frames.values())
    columns = [c for c in pooled.columns if c not in (label, patient)]
    numeric = [c for c in columns if pd.api.types.is_numeric_dtype(pooled[c])]
    levels = [c for c in columns if c not in numeric]
    median = pooled[numeric].median()
    mean = pooled[numeric].fillna(median).mean()
    std = pooled[numeric].fillna(median).std().replace(0.0, 1.0)
    dummies = sorted(pd.get_dummies(pooled[levels].astype(str)).columns) if levels else []
    rng = np.random.default_rng(seed)
    tables = {}
    for site, frame in frames.items():
        x = ((frame[numeric].fillna(median) - mean) / std).to_numpy(np.float64)
        if levels:
            onehot = pd.get_dummies(frame[levels].astype(str)).reindex(columns=dummies,
                                                                     fill_value=0)
            x = np.hstack([x, onehot.to_numpy(np.float64)])
        y = frame[label].to_numpy(np.float64)
        order = rng.permutation(len(y))
        held = round(0.2 * len(y))
        tables[site] = Table(x[order[held:]].astype(np.float32), y[order[held:]],
                             x[order[:held]].astype(np.float32), y[order[:held]])
    return tables


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    return float(metrics_from_scores(scores, labels).auc)


def centralized_auc(tables: dict[str, Table]) -> float:
    """Non-private logistic regression on the pooled training rows (L-BFGS)."""
    x = torch.tensor(np.vstack([t.x for t in tables.values()]))
    y = torch.tensor(np.concatenate([t.y for t in tables.values()]), dtype=torch.float32)
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=500,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    held = torch.tensor(np.vstack([t.x_held for t in tables.values()]))
    with torch.no_grad():
        scores = model(held).squeeze(-1).numpy()
    return _auc(scores, np.concatenate([t.y_held for t in tables.values()]))


@dataclass
class Outcome:
    setting: Setting
    auc_by_round: list[float] = field(default_factory=list)
    noise_multipliers: dict[str, float] = field(default_factory=dict)


def federated(tables: dict[str, Table], setting: Setting, *, epsilon: float, delta: float,
              seed: int) -> Outcome:
    """DP federated averaging over `tables` (module docstring), AUC after every round."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    width = next(iter(tables.values())).x.shape[1]
    hidden = (64, 32) if setting.model == "mlp" else ()
    layers: list[torch.nn.Module] = []
    size = width
    for h in hidden:
        layers += [torch.nn.Linear(size, h), torch.nn.ReLU()]
        size = h
    net = torch.nn.Sequential(*layers, torch.nn.Linear(size, 1))
    params = {k: v.detach().clone() for k, v in net.named_parameters()}

    def loss(p: dict[str, Any], x: Any, y: Any) -> Any:
        out = functional_call(net, p, (x.unsqueeze(0),)).squeeze()
        return torch.nn.functional.binary_cross_entropy_with_logits(out, y)

    per_unit = vmap(grad(loss), in_dims=(None, 0, 0))
    held_x = torch.tensor(np.vstack([t.x_held for t in tables.values()]))
    held_y = np.concatenate([t.y_held for t in tables.values()])
    outcome = Outcome(setting)
    clip = setting.max_grad_norm
    for _ in range(setting.rounds):
        deltas, weights = [], []
        for site, table in tables.items():
            n = len(table.y)
            batch = max(1, min(setting.batch_size, n // 4))
            rate = batch / n
            steps = max(1, int(setting.local_epochs * n / batch))
            if setting.dp and site not in outcome.noise_multipliers:
                outcome.noise_multipliers[site] = get_noise_multiplier(
                    target_epsilon=epsilon, target_delta=delta, sample_rate=rate,
                    steps=steps * setting.rounds, accountant="rdp", epsilon_tolerance=0.05)
            sigma = outcome.noise_multipliers.get(site, 0.0)
            local = {k: v.clone() for k, v in params.items()}
            moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in local.items()}
            x, y = torch.tensor(table.x), torch.tensor(table.y, dtype=torch.float32)
            for step in range(1, steps + 1):
                chosen = torch.rand(n, generator=generator) < rate
                grads = per_unit(local, x[chosen], y[chosen])
                if setting.dp:
                    norms = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1)
                                           for g in grads.values()))
                    factor = torch.clamp(clip / (norms + 1e-12), max=1.0)
                    mean = {k: ((g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0)
                                + torch.randn(g.shape[1:], generator=generator) * sigma * clip)
                            / batch for k, g in grads.items()}
                else:
                    mean = {k: g.mean(0) for k, g in grads.items()}
                for k in local:
                    if setting.local_optimizer == "adam":
                        m, v = moments[k]
                        m.mul_(0.9).add_(0.1 * mean[k])
                        v.mul_(0.999).add_(0.001 * mean[k] ** 2)
                        update = (m / (1 - 0.9**step)) / (torch.sqrt(v / (1 - 0.999**step))
                                                           + 1e-8)
                        local[k] = local[k] - setting.learning_rate * update
                    else:
                        local[k] = local[k] - setting.learning_rate * mean[k]
            deltas.append({k: local[k] - params[k] for k in local})
            weights.append(n)
        total = float(sum(weights))
        for k in params:
            params[k] = params[k] + sum(w * d[k] for w, d in zip(weights, deltas,
                                                                  strict=True)) / total
        with torch.no_grad():
            scores = functional_call(net, params, (held_x,)).squeeze(-1).numpy()
        outcome.auc_by_round.append(_auc(scores, held_y))
    return outcome


def study(folder: Path, *, label: str, patient: str, settings: Sequence[Setting],
          epsilon: float, delta: float, seed: int) -> dict[str, Any]:
    tables = load_tables(folder, label=label, patient=patient, seed=seed)
    central = centralized_auc(tables)
    rows = []
    for setting in settings:
        outcome = federated(tables, setting, epsilon=epsilon, delta=delta, seed=seed)
        final = outcome.auc_by_round[-1]
        rows.append({**asdict(setting), "label": setting.label,
                     "auc_by_round": [round(a, 4) for a in outcome.auc_by_round],
                     "final_auc": round(final, 4), "gap": round(central - final, 4),
                     "noise_multipliers": {k: round(v, 3) for k, v in
                                           outcome.noise_multipliers.items()}})
    return {"centralized_lr_auc": round(central, 4), "settings": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dp_tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("datasets", nargs="*", default=list(DATASETS))
    parser.add_argument("--out", type=Path, default=Path("bench-tuning"))
    parser.add_argument("--epsilon", type=float, default=6.5,
                        help="DP-SGD's share of a budget of 8 (the product also spends on "
                             "the count, statistics and evaluations)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {}
    for name in args.datasets:
        written = write_dataset(name, args.out / name, seed=args.seed)
        result = study(written.folder, label=written.info.label_column,
                       patient=written.info.patient_column, settings=SETTINGS,
                       epsilon=args.epsilon, delta=args.delta, seed=args.seed)
        results[name] = result
        print(f"{name}: centralized LR {result['centralized_lr_auc']:.3f}")
        for row in result["settings"]:
            curve = " ".join(f"{a:.3f}" for a in row["auc_by_round"])
            print(f"  {row['label']:<34} final {row['final_auc']:.3f} "
                  f"gap {row['gap']:+.3f} | by round {curve}")
    (args.out / "tuning.json").write_text(json.dumps(results, indent=2))
    return 0 if all(math.isfinite(r["centralized_lr_auc"]) for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
