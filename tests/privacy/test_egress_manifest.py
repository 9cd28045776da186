"""The egress manifest covers every field a site sends and every segment of its vector:
a new proto field or segment without a manifest entry fails here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.core.errors import ValidationError
from common.crypto.random import numpy_generator, system_random
from common.proto.medfed.v1 import federation_pb2 as pb
from common.releases import egress, seam

ROOT = Path(__file__).resolve().parents[2]


def _site_to_coordinator_fields() -> set[str]:
    """Every field of every message a site sends: the request types of the service and,
    recursively, every message type they contain."""
    service = pb.DESCRIPTOR.services_by_name["Federation"]
    pending = [method.input_type for method in service.methods]
    seen: set[str] = set()
    fields: set[str] = set()
    while pending:
        message = pending.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for field in message.fields:
            fields.add(f"{message.name}.{field.name}")
            if field.message_type is not None:
                pending.append(field.message_type)
    return fields


def test_every_site_field_is_in_the_manifest() -> None:
    sent = _site_to_coordinator_fields()
    missing = sorted(sent - set(egress.SITE_FIELDS))
    stale = sorted(set(egress.SITE_FIELDS) - sent)
    assert not missing, f"fields a site sends with no egress manifest entry: {missing}"
    assert not stale, f"manifest entries for fields no site sends: {stale}"


def test_every_dp_field_names_its_ledger_purpose() -> None:
    for name, entry in egress.SITE_FIELDS.items():
        if entry.protection is egress.Protection.DP:
            assert entry.ledger_purpose, name


def test_round_vector_is_exactly_its_segments() -> None:
    manifest = egress.round_manifest(model_elements=10, histogram_bins=4)
    assert manifest.kinds() == (egress.MODEL_UPDATE, egress.WEIGHT, egress.EVALUATION_HISTOGRAM)
    assert manifest.vector_length == 10 + 1 + 8
    for kind in manifest.kinds():
        assert kind in egress.SEGMENT_KINDS
        spec = egress.SEGMENT_KINDS[kind]
        assert spec.protection in (egress.Protection.DP, egress.Protection.DP_DERIVED), (
            f"segment {kind} leaves the site without a DP mechanism"
        )


def test_docs_table_is_generated_from_the_manifest() -> None:
    text = (ROOT / "docs" / "privacy.md").read_text()
    assert seam.docs_section() in text, (
        "docs/privacy.md's egress table is stale: paste `python -m common.releases.egress` over it"
    )


def test_signed_integers_sum_through_the_ring() -> None:
    manifest = egress.round_manifest(model_elements=3, histogram_bins=2)
    rng = numpy_generator(system_random)
    total = np.zeros(manifest.vector_length, dtype=np.uint32)
    histograms = [np.array([3, -2, 0, 5]), np.array([-4, 1, 2, -1])]
    for weight, hist in zip((7, 0), histograms, strict=True):
        vector = manifest.encode(
            {egress.MODEL_UPDATE: np.zeros(3, np.float32), egress.WEIGHT: [weight],
             egress.EVALUATION_HISTOGRAM: hist},
            clip=1.0, bits=16, n_sites=2, rng=rng,
        )
        np.add(total, vector, out=total)
    sums = manifest.decode_integers(total)
    assert sums[egress.WEIGHT].tolist() == [7]
    assert sums[egress.EVALUATION_HISTOGRAM].tolist() == [-1, -1, 2, 4]


def test_encode_refuses_values_outside_the_manifest() -> None:
    manifest = egress.round_manifest(model_elements=2, histogram_bins=2)
    rng = numpy_generator(system_random)
    base = {egress.MODEL_UPDATE: np.zeros(2, np.float32), egress.WEIGHT: [1],
            egress.EVALUATION_HISTOGRAM: np.zeros(4, np.int64)}
    with pytest.raises(ValidationError, match="extra"):
        manifest.encode({**base, "raw_count": [5]}, clip=1, bits=8, n_sites=2, rng=rng)
    with pytest.raises(ValidationError, match="missing"):
        manifest.encode({egress.MODEL_UPDATE: np.zeros(2)}, clip=1, bits=8, n_sites=2, rng=rng)
    with pytest.raises(ValidationError, match="not in the egress manifest"):
        egress.EgressManifest((egress.VectorSegment("raw_count", 1),))
