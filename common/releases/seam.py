"""The release seam: one abstraction for a DP value a site releases under SecAgg+.

A release (`DpRelease`) is
  query       the site's exact integer vector, every privacy unit's contribution bounded;
  mechanism   the distributed discrete Gaussian on that vector (Kairouz, Liu & Steinke,
              "The Distributed Discrete Gaussian Mechanism for Federated Learning with
              Secure Aggregation", ICML 2021): each of n_noise honest sites adds
              N_Z(0, sigma^2 / n_noise), so the secure sum carries sigma per entry
              (`NoisePlan`, `common.privacy.ddgauss`);
  purpose     its ledger purpose (`Purpose`);
  encode      its values in the masked vector: one signed-integer segment named after it
              (`common.releases.egress`);
  decode      what the coordinator makes of the noisy sum;
  accounting  `plan(n_noise)`: sigma, the sensitivities and the ledger's mechanism record;
              a vector of several blocks, each with its own sigma (a query's statistics),
              gives one plan per block (`plans(n_noise)`), all in one ledger entry.

Both services and the ledger handle a release through this module alone: the site
writes `plan(...).mechanism()` on its ledger under `purpose` before anything leaves
(write-ahead), adds `plan(...).noise(rng)` from `common.crypto.random`, and encodes with
`encode`; the coordinator reads the sum with `read_sum`. A release that runs as a round
of its own names its round kind (`ReleaseKind.round_kind`); the study's statistics
(`common.releases.plugins.statistics`) are one. The evaluation histogram
(`common.releases.plugins.evaluation_histogram`) rides in every model round's vector
instead.

A new release is one module in `common/releases/plugins/` that subclasses `DpRelease` and
calls `register_release` when imported: `load_releases` imports every module of that
folder (found by file name, as `common.models.registry` finds networks), so both
services and the egress docs know it without a list to edit (docs/privacy.md, "Adding a
DP release").
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from common.core.errors import ValidationError
from common.core.plugins import PluginFolder
from common.privacy.ddgauss import count_noise, count_site_sigma
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.privacy.purpose import PURPOSES, ROUND_PURPOSES, Purpose
from common.privacy.signed import QueryRef
from common.protocol.secagg.params import round_floor
from common.releases import egress
from common.releases.egress import (
    EgressManifest,
    Protection,
    SegmentKind,
    VectorSegment,
    register_segment_kind,
)
from common.study import Study

__all__ = [
    "KIND_HOSPITAL",
    "KIND_RELEASE",
    "KIND_STATISTICS",
    "KIND_TRAINING",
    "PLUGINS",
    "PURPOSES",
    "ROUND_KINDS",
    "ROUND_PURPOSES",
    "DecodedSum",
    "DpRelease",
    "NoisePlan",
    "Purpose",
    "ReleaseKind",
    "build_release",
    "check_plans",
    "load_releases",
    "planned_noise_sites",
    "read_sum",
    "register_release",
    "release_for_round",
    "release_kind",
    "study_noise_sites",
    "sum_noise_sigmas",
]

KIND_TRAINING: Final = "training"
"""A round of model updates (DP-SGD at each site)."""
KIND_STATISTICS: Final = "statistics"
"""The study's once-per-study DP statistics release (`common.releases.statistics`)."""
KIND_HOSPITAL: Final = "hospital"
"""A round of model updates under hospital-level DP (clip = the update clip norm S)."""
KIND_RELEASE: Final = "release"
"""The round kind of a release run as a round of its own (`ReleaseKind.round_kind`),
named on the wire by the announcement's `release`."""
ROUND_KINDS: Final = (KIND_TRAINING, KIND_STATISTICS, KIND_HOSPITAL, KIND_RELEASE)
"""Every kind a round announcement may name."""

PLUGINS: Final = "common.releases.plugins"
"""The package whose every module registers one release when imported (`load_releases`)."""


