"""`medfed demo --task imaging`: the same federation on images (the imaging task).

Five hospitals of the synthetic imaging cohort (`site_agent.synthetic_imaging`: non-IID
scanners, PNG and DICOM folders with labels.csv, a learnable lesion), one images study
(`[data] kind = "images"`, the study's model, default the small GroupNorm CNN), site
agents started with ``--study`` and ``--data FOLDER`` exactly as a hospital would run
them: DP-SGD at patient level with SecAgg+, one site killed mid-round and restarted,
then the same privacy/utility table, plots and report.json as the tabular demo, with
the model's name and the final model's exact held-out AUC in the report.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from common.core.errors import ConfigError
from common.models import model_names
from common.releases.bundle import read_bundle
from common.releases.evaluation_threshold import operating_point_metrics_from_scores
from common.study import load_study
from demo.options import HELD_OUT_FRACTION, DemoOptions
from demo.report import dp_auc_text
from demo.tasks import Demo
from demo.terms import federation_terms
from site_agent.synthetic_imaging import HOSPITALS, write_imaging_cohort
from site_agent.training_config import TrainingConfig
from site_agent.training_plan import fit_batch_size
from site_agent.unit_split import split_by_patient

IMAGING_DEFAULTS: dict[str, Any] = {
    "patients_per_site": 240,
    "rounds": 3,
    "local_epochs": 2,
    "learning_rate": 0.2,
    "batch_size": 64,
    "phase_seconds": 120.0,
}
"""What `--task imaging` changes in the tabular demo's defaults (a few hundred images per
hospital: a few minutes on a 2-core CPU at the default image size). Sites account with
RDP here: calibrating PRV for the small cohorts' high sampling rates takes ~30 s a site.

