"""An approved query as a DP release of its own round (`common.releases.seam`).

The round's announcement carries the query's exact canonical bytes
(`Announcement.release_payload`, bound into the announcement digest): every site
parses them, checks they are canonical (so their SHA-256 is the one it approved with
`medfed site approve`), builds the same vector layout from the study it joined, and
releases one block per statistic, each with its own noise (`block_plans`: the
distributed discrete Gaussian of Kairouz, Liu & Steinke, ICML 2021, each statistic at
its own epsilon), in ONE ledger entry of purpose "query" naming the query (name and
SHA-256). The coordinator decodes the noisy sum into the answer with its uncertainty
(`answer_query`); it learns nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from common.core.errors import ValidationError
from common.privacy.purpose import Purpose
from common.privacy.signed import QueryRef
from common.releases.analytics.answer import answer_query
from common.releases.analytics.query import Query, query_from_bytes, query_sha256
from common.releases.analytics.vector import block_plans, query_length, site_vector
from common.releases.seam import KIND_RELEASE, DpRelease, NoisePlan, ReleaseKind, register_release
from common.study import Study

QUERY_RELEASE: Final = "query"
"""The registered release (and masked-vector segment) of a query round."""


def query_from_payload(payload: bytes, *, study: Study) -> Query:
    """The query an announcement carries: canonical bytes (so that their SHA-256 is the
    one a site approved) of a query written for `study`; ValidationError otherwise."""
    try:
        return query_from_bytes(payload, study=study)
    except ValidationError as exc:
        raise ValidationError(f"the announced query is refused: {exc}") from None


class QueryRelease(DpRelease):
    """One approved query on one study: its vector (`site_vector`), one noise block per
    statistic (`block_plans`), its answer (`answer_query`)."""

    name = QUERY_RELEASE
    purpose = Purpose.QUERY

    def __init__(self, study: Study, query: Query) -> None:
        self.study = study
        self.query_def = query
        self.sha256 = query_sha256(query)

    @classmethod
    def from_payload(cls, study: Study, payload: bytes) -> QueryRelease:
        release = cls(study, query_from_payload(payload, study=study))
        if release.sha256 != hashlib.sha256(payload).hexdigest():
            raise ValidationError("the announced query's SHA-256 is not that of its bytes")
        return release

    @property
    def length(self) -> int:
        return int(query_length(self.query_def, study=self.study))

    def query(self, site: Any) -> np.ndarray:
        """The site's exact vector over every row of its file (`site.table`: the study
        table the site loaded when it joined)."""
        table = site.table  # site_agent.site_training.TrainingHook.table
        if table is None:
            raise ValidationError("this site holds no study table to answer a query on")
        vector = np.asarray(site_vector(self.query_def, table, study=self.study),
                            dtype=np.int64)
        if vector.shape != (self.length,):
            raise ValidationError(
                f"query {self.query_def.name!r}: the site's vector has {vector.size} values, "
                f"expected {self.length}")
        return vector

    def plans(self, *, n_noise: int) -> list[NoisePlan]:
        return list(block_plans(self.query_def, study=self.study, n_noise=n_noise))

    def plan(self, *, n_noise: int) -> NoisePlan:
        plans = self.plans(n_noise=n_noise)
        if len(plans) != 1:
            raise ValidationError(f"query {self.query_def.name!r} has {len(plans)} noise "
                                  "blocks: use plans()")
        return plans[0]

    def ledger_query(self) -> QueryRef:
        return QueryRef(name=self.query_def.name, sha256=self.sha256)

    def decode_blocks(self, total: np.ndarray, *, noise_sigmas: Sequence[float],
                      round_number: int, contributors: int) -> Any:
        del round_number
        return answer_query(self.query_def, np.asarray(total, dtype=np.int64),
                            study=self.study, noise_sigmas=list(noise_sigmas),
                            contributors=contributors)

    def to_json(self, decoded: Any) -> Any:
        return decoded.to_json()


QUERY_KIND: Final = register_release(ReleaseKind(
    name=QUERY_RELEASE, purpose=Purpose.QUERY, build_payload=QueryRelease.from_payload,
    round_kind=KIND_RELEASE,
    mechanism="distributed discrete Gaussian per statistic (Kairouz, Liu & Steinke 2021), "
    "each at its approved epsilon",
    description="an approved analytics query: counts and clipped sums per statistic",
))
