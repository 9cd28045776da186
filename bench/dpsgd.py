"""`medfed bench dpsgd`: what DP-SGD costs over non-private training, side by side.

One epoch of (a) non-private SGD, (b) DP-SGD with Opacus ghost clipping and (c) DP-SGD
with Opacus per-sample-gradient hooks, record-level privacy so that Opacus' paths are
what is measured: on the demo MLP and the demo site data (the largest synthetic demo
hospital), or with ``--model cnn|resnet18-gn|densenet121-gn`` on synthetic images held
in memory (``--image-size``, ``--batches`` steps per epoch). The three are timed in
turn, epoch after epoch, in one process, so machine load affects them alike; medians
are reported, of wall-clock time and of process CPU time (the steadier figure on a shared machine).
A fourth trainer is built with ``grad_sample_mode = "auto"``, as a site's is: it times a
few steps of each mode on its device and keeps the faster; the bench prints what it
measured and picked beside the side-by-side figures (``auto_is_faster``).

``--privacy-unit patient`` times the path a site takes whenever its data has a patient
column (``privacy_unit = "auto"``): patient-level DP-SGD (`site_agent.unit_clipping`)
against non-private training on the same records, with the patient ids kept. A
patient-level epoch is round(patients / batch) Poisson steps, which forward
round(U / B) x B / U of the records in expectation (0.93 of them at 137 patients and
batch 32) and a random number each epoch, while a non-private epoch forwards every
record once. So the non-private batch is ceil(records / steps): both modes take the same
number of steps per epoch, each step one forward and one backward per physical batch of
the same size limit, and the ratios are of seconds per record forwarded, with the
records each mode forwarded counted at the model's input (``*_records_per_epoch``,
``*_forwards_per_epoch``).
Each mode's peak memory is reported beside its time, from three more epochs of each
mode run after the timed ones (the sampler's thread would count in the process CPU
time): on a GPU the allocator's peak, on a CPU the resident set's peak above its level
at the epoch's start (sampled every millisecond).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Literal

import numpy as np

from common.models import ModelSpec, model_names
from site_agent.data import SiteData, prepare_site_split
from site_agent.synthetic import FEATURES, generate_cohort
from site_agent.synthetic_imaging import in_memory_images
from site_agent.training_config import TrainingConfig

DEMO_SITE = "urban_academic"
IMAGE_SITE = "lakeside_university"
MODES = ("nonprivate", "ghost", "hooks")
PATIENT_MODES = ("nonprivate", "patient")
PRIVACY_UNITS = ("record", "patient")


class PeakMemory:
    """Peak memory of one timed epoch, in bytes: the CUDA allocator's peak on a GPU,
    else the process's resident set sampled every millisecond above its starting level."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        # torch: loaded only when a benchmark runs, never by `medfed --help`
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return self
        self._base = _resident_bytes()
        self._peak = self._base
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._peak = max(self._peak, _resident_bytes())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # torch: loaded only when a benchmark runs, never by `medfed --help`
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._peak, _resident_bytes()) - self._base


def _resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where that is unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
MODELS = ("mlp", *model_names("images"))


def _image_data(
    *, records: int, image_size: int, seed: int
) -> Any:
    """`records` synthetic images in memory (so decoding is not what is timed), with
    their patient ids."""
    images, labels, patients = in_memory_images(
        IMAGE_SITE, seed=seed, patients=records, image_size=image_size
    )
    if images.shape[0] < records:
        raise SystemExit(f"only {images.shape[0]} synthetic images; ask for fewer batches")
    return SiteData(
        images[:records], labels[:records], patients[:records], source="synthetic images"
    )


