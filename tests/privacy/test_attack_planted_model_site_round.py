"""What else a planted model (or a site's own data) could make fail between the round's
announcement and the upload, each turned into the same behaviour as any other site: a
non-finite trained update is sent as zero, a score the model cannot compute lands in a
fixed public bucket, and an image that no longer decodes is an all-zero image. Each was
an exception before: the site stopped in the round, and its dropout was the bit."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from common.core.config import SitePolicySection
from common.core.errors import DataError
from common.core.modelfile import flat_layout
from common.crypto.quantize import dequantize_sum
from common.models.tables.mlp import TabularMLP
from common.releases import egress
from common.releases.evaluation import score_histogram
from common.releases.evaluation_edges import default_edges
from common.rounds.announcement import Announcement, RoundPlan, validate_for_site
from site_agent.data import SiteData
from site_agent.held_out import finite_scores, held_out_histogram
from site_agent.imaging import ImageDataset, image_spec_for_study, load_image_folder
from site_agent.site_training import LocalUpdate
from site_agent.synthetic_imaging import write_site_folder
from site_agent.training_round import encode_update
from tests.privacy.planted_models import plant_tabular

DIM = 40
BINS = 4
ANNOUNCEMENT = Announcement(
    round_number=4, round_nonce=bytes(range(16)), participants=("alpha", "beta", "gamma"),
    threshold=3, neighbours=0, vector_length=DIM + 1 + 2 * BINS, quantization_bits=16,
    clip=1.0, histogram_bins=BINS, secure_aggregation=True, model_layout=flat_layout(DIM),
    model_sha256=bytes(32), model_bytes=4 * DIM, local_epochs=1, learning_rate=0.1,
    fedprox_mu=0.0, planned_rounds=5, train_deadline_ms=1_700_000_000_000,
    phase_timeout_ms=30_000, weight_cap=100,
)


def test_attack_planted_model_nan_update_is_sent_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    """The upload of a round whose training ended in NaN: the model segment is zero
    (within the quantizer's one step), weight and histogram as for any update; the site
    logs it locally."""
    rnd = validate_for_site(ANNOUNCEMENT, policy=SitePolicySection(), site_id="alpha")
    delta = np.full(DIM, np.nan, dtype=np.float32)
    histogram = np.arange(2 * BINS, dtype=np.int64)
    with caplog.at_level(logging.WARNING, logger="medfed.site"):
        vector = encode_update(rnd, LocalUpdate(delta, 60, histogram, 0.1))
    assert "update_not_finite" in [getattr(r, "event", "") for r in caplog.records]
    manifest = ANNOUNCEMENT.manifest()
    model = vector[manifest.slice_of(egress.MODEL_UPDATE)]
    decoded = dequantize_sum(model, clip=1.0, bits=16, count=1)
    assert np.abs(decoded).max() <= 2.0 / ((1 << 16) - 1) + 1e-12
    integers = manifest.decode_integers(vector)
    assert integers[egress.WEIGHT].tolist() == [60]
    assert integers[egress.EVALUATION_HISTOGRAM].tolist() == histogram.tolist()


def test_finite_scores_put_what_the_model_cannot_score_in_a_fixed_bucket() -> None:
    assert finite_scores(np.array([0.1, np.nan, np.inf, 0.9])).tolist() == [0.1, 0.5, 0.5, 0.9]
    rows = finite_scores(np.array([[0.5, 0.5, 0.0], [np.nan, np.nan, np.nan]]))
    assert rows.tolist() == [[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]


def test_attack_planted_model_scores_the_targeted_record_in_the_uninformative_bucket() -> None:
    """The held-out histogram of a planted model: the targeted record (NaN logit) is
    counted once, in the bucket of score 0.5, never an exception."""
    torch.manual_seed(0)
    model = plant_tabular(TabularMLP(3, hidden=(4,)), threshold=3.0)
    x = np.array([[0.5, 0, 0], [10.0, 0, 0], [-1.0, 0, 0], [0.2, 1, 1]], dtype=np.float32)
    labels = np.array([0, 1, 1, 0])
    holdout = SiteData(x, labels, None)
    plan = RoundPlan(round_number=4, planned_rounds=5, local_epochs=1, learning_rate=0.1,
                     fedprox_mu=0.0, histogram_bins=BINS, layout=flat_layout(1))
    counts = held_out_histogram(model, holdout, plan, per_unit=False, device="cpu",
                                task="binary", num_classes=2)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    assert torch.isnan(logits[1]) and torch.isfinite(logits[[0, 2, 3]]).all()
    scores = torch.sigmoid(logits).double().numpy()
    scores[1] = 0.5
    assert counts.tolist() == score_histogram(scores, labels, edges=default_edges(BINS)).tolist()


def test_an_image_that_no_longer_decodes_in_a_round_is_an_all_zero_image(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An image whose pixels are cut off after the site joined (headers still fine): a
    site in a round reads it as zeros and logs it; an offline command still refuses it."""
    from common.study import study_from_mapping

    folder = write_site_folder(tmp_path, "north_general", seed=3, patients=4)
    study = study_from_mapping({
        "study": {"name": "imgs", "rounds": 1, "classes": ["0", "1"]},
        "data": {"kind": "images", "file_column": "file", "label_column": "label",
                 "patient_column": "patient_id", "image_size": [8, 8], "channels": 1},
        "model": {"name": "cnn"},
    })
    in_round = load_image_folder(folder, image_spec_for_study(study, blank_unreadable=True))
    offline = load_image_folder(folder, image_spec_for_study(study))
    broken = in_round.entries[1].path
    broken.write_bytes(broken.read_bytes()[:60])  # the header survives, the pixels do not
    with caplog.at_level(logging.WARNING, logger="medfed.site"):
        batch = in_round.load(np.array([0, 1, 2]))
    assert batch.shape == (3, 1, 8, 8) and torch.all(batch[1] == 0)
    assert float(batch[0].abs().sum()) > 0
    assert str(broken) in caplog.text
    with pytest.raises(DataError, match="unreadable image"):
        offline.load(np.array([1]))
    assert isinstance(in_round.subset(np.array([1])), ImageDataset)
    assert torch.all(in_round.subset(np.array([1])).load(np.array([0])) == 0)

