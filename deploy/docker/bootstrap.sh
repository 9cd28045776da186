#!/bin/sh
# One-off federation bootstrap for docker-compose.yml (the "pki-init" service).
# Idempotent: an existing CA or initial model is never replaced, so re-running
# `docker-compose up` keeps every certificate and the training history.
#
#   PKI_DIR            where the CA and all certificates go (a volume)
#   COORDINATOR_HOSTS  names the sites dial (comma-separated; localhost is for the
#                      container's own health probe)
#   SITES              site ids to issue certificates for (space-separated)
#   MODEL_FILE         initial global model (TabularMLP over the synthetic features)
#   MODEL_SEED         torch seed of its initialisation
#
# Production: run `medfed pki` on the operator's offline machine instead (docs/deploy.md);
# the CA key must not live on a volume that running services mount.
set -eu
PKI_DIR="${PKI_DIR:-/pki}"
COORDINATOR_HOSTS="${COORDINATOR_HOSTS:-coordinator,localhost}"
SITES="${SITES:-paediatric geriatric rural}"
MODEL_FILE="${MODEL_FILE:-/state/initial-model.mfm}"
MODEL_SEED="${MODEL_SEED:-2}"

if [ ! -f "$PKI_DIR/ca.crt" ]; then
    medfed pki init --dir "$PKI_DIR"
    medfed pki issue --dir "$PKI_DIR" --coordinator "$COORDINATOR_HOSTS"
    # The coordinator accepts mutual TLS only, so its health probe needs a client
    # certificate of its own; it never takes part in rounds.
    for site in $SITES healthcheck; do
        medfed pki issue --dir "$PKI_DIR" --site "$site"
    done
else
    echo "bootstrap: $PKI_DIR/ca.crt exists, keeping the PKI"
fi

if [ ! -f "$MODEL_FILE" ]; then
    MODEL_FILE="$MODEL_FILE" MODEL_SEED="$MODEL_SEED" python - <<'PY'
import os
from pathlib import Path

import torch

from common.modelfile import ModelFile, write_model_file
from site_agent.hooks import model_layout
from site_agent.models import TabularMLP, flatten_parameters
from site_agent.synthetic import FEATURES

torch.manual_seed(int(os.environ["MODEL_SEED"]))
model = TabularMLP(len(FEATURES))
path = Path(os.environ["MODEL_FILE"])
path.parent.mkdir(parents=True, exist_ok=True)
write_model_file(path, ModelFile(model_layout(model), flatten_parameters(model)))
print(f"bootstrap: wrote initial model {path}")
PY
else
    echo "bootstrap: $MODEL_FILE exists, keeping it"
fi
