"""The finished study's final model, as a site stores it: streamed from the coordinator
to a temporary file within a bound (the study's model size plus the bundle's header),
checked to be the final bundle of the study this site joined, trained with the
statistics this site pinned, then renamed to STATE/model/final.safetensors. A final
model of an earlier study already there is kept beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from common.core.config import SiteSettings
from common.core.errors import MedfedError, ValidationError
from common.core.fileio import replace_durably
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.releases.bundle import (
    HEADER_MARGIN_BYTES,
    bundle_from_bytes,
    bundle_size_limit,
    read_bundle,
)
from common.study import study_sha256
from site_agent.site_training import TrainingHook
from site_agent.statistics_pin import StatisticsPin

log = logging.getLogger("medfed.site")

MAX_BUNDLE_BYTES = 1 << 31
"""The final-model download's bound when this process heard no announcement of the
study and its hook cannot size the study's model (otherwise `bundle_size_limit`)."""


def keep_previous_study_model(path: Path, *, new_study: str) -> Path | None:
    """A final model of ANOTHER study already at `path` (this state folder took part in an
    earlier study) is moved beside it as `study-<its study SHA-256, 16 hex>.safetensors`
    rather than overwritten: `final.safetensors` is the latest study's, the earlier ones
    stay. Returns where it was kept (None: nothing to keep)."""
    if not path.exists():
        return None
    try:
        previous = study_sha256(read_bundle(path).study)
    except (OSError, MedfedError) as exc:
        log.warning("replacing %s, which is not a readable model bundle (%s)", path, exc)
        return None
    if previous == new_study:
        return None
    kept = path.with_name(f"study-{previous[:16]}.safetensors")
    os.replace(path, kept)
    log.info("kept the previous study's final model at %s", kept,
             extra={"event": "previous_final_model_kept", "path": str(kept)})
    return kept


class FinalModel:
    """Where the final model goes, and how large the study's model was announced."""

    def __init__(self, settings: SiteSettings, hook: TrainingHook, pin: StatisticsPin) -> None:
        self.settings = settings
        self.hook = hook
        self.pin = pin
        # (study SHA-256, parameters) of the study's model as its latest model round
        # announced them: bounds the final-model download (`limit`).
        self._announced: tuple[bytes, int] | None = None

    def announced(self, study: bytes, elements: int) -> None:
        """A model round of `study` announced a model of `elements` parameters."""
        self._announced = (study, elements)

    def limit(self, study: bytes) -> tuple[int, str]:
        """The most bytes `study`'s final bundle may have, and why: the announced model's
        float32 parameters plus the bundle's header margin (`bundle_size_limit`)."""
        elements = None
        if self._announced is not None and self._announced[0] == study:
            elements = self._announced[1]
        source = "the announced model"
        layout = getattr(self.hook, "layout", None)
        if elements is None and callable(layout):
            elements = sum(spec.elements for spec in layout())
            source = "the study's model"
        if elements is None:
            return MAX_BUNDLE_BYTES, "no model size known to this site"
        return bundle_size_limit(model_elements=elements), (
            f"{source}: {elements} float32 parameters, plus {HEADER_MARGIN_BYTES} bytes "
            "for the bundle's header"
        )

    def store(self, stub: pb_grpc.FederationStub, study: bytes) -> Path:
        """Download the finished study's final bundle to STATE/model/final.safetensors,
        after checking it is a bundle of `study` (its SHA-256), the study this site
        joined.

        Streamed to a temporary file, refused as soon as it runs past the announced
        model's size, verified, then renamed into place (`replace_durably`): a
        refused or broken download leaves the previous file and no temporary one."""
        limit, why = self.limit(study)
        folder = self.settings.state / "model"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "final.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as handle:
                written = 0
                for chunk in stub.DownloadFinalModel(
                    pb.DownloadFinalModelRequest(study_sha256=study), timeout=300
                ):
                    if chunk.offset != written:
                        raise ValidationError("final model chunks out of order")
                    if written + len(chunk.data) > limit:
                        raise ValidationError(
                            f"final model too large: more than {limit} bytes ({why})"
                        )
                    handle.write(chunk.data)
                    digest.update(chunk.data)
                    written += len(chunk.data)
                handle.flush()
                os.fsync(handle.fileno())
            bundle = bundle_from_bytes(tmp.read_bytes())  # verifies its own digest
            if bytes.fromhex(study_sha256(bundle.study)) != study:
                raise ValidationError("the final model belongs to another study")
            if not bundle.final:
                raise ValidationError("the coordinator's final model is not marked final")
            pinned = self.pin.pinned(study_sha256(bundle.study))
            if pinned is not None and bundle.statistics != pinned:
                raise ValidationError("the final model's statistics differ from the study's "
                                      "released statistics this site trained with")
            keep_previous_study_model(path, new_study=study_sha256(bundle.study))
            # The coordinator's file byte for byte (same SHA-256 at every site).
            replace_durably(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sha = digest.hexdigest()
        log.info("final model stored at %s (sha256 %s)", path, sha,
                 extra={"event": "final_model_stored", "path": str(path)})
        print(json.dumps({"event": "final_model", "path": str(path), "sha256": sha}),
              flush=True)
        return path