@dataclass(frozen=True)
class NoisePlan:
    """The distributed discrete Gaussian on an integer vector of `length` entries:
    `sigma` of the summed noise per entry, split over `n_noise` honest sites (each adds
    N_Z(0, sigma^2 / n_noise); KLS21 Prop. 14). Adding or removing one privacy unit
    moves the vector by at most `l2_sensitivity` in L2 and `l1_sensitivity` in L1."""

    sigma: float
    n_noise: int
    length: int
    l2_sensitivity: float
    l1_sensitivity: float

    @property
    def site_sigma(self) -> float:
        return count_site_sigma(sigma=self.sigma, n_noise=self.n_noise)

    def mechanism(self) -> DistributedDiscreteGaussian:
        """What the site's ledger records for this release."""
        return DistributedDiscreteGaussian(
            noise_variance_per_site=self.site_sigma**2,
            contributors=self.n_noise,
            l2_sensitivity=self.l2_sensitivity,
            dimension=self.length,
            l1_sensitivity=self.l1_sensitivity,
        )

    def noise(self, rng: Callable[[int], bytes]) -> np.ndarray:
        """This site's share of the noise (int64, `length` entries), from `rng` (a
        CSPRNG in production: `common.crypto.random.system_random`)."""
        return count_noise(self.length, sigma=self.sigma, n_noise=self.n_noise, rng=rng)


class DpRelease(ABC):
    """One concrete release (a query with its parameters bound): see the module
    docstring. Subclasses set `name` (the registered release and its masked-vector
    segment) and `purpose`, and implement `length`, `query` and `plan`; `decode`
    defaults to the noisy signed sum itself."""

    name: ClassVar[str]
    purpose: ClassVar[Purpose]

    @property
    @abstractmethod
    def length(self) -> int:
        """Entries of the released vector."""

    @abstractmethod
    def query(self, site: Any) -> np.ndarray:
        """The site's exact int64 vector of `length` entries, each privacy unit's
        contribution within the sensitivities `plan` declares. `site`: what the site
        holds for it (its training plan: the study table, its unit count, ...)."""

    @abstractmethod
    def plan(self, *, n_noise: int) -> NoisePlan:
        """The noise and its ledger record when `n_noise` honest sites add noise."""

    def plans(self, *, n_noise: int) -> list[NoisePlan]:
        """The vector's blocks in order, each with its own noise: one plan per block,
        their lengths adding up to `length`, each one mechanism of the release's one
        ledger entry (sequential composition). By default one block: `plan`."""
        return [self.plan(n_noise=n_noise)]

    def ledger_query(self) -> QueryRef | None:
        """What a "query" ledger entry names (`Purpose.QUERY` releases); None for every
        other purpose."""
        return None

    def decode(self, total: np.ndarray, *, noise_sigma: float, round_number: int,
               contributors: int) -> Any:
        """What the coordinator keeps of the signed noisy sum `total` (`noise_sigma`
        per entry, `contributors` sites, round `round_number`): by default the sum."""
        del noise_sigma, round_number, contributors
        return total

    def decode_blocks(self, total: np.ndarray, *, noise_sigmas: Sequence[float],
                      round_number: int, contributors: int) -> Any:
        """`decode` with each block's noise std (`plans`' order): a release of several
        blocks overrides this; one of one block decodes with its one sigma."""
        if len(noise_sigmas) != 1:
            raise ValidationError(
                f"release {self.name!r}: {len(noise_sigmas)} noise blocks; override "
                "decode_blocks to decode them")
        return self.decode(total, noise_sigma=noise_sigmas[0], round_number=round_number,
                           contributors=contributors)

    def to_json(self, decoded: Any) -> Any:
        """`decode`'s value as JSON data, as the coordinator keeps it by default
        (STATE/releases/<name>-round-<n>.json): a sum becomes a list of integers."""
        if isinstance(decoded, np.ndarray):
            return [int(v) for v in decoded.reshape(-1)]
        return decoded

    def encode(self, noisy: np.ndarray) -> dict[str, np.ndarray]:
        """The masked-vector values of this release (`EgressManifest.encode`)."""
        vector = np.asarray(noisy)
        if vector.shape != (self.length,):
            raise ValidationError(
                f"release {self.name!r}: {vector.size} values, expected {self.length}")
        return {self.name: vector}

    def manifest(self) -> EgressManifest:
        """The masked vector of a round that carries this release alone."""
        return EgressManifest((VectorSegment(self.name, self.length),))


