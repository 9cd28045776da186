"""`medfed bench dpsgd --privacy-unit patient` compares like work: both modes take the
same steps per epoch, the records each forwarded are counted at the model's input, and
the ratios are of seconds per record forwarded."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench import dpsgd
from site_agent.patient_dp import PatientSampler


def test_patient_bench_counts_the_records_each_mode_forwards() -> None:
    seed, epochs, batch, batches, image = 3, 2, 16, 8, 16
    result = dpsgd.run(
        privacy_unit="patient", model="cnn", image_size=image, batch_size=batch,
        batches=batches, epochs=epochs, max_physical_batch_size=1024, seed=seed,
    )
    records, steps = result["records"], result["steps_per_epoch"]
    assert records == batch * batches and result["patients"] < records
    # Non-private: one pass over every record per epoch, in as many steps as the
    # patient-level epoch, one forward per step (the physical batch holds a step).
    assert result["nonprivate_batch_size"] == math.ceil(records / steps)
    assert result["nonprivate_steps_per_epoch"] == steps
    assert result["nonprivate_records_per_epoch"] == [records] * epochs
    assert result["nonprivate_forwards_per_epoch"] == [steps] * epochs

    # Patient level: replay the trainer's Poisson sampler (its generator is seeded by
    # the seed; the bench's warm-up epoch draws first) and count what it forwards.
    ids = dpsgd._image_data(records=records, image_size=image, seed=seed).patient_ids
    _, inverse = np.unique(ids, return_inverse=True)
    sampler = PatientSampler(torch.as_tensor(inverse), sample_rate=batch / result["patients"])
    generator = torch.Generator().manual_seed(seed)
    drawn = [[int(sampler.sample(generator)[0].numel()) for _ in range(steps)]
             for _ in range(1 + epochs)][1:]
    assert result["patient_records_per_epoch"] == [sum(epoch) for epoch in drawn]
    assert result["patient_forwards_per_epoch"] == [
        sum(1 for n in epoch if n > 0) for epoch in drawn
    ]

    assert result["patient_cpu_ratio"] == pytest.approx(
        result["patient_cpu_seconds_per_record"] / result["nonprivate_cpu_seconds_per_record"]
    )
    assert result["patient_ratio"] == pytest.approx(
        result["patient_seconds_per_record"] / result["nonprivate_seconds_per_record"]
    )
