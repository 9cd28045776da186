"""The purposes a ledger entry can name: one enum, used by the ledger, the site's
releases, the coordinator's replica readers and the egress manifest.

A `Purpose` is a `str` (StrEnum): an entry's signed JSON carries its value
("training", ...) exactly as before, and a purpose read back from a ledger compares
equal to its member.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class Purpose(StrEnum):
    """Why a site released a DP value (the ledger entry's `purpose`)."""

    TRAINING = "training"  # a model update (DP-SGD, or DDGauss under hospital-level DP)
    EVALUATION = "evaluation"  # the held-out score histogram of a model round
    STATISTICS = "statistics"  # the study's once-per-study preprocessing statistics
    COUNT = "count"  # the site's one DP cohort count (numbered on its own)
    QUERY = "query"  # an approved analytics query's answer (its entry names the query)


PURPOSES: Final = tuple(p.value for p in Purpose)
"""Every purpose a ledger accepts, as stored."""

ROUND_PURPOSES: Final = tuple(p for p in Purpose if p is not Purpose.COUNT)
"""Purposes released within a numbered round, every one but the cohort count (which has
its own numbering): a round number already on the ledger under one of these is never
released again."""