@dataclass(frozen=True)
class ReleaseKind:
    """A registered release: how to build it for a study, and what the egress manifest
    says about its segment."""

    name: str
    purpose: Purpose
    mechanism: str
    """What makes it DP, for the egress manifest (cite the paper)."""
    description: str
    """What it is, for the egress manifest."""
    build: Callable[[Study], DpRelease] | None = None
    """The release for one study, for a round that carries it alone (None: it rides in
    another round, which builds it)."""
    build_payload: Callable[[Study, bytes], DpRelease] | None = None
    """Instead of `build`: the release for one study and the exact bytes its round's
    announcement carries (`Announcement.release_payload`, bound into the digest), such
    as an approved query; it validates them (ValidationError)."""
    round_kind: str = ""
    """The round kind that carries it alone: `KIND_RELEASE` (the announcement names it),
    "statistics" for the study's statistics, "" when it rides in another round."""
    once_per_study: bool = False
    """Released once per study, ever: a site pins what it released and refuses a second
    round of it (the study's statistics: `site_agent.statistics_pin`)."""


RELEASES: Final[dict[str, ReleaseKind]] = {}


def register_release(kind: ReleaseKind) -> ReleaseKind:
    """Add a release (idempotent for an identical one) and its masked-vector segment:
    signed integers, protected by DP under its ledger purpose. The plug-ins are loaded
    first, so a release clashing with one of them is refused whichever came first."""
    load_releases()
    if not isinstance(kind.purpose, Purpose):
        raise ValidationError(f"release {kind.name!r}: unknown ledger purpose {kind.purpose!r}")
    existing = RELEASES.get(kind.name)
    if existing is not None and existing != kind:
        raise ValidationError(f"release {kind.name!r} registered twice, differently")
    if kind.round_kind and kind.round_kind != KIND_RELEASE and any(
        other.round_kind == kind.round_kind and other.name != kind.name
        for other in RELEASES.values()
    ):
        raise ValidationError(f"round kind {kind.round_kind!r} already carries a release")
    if kind.round_kind and (kind.build is None) == (kind.build_payload is None):
        raise ValidationError(f"release {kind.name!r}: a round of its own builds it from the "
                              "study (build), or from the study and its payload (build_payload)")
    if kind.build_payload is not None and kind.round_kind != KIND_RELEASE:
        raise ValidationError(f"release {kind.name!r}: only a release round carries a payload")
    register_segment_kind(SegmentKind(
        kind.name, "integer", Protection.DP, kind.mechanism, kind.purpose.value,
        kind.description,
    ))
    RELEASES[kind.name] = kind
    return kind


_PLUGIN_FOLDER: Final = PluginFolder(PLUGINS, Path(__file__).parent / "plugins")


def load_releases() -> tuple[str, ...]:
    """Import every module of `PLUGINS` (names starting with ``_`` are helpers), each of
    which registers its release; their names, in the order loaded. Once per process."""
    return _PLUGIN_FOLDER.load()


def release_kind(name: str) -> ReleaseKind:
    """The registered release `name` (ValidationError when there is none)."""
    if name not in RELEASES:
        load_releases()
    kind = RELEASES.get(name)
    if kind is None:
        raise ValidationError(f"no DP release named {name!r} is registered")
    return kind


def release_for_round(round_kind: str, name: str = "") -> ReleaseKind | None:
    """The release a round of `round_kind` carries alone, `name` for a `KIND_RELEASE`
    round (None: a model round, or a name registered for no round of its own)."""
    load_releases()
    if round_kind == KIND_RELEASE:
        kind = RELEASES.get(name)
        return kind if kind is not None and kind.round_kind == KIND_RELEASE else None
    for kind in RELEASES.values():
        if kind.round_kind and kind.round_kind == round_kind:
            return kind
    return None