What the DP model learns is set mostly by the image size, not the step size: the
synthetic lesion has a radius of 4-8% of the field (`site_agent.synthetic_imaging`),
about 1-2 pixels at 28 px but under one pixel at 16 px, where resizing blurs it into
the scanner noise. Each site's expected batch is a quarter of its DP patient count
(`fit_batch_size`), so q ~ 0.25 and 4 steps an epoch whatever `batch_size` asks.
Measured in-process with the demo's cohort and split (seed 7), the trainer at patient
level (RDP, clip 1, noise planned for the study's rounds at a training epsilon near
what the demo's sites spend on training: 5 of a budget of 6, 7-7.5 of 8), FedAvg of
update elements clipped at 0.5, fresh DP noise each run (4 runs a row unless noted),
exact AUC on every site's held-out patients:
  * 70 patients, 2 rounds, training epsilon 5: 28 px 0.90-0.97, 24 px 0.92-0.99;
    16 px 0.80-0.94 at lr 0.2 (3 runs), 0.44-0.93 at lr 0.5;
  * 70 patients, 2 rounds, training epsilon 7.5: 28 px 0.96-0.97; 16 px 0.83-0.95 at
    lr 0.2, 0.86-0.94 at lr 0.1, 0.64-0.88 at lr 0.5, 0.78-0.84 with 3 local epochs,
    0.81-0.89 with 3 rounds, 0.83-0.92 with 100 patients;
  * the defaults above (120 patients, 28 px, 3 rounds, training epsilon 7, 2 runs):
    0.96-0.99.
Full runs (`medfed demo --task imaging --device cpu`, the exact AUC it prints): the
defaults (budget 8, one site killed and restarted) 0.971, 0.958; the e2e test's reduced run
(70 patients, 2 rounds, budget 6) 0.953, 0.955, 0.971 at 28 px, 0.848 at 16 px."""

IMAGING_HISTOGRAM_BINS = 10
"""Score bins of the DP evaluation. A demo hospital holds out ~15-25 patients: with the
tabular demo's 50 bins, 100 noised counts (std `DEMO_EVALUATION_NOISE_STD` each) swamp
~100 held-out scores and the reported AUC is noise; 10 bins keep the noise per count
comparable to the counts. The most a round counts with: after the first, rounds count
with as few as the released class totals and the noise allow
(`common.releases.evaluation_edges.evaluation_bins`: 6-7 for the demo's ~240 held-out patients at
std ~4)."""

DEMO_EVALUATION_NOISE_STD = 2.5
"""The demo study's ``[privacy.evaluation] noise_std`` (default 10): the std the sum of the
n_noise = 2 honest sites' shares carries (`site_agent.dp_release.evaluation_noise_sites`,
rounds of at least 3 sites with 1 colluding); a round of k sites sums k shares, std
2.5 sqrt(k / 2) per count, ~4 with all five hospitals. Sized for the demo's held-out
cohort, ~48 patients a hospital (`IMAGING_DEFAULTS`: 240 patients, the sites' default
held-out fraction 0.2), ~45 of them positive over the five. Simulated with buckets
placed on the scores (`common.releases.evaluation_interval.auc_interval`), an AUC-0.98 model's
interval is readable (width < 0.5) in 95% of releases at per-count std 3.95, 7% at
7.9 (the sites' std 5 before); at 120 patients a site (~23 positives) 57% even at std
2.5. The DP model's held-out logits sit in a band 0.04-0.16 wide that moves 0.3-1.3
logits a round; the coordinator serving the study lays the first round's buckets around a
public probe of the model and moves the later ones with it
(`common.releases.evaluation_edges.probe_edges`, `next_edges` with a shift). Replayed on a demo
run's checkpoints (20 noise draws): the second evaluated round readable in 100%, the
third 85%, the final 100% (median width 0.19, covering the exact AUC in 95%); at 120
patients a site (simulated by halving the held-out patients) the final only 35%, so
the demo keeps 240. The four evaluations (3 rounds + the final one) cost each site
more of its budget than at std 5 (zCDP rho = 1 / (2 sigma^2) each, Canonne, Kamath &
Steinke 2020), composed with its DP-SGD on its ledger: the training noise is planned
for what is left."""

UPDATE_CLIP = 0.5
"""The federation's update element clip (the demo coordinator's aggregation.clip)."""

DEMO_COUNT_EPSILON = 0.5
"""The demo study's epsilon for every hospital's one DP count of patients (the study
declares it; each site's own `count_epsilon` is its limit). 0.1, the old default, gave
the count a noise std of ~35-50, about the size of a demo hospital's ~100 training
patients: its sample rate and batch then came from counts of 1 to 120 (a batch of one
patient diverged). At 0.5 the std is ~8."""


def study_text(o: DemoOptions, *, model: str, image_size: int) -> str:
    """The demo's images study (binary: lesion or not, patient-level DP), with the threat
    terms every site sizes its noise with (the demo sites' own policy)."""
    terms = federation_terms(o.sites, histogram_bins=IMAGING_HISTOGRAM_BINS).policy
    return f"""[study]
name = "synthetic-lesions"
rounds = {o.rounds}
task = "binary"
classes = [0, 1]

[data]
kind = "images"
file_column = "file"
label_column = "label"
patient_column = "patient_id"
image_size = [{image_size}, {image_size}]
channels = 1

[model]
name = "{model}"

[training]
local_epochs = {o.local_epochs}
learning_rate = {o.learning_rate}
batch_size = {o.batch_size}

[privacy]
unit = "patient"
epsilon = {o.budget_epsilon}
delta = {o.delta}
count_epsilon = {DEMO_COUNT_EPSILON}
max_colluding_sites = {terms.max_colluding_sites}
min_round_sites = {terms.min_round_sites}

[privacy.evaluation]
histogram_bins = {IMAGING_HISTOGRAM_BINS}
noise_std = {DEMO_EVALUATION_NOISE_STD}
"""


class ImagingTask:
    """The demo's federation, fault and report, with image folders and a study."""

    name = "imaging"
    histogram_bins = IMAGING_HISTOGRAM_BINS
    centralized_label = "Centralized (no DP)"  # the study's network, pooled images

    def __init__(self, *, model: str = "cnn", image_size: int = 28, device: str = "auto") -> None:
        if model not in model_names("images"):
            raise ConfigError("--model", f"one of {', '.join(model_names('images'))}")
        if not 8 <= image_size <= 512:
            raise ConfigError("--image-size", "must be in 8..512")
        self.model_name = model
        self.image_size = image_size
        self.device = device
        self.datasets: dict[str, Any] = {}
        self.study_path = Path("study.toml")  # under the demo's --out once prepared

    def prepare(self, demo: Demo) -> dict[str, Path | None]:
        if demo.out.exists():
            shutil.rmtree(demo.out)
        demo.out.mkdir(parents=True)
        names = list(HOSPITALS)[: demo.o.sites]
        if len(names) < demo.o.sites:
            raise ConfigError("--sites", f"the synthetic imaging cohort has {len(HOSPITALS)}")
        self.study_path = demo.out / "study.toml"
        self.study_path.write_text(
            study_text(demo.o, model=self.model_name, image_size=self.image_size),
            encoding="utf-8",
        )
        demo.study = load_study(self.study_path)
        demo.served_study = self.study_path  # `coordinator serve --study`
        folders = write_imaging_cohort(
            demo.out / "cohort", names, seed=demo.o.seed,
            patients_per_site=demo.o.patients_per_site,
        )
        demo.say(f"[setup] synthetic imaging cohort: {len(names)} hospitals x "
                 f"{demo.o.patients_per_site} patients (1-3 images each, PNG and DICOM, "
                 f"different scanners and prevalence) in {demo.out / 'cohort'}")
        demo.say(f"[setup] study {self.study_path}: model {self.model_name}, images "
                 f"{self.image_size}x{self.image_size}, patient-level DP; served with "
                 "`coordinator serve --study`, sites enrolled into it")
        self.say_model(demo)
        return {site: folder.resolve() for site, folder in folders.items()}

    def load_datasets(
        self, demo: Demo, files: dict[str, Path | None]
    ) -> tuple[dict[str, Any], list[str]]:
        # site_agent.imaging imports torch: loaded only when the imaging demo runs
        from site_agent.imaging import image_spec_for_study, load_image_folder

        spec = image_spec_for_study(demo.study)
        self.datasets = {s: load_image_folder(p, spec) for s, p in files.items() if p}
        return self.datasets, []

    def say_model(self, demo: Demo) -> None:
        """The study's network as `coordinator serve --study` builds it (DP-checked)."""
        # common.models.build imports torch: loaded only when the imaging demo runs
        from common.models.build import initial_model

        model = initial_model(demo.study, seed=demo.o.seed)
        parameters = sum(p.numel() for p in model.parameters())
        demo.say(f"[setup] initial {self.model_name}: {parameters:,} parameters "
                 "(Opacus ModuleValidator: ok)")

    def site_config(self, demo: Demo, site: str, data: Path | None) -> str:
        o = demo.o
        return f"""study_file = "{self.study_path.resolve()}"

[data]
path = "{data}"

[privacy]
budget_epsilon = {o.budget_epsilon}
delta = {o.delta}
accountant = "rdp"
count_epsilon = {DEMO_COUNT_EPSILON}

[training]
max_physical_batch_size = 128
device = "{self.device}"
"""

    def baselines(self, demo: Demo, datasets: dict[str, Any]) -> dict[str, dict[str, float]]:
        return image_baselines(datasets, demo.o, study=demo.study, device=self.device,
                               keys=demo.split_keys)

    def exact_final(self, demo: Demo, bundle: Path) -> dict[str, Any]:
        """`DemoTask.exact_final`: every held-out image of every hospital (the sites'
        own splits), scored by the bundle's network."""
        # site_agent.predict and .trainer import torch: loaded only to score the final model
        from site_agent.predict import load_model, prediction_from_scores
        from site_agent.trainer import predict_scores

        model_bundle = read_bundle(bundle)
        held_out = _pool([
            split_by_patient(data, held_out_fraction=HELD_OUT_FRACTION,
                             key=demo.split_keys[site])[1]
            for site, data in sorted(self.datasets.items())
        ])
        scores = predict_scores(load_model(model_bundle), held_out, batch_size=256)
        found = prediction_from_scores(model_bundle, scores, held_out.labels).metrics
        return dict(found or {})

    def finish_report(self, demo: Demo, report: dict[str, Any]) -> None:
        exact = report["final"].get("exact") or {}
        if isinstance(report.get("model"), dict):
            report["model"]["name"] = self.model_name  # the model file the run produced
        if isinstance(exact.get("auc"), float):
            report["final"]["exact_auc"] = exact["auc"]
            estimate = report["final"].get("auc")
            demo.say(f"Exact held-out AUC of the final DP model: {exact['auc']:.3f} (the "
                     "demo holds every hospital's images; the federation sees only its DP "
                     "estimate" + (f", {dp_auc_text(report['final'])})"
                                   if isinstance(estimate, float) else ")"))
        report.update(
            task="imaging",
            model_name=self.model_name,
            image_size=self.image_size,
            device=self.device,
            study=str(self.study_path),
        )
        (demo.out / "report.json").write_text(json.dumps(report, indent=2, default=str))


# ------------------------------------------------------------------ baselines


def _pool(parts: list[Any]) -> Any:
    # site_agent.imaging imports torch: loaded only when the imaging demo runs
    from site_agent.imaging import ImageDataset

    return ImageDataset(
        [e for p in parts for e in p.entries],
        np.concatenate([p.labels for p in parts]),
        None,
        parts[0].spec,
        source="pooled",
    )


def _metrics(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    # Non-private baselines: AUC and Youden's operating point on the exact scores.
    m = operating_point_metrics_from_scores(scores, labels)
    return {"auc": m.auc, "sensitivity": m.sensitivity, "specificity": m.specificity,
            "ppv": m.ppv}


def image_baselines(
    datasets: dict[str, Any], o: DemoOptions, *, study: Any, device: str,
    keys: dict[str, bytes],
) -> dict[str, dict[str, float]]:
    """Centralized and FedAvg non-private baselines on the sites' own splits (the same
    held-out patients the federation evaluates on), with the study's model."""
    # torch: loaded only to train the baselines
    import torch

    # these import torch: loaded only to train the baselines
    from common.models.build import build_for_study
    from common.models.layout import flatten_parameters, load_flat_parameters
    from site_agent.trainer import LocalTrainer, predict_scores

    splits = {  # each site's own split, under its key
        site: split_by_patient(d, held_out_fraction=0.2, key=keys[site])
        for site, d in datasets.items()
    }

    def config(epochs: int, units: int) -> TrainingConfig:
        return TrainingConfig(
            batch_size=fit_batch_size(o.batch_size, units=units), max_physical_batch_size=128,
            local_epochs=epochs, lr=o.learning_rate, dp=False, device=device,
        )

    def initial() -> Any:
        torch.manual_seed(o.seed)  # fixed initial weights (the federation's: the study's)
        return build_for_study(study)

    held_out = _pool([h for _, h in splits.values()])
    train = _pool([t for t, _ in splits.values()])
    central = LocalTrainer(initial, train, config(o.rounds * o.local_epochs, len(train)),
                           seed=o.seed)
    central.train_round(flatten_parameters(central.model))
    scores = predict_scores(central.model, held_out, device=central.device, batch_size=256)
    results = {"centralized_nodp": _metrics(scores, held_out.labels)}

    model = initial()
    global_flat = flatten_parameters(model)
    trainers = {
        site: LocalTrainer(lambda: build_for_study(study), t, config(o.local_epochs, len(t)),
                           seed=o.seed)
        for site, (t, _) in splits.items()
    }
    for _ in range(o.rounds):
        total = np.zeros_like(global_flat, dtype=np.float64)
        weight = 0
        for trainer in trainers.values():
            result = trainer.train_round(global_flat)
            # Each update element clipped as the federation's sites clip theirs before
            # SecAgg+ (aggregation.clip): a no-DP site's update at the demo's step size
            # can otherwise blow up the average.
            delta = np.clip(result.delta_flat.astype(np.float64), -UPDATE_CLIP, UPDATE_CLIP)
            total += result.num_samples * delta
            weight += result.num_samples
        global_flat = (global_flat + total / weight).astype(np.float32)
    load_flat_parameters(model, global_flat)
    scores = predict_scores(model, held_out, batch_size=256)
    results["federated_nodp"] = _metrics(scores, held_out.labels)
    return results