def run(
    *,
    epochs: int = 5,
    batch_size: int = 256,
    threads: int = 1,
    seed: int = 0,
    model: str = "mlp",
    image_size: int = 64,
    batches: int | None = None,
    max_physical_batch_size: int | None = None,
    device: str = "cpu",
    privacy_unit: str = "record",
) -> dict[str, Any]:
    """Median seconds per epoch of each mode and the DP/non-private ratios.

    `batches` fixes the steps per epoch (records = batches x batch size) so that a
    large model is measured in minutes; the MLP uses the demo site as before.
    """
    # torch: loaded only when a benchmark runs (seconds and ~300 MB `medfed --help` skips)
    import torch

    # these import torch and Opacus: loaded only when a benchmark runs
    from common.models.build import build_model
    from common.models.layout import flatten_parameters
    from site_agent.trainer import LocalTrainer

    if privacy_unit not in PRIVACY_UNITS:
        raise SystemExit(f"--privacy-unit must be one of {', '.join(PRIVACY_UNITS)}")
    torch.set_num_threads(threads)
    spec = ModelSpec(name=model)
    if spec.canonical_name == "mlp":
        cohort = generate_cohort([DEMO_SITE], seed=seed)
        # A split key fixed by the seed: the bench measures speed, not a site's secret.
        key = hashlib.sha256(b"medfed/bench/split/%d" % seed).digest()
        train, _, _ = prepare_site_split(cohort[DEMO_SITE], key=key)
        if batches is not None:
            train = train.subset(np.arange(min(len(train), batches * batch_size)))

        def factory() -> Any:
            return build_model(spec, in_features=len(FEATURES))

        physical = max_physical_batch_size or max(batch_size * 2, 1024)
        what = f"{len(FEATURES)} features"
    else:
        records = (batches or 2) * batch_size
        train = _image_data(records=records, image_size=image_size, seed=seed)

        def factory() -> Any:
            return build_model(spec, in_channels=1, image_size=image_size)

        physical = max_physical_batch_size or 64
        what = f"{image_size}x{image_size} images"
    def config(mode: str) -> Any:
        path: Literal["ghost", "hooks", "auto"] = (
            "hooks" if mode == "hooks" else "auto" if mode == "auto" else "ghost"
        )
        return TrainingConfig(
            batch_size=batch_size,
            max_physical_batch_size=physical,
            local_epochs=1,
            lr=0.5 if spec.canonical_name == "mlp" else 0.05,
            dp=mode != "nonprivate",
            privacy_unit="auto" if privacy_unit == "patient" else "record",
            grad_sample_mode=path,
            delta=min(1e-5, 0.5 / len(train)),
            device=device,
        )

    if privacy_unit == "patient":
        return _run_patient(config, factory, train, epochs=epochs, seed=seed, meta={
            "model": spec.canonical_name, "input": what, "batch_size": batch_size,
            "max_physical_batch_size": physical, "threads": threads, "epochs": epochs,
        })
    trainers = {}
    for mode in MODES:
        torch.manual_seed(seed)
        trainers[mode] = LocalTrainer(factory, train, config(mode), seed=seed)
    # What a site's trainer picks: `auto` times each mode on a copy of the model
    # (synthetic inputs of the physical batch shape) and keeps the faster.
    torch.manual_seed(seed)
    auto_started = time.perf_counter()
    auto_trainer = LocalTrainer(factory, train, config("auto"), seed=seed)
    auto_setup = time.perf_counter() - auto_started
    choice = auto_trainer.grad_sample_choice
    if choice is None:
        raise SystemExit("auto did not choose a record-level DP path")
    del auto_trainer
    start = flatten_parameters(trainers["nonprivate"].model)
    with warnings.catch_warnings():
        # Opacus' full backward hooks warn when inputs need no grad (they never do here).
        warnings.simplefilter("ignore", UserWarning)
        for trainer in trainers.values():  # warm-up: first-call allocations, lazy init
            trainer.train_round(start)
        timings = _alternate(trainers, start, epochs)
    seconds, cpu, peak = timings.seconds, timings.cpu, timings.peak
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    cpu_median = {mode: statistics.median(values) for mode, values in cpu.items()}
    auto = choice.mode
    # On a shared CPU, process time is the steadier measure of which path is cheaper.
    basis = cpu_median if str(trainers["ghost"].device) == "cpu" else median
    faster = min(("ghost", "hooks"), key=lambda m: basis[m])
    return {
        "model": spec.canonical_name,
        "input": what,
        "parameters": int(sum(p.numel() for p in trainers["nonprivate"].model.parameters())),
        "records": len(train),
        "batch_size": batch_size,
        "max_physical_batch_size": physical,
        "steps_per_epoch": trainers["ghost"].steps_per_epoch,
        "threads": threads,
        "device": str(trainers["ghost"].device),
        "epochs": epochs,
        "nonprivate_seconds": median["nonprivate"],
        "ghost_seconds": median["ghost"],
        "hooks_seconds": median["hooks"],
        "ghost_ratio": median["ghost"] / median["nonprivate"],
        "hooks_ratio": median["hooks"] / median["nonprivate"],
        "nonprivate_cpu_seconds": cpu_median["nonprivate"],
        "ghost_cpu_seconds": cpu_median["ghost"],
        "hooks_cpu_seconds": cpu_median["hooks"],
        "ghost_cpu_ratio": cpu_median["ghost"] / cpu_median["nonprivate"],
        "hooks_cpu_ratio": cpu_median["hooks"] / cpu_median["nonprivate"],
        **{f"{mode}_peak_mib": peak[mode] / 2**20 for mode in MODES},
        "ghost_mode_used": trainers["ghost"].grad_sample_mode,
        "auto_mode": auto,
        "auto_measured_step_seconds": dict(choice.seconds_per_step),
        "auto_setup_seconds": auto_setup,
        "auto_is_faster": auto == faster,
        # >= 1: the epoch time of auto's pick over the faster mode's (1.0 when it is the
        # faster); a pick that lost by a few percent lost within the run-to-run noise.
        "auto_cost_vs_faster": basis[auto] / basis[faster],
    }