def build_release(kind: ReleaseKind, study: Study, payload: bytes = b"") -> DpRelease:
    """The release of `kind` for `study` (and the payload its round announced)."""
    if kind.build_payload is not None:
        if not payload:
            raise ValidationError(f"a {kind.name} round carries its payload; none announced")
        return kind.build_payload(study, payload)
    if payload:
        raise ValidationError(f"a {kind.name} round carries no payload")
    if kind.build is None:
        raise ValidationError(f"release {kind.name!r} is not a round of its own")
    return kind.build(study)


def check_plans(release: DpRelease, plans: Sequence[NoisePlan]) -> list[NoisePlan]:
    """`plans` as a list, refused unless there is one and their blocks cover the
    release's `length` exactly (a plan of the wrong size would mis-noise the vector)."""
    plans = list(plans)
    if not plans or sum(p.length for p in plans) != release.length:
        raise ValidationError(
            f"release {release.name!r}: noise blocks of {[p.length for p in plans]} entries "
            f"do not cover its {release.length}")
    return plans


def planned_noise_sites(*, min_round_sites: int, max_colluding_sites: int) -> int:
    """n_noise every member plans a round release for: the round floor
    max(min_round_sites, T + 2) minus the T colluding sites (who know their own noise),
    at least 1. The study pins both terms, so every member and the coordinator compute
    the same number; it does not depend on how many sites end up in the sum."""
    floor = round_floor(min_round_sites=min_round_sites, max_colluding_sites=max_colluding_sites)
    return max(floor - max_colluding_sites, 1)


def study_noise_sites(study: Study) -> int:
    """`planned_noise_sites` of a study's pinned terms."""
    return planned_noise_sites(min_round_sites=study.privacy.min_round_sites,
                               max_colluding_sites=study.privacy.max_colluding_sites)


def sum_noise_sigmas(release: DpRelease, *, contributors: int, noise_sites: int) -> list[float]:
    """Std of the noise on each entry of each block (`DpRelease.plans`) of the secure
    sum of `contributors` releases: every site planned for `noise_sites` honest shares
    (`planned_noise_sites`) and added N_Z(0, sigma^2 / noise_sites), so the sum of K
    carries sigma^2 * K / noise_sites (more than sigma^2 when more sites than the floor
    contributed, less when dropouts left fewer)."""
    k = max(contributors, 1)
    plans = check_plans(release, release.plans(n_noise=max(noise_sites, 1)))
    return [plan.sigma * math.sqrt(k / plan.n_noise) for plan in plans]


@dataclass(frozen=True)
class DecodedSum:
    """What the coordinator reads of a release's round (`read_sum`): the signed noisy
    sum of `contributors` sites, each block's noise std on it, and the release's
    decoding of the two."""

    total: np.ndarray
    noise_sigmas: list[float]
    contributors: int
    value: Any


def read_sum(
    release: DpRelease, aggregate: np.ndarray, *, contributors: int, noise_sites: int,
    round_number: int,
) -> DecodedSum:
    """The coordinator's side of a release: its segment of the unmasked ring sum, read
    as signed integers (`EgressManifest.decode_integers`), then `release.decode_blocks`
    with each block's noise std."""
    total = release.manifest().decode_integers(aggregate)[release.name]
    sigmas = sum_noise_sigmas(release, contributors=contributors, noise_sites=noise_sites)
    value = release.decode_blocks(total, noise_sigmas=sigmas, round_number=round_number,
                                  contributors=contributors)
    return DecodedSum(total=total, noise_sigmas=sigmas, contributors=contributors, value=value)


def docs_section() -> str:
    """The egress tables of docs/privacy.md, every registered release's segment included
    (each release module registers its segment when imported: all of them are loaded
    first)."""
    load_releases()
    return f"{egress.DOCS_BEGIN}\n{egress.render_markdown()}{egress.DOCS_END}\n"


if __name__ == "__main__":  # pragma: no cover - documentation helper
    # The release modules register into `common.releases.seam`, not this __main__ copy.
    from common.releases.seam import docs_section as registered_docs_section

    print(registered_docs_section(), end="")
