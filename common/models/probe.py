"""Where a network's scores lie, read from inputs anyone can draw: the median logit of
each class's score on `PROBE_INPUTS` synthetic records (uniform pixels for an images
study, standard normal features for a table) from the fixed public seed `PROBE_SEED`.

The coordinator lays the first evaluated round's buckets around this probe
(`common.releases.evaluation_edges.probe_edges`) and moves each later round's by how far it
moved between the model a round evaluated and the model it produced
(`common.releases.evaluation_edges.next_edges` with a shift): a DP model's held-out scores can
sit in a band a tenth of a logit wide that moves by more than its width from one round
to the next, so buckets set from the last release alone miss it. The probe reads only the
public global model and public random inputs: post-processing, no privacy cost (Dwork &
Roth 2014, Prop. 2.1). Imports torch: only the coordinator's round step calls it.
"""

from __future__ import annotations

import numpy as np
import torch

from common.models.build import build_for_study
from common.models.layout import load_flat_parameters
from common.study import Study, encoded_feature_names

PROBE_INPUTS = 32
PROBE_SEED = 0


def probe_logits(study: Study, flat: np.ndarray) -> np.ndarray:
    """Per one-vs-rest block (1 for a binary study, K for K classes), the median over
    the probe inputs of the logit of that class's score under the parameters `flat`."""
    allowed = (study.model.custom,) if study.model.custom else ()
    model = build_for_study(study, allowed_model_factories=allowed, check_dp=False)
    load_flat_parameters(model, np.asarray(flat, dtype=np.float32))
    model.eval()
    generator = torch.Generator().manual_seed(PROBE_SEED)
    if study.data.kind == "images" and study.data.image_size is not None:
        height, width = study.data.image_size
        inputs = torch.rand((PROBE_INPUTS, study.data.channels, height, width),
                            generator=generator)
    else:
        features = len(encoded_feature_names(study))
        inputs = torch.randn((PROBE_INPUTS, features), generator=generator)
    with torch.no_grad():
        out = model(inputs).reshape(PROBE_INPUTS, -1).double()
    if out.shape[1] == 1:
        logits = out  # binary: the model's output is the score's logit
    else:
        log_p = torch.log_softmax(out, dim=1)
        logits = log_p - torch.log((-torch.expm1(log_p)).clamp_min(1e-300))
    return np.asarray(np.median(logits.numpy(), axis=0), dtype=np.float64)