class ForwardCount:
    """Forward passes of a model and the records they carried (its input's first
    dimension), counted at the model's input while the context is open."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forwards = 0
        self.records = 0

    def _count(self, module: Any, inputs: tuple[Any, ...]) -> None:
        self.forwards += 1
        self.records += int(inputs[0].shape[0])

    def __enter__(self) -> ForwardCount:
        self._handle = self.model.register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


@dataclasses.dataclass
class Timings:
    """Per mode and epoch: wall and CPU seconds, records forwarded, forward passes;
    and the peak memory of any epoch."""

    seconds: dict[str, list[float]]
    cpu: dict[str, list[float]]
    records: dict[str, list[int]]
    forwards: dict[str, list[int]]
    peak: dict[str, int]


PEAK_EPOCHS = 3


def _alternate(trainers: dict[str, Any], start: Any, epochs: int) -> Timings:
    """Epochs of each trainer in turn, timed; then `PEAK_EPOCHS` more of each, in turn,
    for the peak memory. The resident-set sampler is kept out of the timed epochs: its
    thread's CPU time counts in the process's (about 2 ms per epoch of 10-30 ms on the
    2-core VM, comparable to a small model's whole epoch)."""
    timings = Timings(
        seconds={mode: [] for mode in trainers}, cpu={mode: [] for mode in trainers},
        records={mode: [] for mode in trainers}, forwards={mode: [] for mode in trainers},
        peak={mode: 0 for mode in trainers},
    )
    for _ in range(epochs):
        for mode, trainer in trainers.items():
            cpu_start = time.process_time()
            with ForwardCount(trainer.model) as count:
                timings.seconds[mode].append(trainer.train_round(start).seconds)
            timings.cpu[mode].append(time.process_time() - cpu_start)
            timings.records[mode].append(count.records)
            timings.forwards[mode].append(count.forwards)
    for _ in range(PEAK_EPOCHS):
        for mode, trainer in trainers.items():
            with PeakMemory(str(trainer.device)) as memory:
                trainer.train_round(start)
            timings.peak[mode] = max(timings.peak[mode], memory.peak)
    return timings


def _run_patient(
    config: Any, factory: Any, train: Any, *, epochs: int, seed: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """Non-private against patient-level DP-SGD (what `auto` picks on data with a
    patient column), epochs alternated; ratios of seconds per record forwarded."""
    # torch: loaded only when a benchmark runs
    import torch

    # these import torch and Opacus: loaded only when a benchmark runs
    from common.models.layout import flatten_parameters
    from site_agent.trainer import LocalTrainer

    if train.patient_ids is None:
        raise SystemExit("these records have no patient ids")
    torch.manual_seed(seed)
    dp = LocalTrainer(factory, train, config("patient"), seed=seed)
    if dp.privacy_unit != "patient":
        raise SystemExit("auto did not choose patient-level DP on data with patient ids")
    # A non-private epoch is one pass over the records: batches of ceil(N / steps)
    # records take the patient-level epoch's number of steps.
    nonprivate = dataclasses.replace(
        config("nonprivate"), batch_size=math.ceil(len(train) / dp.steps_per_epoch)
    )
    torch.manual_seed(seed)
    trainers = {"nonprivate": LocalTrainer(factory, train, nonprivate, seed=seed), "patient": dp}
    start = flatten_parameters(trainers["nonprivate"].model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for trainer in trainers.values():
            trainer.train_round(start)
        timings = _alternate(trainers, start, epochs)

    def per_record(values: dict[str, list[float]], mode: str) -> float:
        """Median over epochs of seconds per record forwarded."""
        return statistics.median(
            value / max(1, records) for value, records in zip(values[mode], timings.records[mode])
        )

    wall = {mode: per_record(timings.seconds, mode) for mode in PATIENT_MODES}
    cpu = {mode: per_record(timings.cpu, mode) for mode in PATIENT_MODES}
    return {
        **meta,
        "privacy_unit": "patient",
        "parameters": int(sum(p.numel() for p in dp.model.parameters())),
        "records": len(train),
        "patients": dp.num_units,
        "steps_per_epoch": dp.steps_per_epoch,
        "nonprivate_steps_per_epoch": math.ceil(len(train) / nonprivate.batch_size),
        "nonprivate_batch_size": nonprivate.batch_size,
        "device": str(dp.device),
        **{f"{mode}_seconds": statistics.median(timings.seconds[mode]) for mode in PATIENT_MODES},
        **{f"{mode}_cpu_seconds": statistics.median(timings.cpu[mode])
           for mode in PATIENT_MODES},
        **{f"{mode}_records_per_epoch": timings.records[mode] for mode in PATIENT_MODES},
        **{f"{mode}_forwards_per_epoch": timings.forwards[mode] for mode in PATIENT_MODES},
        **{f"{mode}_seconds_per_record": wall[mode] for mode in PATIENT_MODES},
        **{f"{mode}_cpu_seconds_per_record": cpu[mode] for mode in PATIENT_MODES},
        **{f"{mode}_peak_mib": timings.peak[mode] / 2**20 for mode in PATIENT_MODES},
        "patient_ratio": wall["patient"] / wall["nonprivate"],
        "patient_cpu_ratio": cpu["patient"] / cpu["nonprivate"],
        "patient_mode_used": dp.grad_sample_mode,
    }


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="mlp",
        choices=list(MODELS),
        help="registry model",
    )
    parser.add_argument("--image-size", type=int, default=64, help="image side (image models)")
    parser.add_argument(
        "--batches", type=int, default=None,
        help="steps per epoch (default: the whole demo site for mlp, 2 for image models)",
    )
    parser.add_argument("--epochs", type=int, default=5, help="timed epochs per mode")
    parser.add_argument("--batch-size", type=int, default=256, help="expected logical batch")
    parser.add_argument(
        "--max-physical-batch-size", type=int, default=None,
        help="records per forward/backward chunk (default 64 for image models)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--privacy-unit", choices=list(PRIVACY_UNITS), default="record",
        help="record: ghost and hooks record-level DP-SGD; patient: the patient-level path "
        "`auto` takes on data with a patient column, with the patient ids kept",
    )
    parser.add_argument("--json", action="store_true", help="last line is a JSON object")


def main_from_args(args: argparse.Namespace) -> int:
    result = run(
        epochs=args.epochs,
        batch_size=args.batch_size,
        threads=args.threads,
        seed=args.seed,
        model=args.model,
        image_size=args.image_size,
        batches=args.batches,
        max_physical_batch_size=args.max_physical_batch_size,
        device=args.device,
        privacy_unit=args.privacy_unit,
    )
    if args.privacy_unit == "patient":
        return _print_patient(result, as_json=args.json)
    print(
        f"DP-SGD on {result['model']} ({result['parameters']:,} parameters, {result['input']}), "
        f"{result['records']} records, batch {result['batch_size']} "
        f"(physical {result['max_physical_batch_size']}), "
        f"{result['steps_per_epoch']} steps/epoch, {result['threads']} thread(s), "
        f"{result['device']}, median of {result['epochs']} epochs"
    )
    for mode in MODES:
        line = (
            f"  {mode:<11} {result[f'{mode}_seconds'] * 1e3:9.1f} ms/epoch wall "
            f"{result[f'{mode}_cpu_seconds'] * 1e3:9.1f} ms CPU "
            f"{result[f'{mode}_peak_mib']:8.1f} MiB peak"
        )
        if mode != "nonprivate":
            line += (
                f"   {result[f'{mode}_ratio']:.2f}x non-private "
                f"({result[f'{mode}_cpu_ratio']:.2f}x CPU)"
            )
            if mode == result["auto_mode"]:
                line += "   <- auto"
        print(line)
    measured = ", ".join(
        f"{mode} {seconds * 1e3:.1f} ms"
        for mode, seconds in result["auto_measured_step_seconds"].items()
    )
    verdict = (
        "the faster mode here" if result["auto_is_faster"]
        else f"{(result['auto_cost_vs_faster'] - 1) * 100:.0f}% slower than the other here"
    )
    print(
        f"  auto measured per step ({measured}; {result['auto_setup_seconds']:.1f} s to set up "
        f"the trainer) and picked {result['auto_mode']}: {verdict}"
    )
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if not isinstance(v, np.generic)}))
    return 0


