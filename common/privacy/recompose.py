"""Recompose a ledger's recorded epsilons from its mechanisms (both ledger formats).

Shared by `common.privacy.migrate` (format 1) and `common.privacy.ledger` (format 2), so
the check that catches an epsilon edited under recomputed hashes or signatures is one
piece of code. It lives apart from both because the format-2 module imports the format-1
module (to migrate), never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.privacy.layered import charged
from common.privacy.mechanisms import Mechanism
from common.privacy.purpose import Purpose
from common.privacy.signed import CHARGE_UNIT

__all__ = ["RecordedSpend", "recompose_mismatches"]


@dataclass(frozen=True)
class RecordedSpend:
    """What one ledger entry records: its mechanisms and the composed spend after it."""

    seq: int
    mechanisms: Sequence[Mechanism]
    epsilon_after: float
    accountant_used: str
    purpose: str = Purpose.TRAINING


def recompose_mismatches(
    entries: Iterable[RecordedSpend],
    *,
    delta: float,
    accountant: str,
    relative_tolerance: float,
    charge: str = CHARGE_UNIT,
) -> list[tuple[int, str]]:
    """(seq, message) for every entry whose recorded epsilon_after (or accountant) differs
    from the whole history up to it, composed again with the ledger's accountant and
    charge (`common.privacy.signed.CHARGES`).

    `relative_tolerance` allows for FFT round-off across machines and numpy versions.
    """
    mismatches: list[tuple[int, str]] = []
    history: list[tuple[str, Sequence[Mechanism]]] = []
    for entry in entries:
        history.append((entry.purpose, entry.mechanisms))
        # The ledger's own charge (common.privacy.layered): the whole history, or the
        # larger of the record-level and hospital-level figures when DP-SGD ran beneath
        # hospital-level DP.
        report = charged(history, delta=delta, accountant=accountant, charge=charge)
        if not math.isclose(report.epsilon, entry.epsilon_after, rel_tol=relative_tolerance):
            mismatches.append(
                (
                    entry.seq,
                    f"epsilon_after {entry.epsilon_after!r} differs from the recomposed "
                    f"{report.epsilon!r}",
                )
            )
        elif report.accountant != entry.accountant_used:
            mismatches.append((entry.seq, "accountant_used differs from the recomputed one"))
    return mismatches