def _print_patient(result: dict[str, Any], *, as_json: bool) -> int:
    print(
        f"patient-level DP-SGD on {result['model']} ({result['parameters']:,} parameters, "
        f"{result['input']}), {result['records']} records of {result['patients']} patients, "
        f"batch {result['batch_size']} patients (non-private: {result['nonprivate_batch_size']} "
        f"records; physical {result['max_physical_batch_size']} records), "
        f"{result['steps_per_epoch']} steps/epoch, {result['threads']} thread(s), "
        f"{result['device']}, median of {result['epochs']} epochs; ratios per record forwarded"
    )
    for mode in PATIENT_MODES:
        records = result[f"{mode}_records_per_epoch"]
        line = (
            f"  {mode:<11} {result[f'{mode}_seconds'] * 1e3:9.1f} ms/epoch wall "
            f"{result[f'{mode}_cpu_seconds'] * 1e3:9.1f} ms CPU "
            f"{result[f'{mode}_cpu_seconds_per_record'] * 1e6:9.1f} us CPU/record "
            f"({min(records)}-{max(records)} records/epoch) "
            f"{result[f'{mode}_peak_mib']:8.1f} MiB peak"
        )
        if mode == "patient":
            line += (
                f"   {result['patient_ratio']:.2f}x non-private "
                f"({result['patient_cpu_ratio']:.2f}x CPU; {result['patient_mode_used']})"
            )
        print(line)
    if as_json:
        print(json.dumps(result))
    return 0


def register(bench_subparsers: Any) -> None:
    """Add ``dpsgd`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser("dpsgd", help="DP-SGD vs non-private training cost")
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench dpsgd", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
