"""Record/patient-level DP-SGD underneath hospital-level DP: what a
ledger holding both kinds of training mechanism has spent.

With `privacy.record_level` set in a hospital-level study, each training round runs
Opacus DP-SGD on the site's records (sampled Gaussian segments), then clips the whole
update to S and adds the site's distributed discrete Gaussian share (Kairouz, Liu &
Steinke, ICML 2021). The ledger entry of such a round holds both. Two guarantees:

* hospital-level (model updates only): the DDGauss rounds composed alone
  (`common.privacy.hospital.hospital_level_epsilon`); DP-SGD says nothing about a whole
  hospital.
* record/patient-level: the better of two valid compositions of the per-record history,
  which is what the site's budget is charged with:

  A. the DP-SGD path: what leaves after DP-SGD is a post-processing of DP-SGD's output
     (clipping, rounding and noise never look at the data again), so each layered round
     costs its DP-SGD segments alone, composed with the rest of the history (statistics,
     count, evaluation, and any round without DP-SGD beneath by its DDGauss bound below);
  B. the hospital path: a record or patient lives inside one hospital, so the DDGauss
     round bounds it too. Adding or removing a record leaves the hospital in the round
     and changes its clipped update u to u', ||u - u'|| <= 2S: the REPLACE relation, twice
     the add/remove sensitivity (`replaced`). Composed with the same rest.

  Each is an upper bound on the same per-record privacy loss, so the smaller one holds
  (Dwork & Roth 2014, Prop. 2.1 for post-processing; neighbouring inclusion for B).

A ledger without a layered round (no DP-SGD beneath any DDGauss round) has one
per-patient figure, path B alone (`record_level`: both paths coincide), the DDGauss
rounds at 2S: the one per-patient function the ledger, the CLI, the model card and the
demo report share. What it is CHARGED with is the ledger's term `charge`
(`common.privacy.signed.CHARGES`): a hospital-unit ledger created with
`charge = "record_level"` is charged that per-patient figure, so its budget bounds every
patient; a ledger without the term (every ledger written before it) keeps its whole
history composed at the add/remove sensitivity S, so its stored epsilons still
recompose exactly.

A layered ledger is charged with the LARGER of two figures, so that its budget bounds
both guarantees the study makes: the record/patient-level epsilon above, and the
unit-level one (`unit_level`: every release, each layered round by its DDGauss at S,
add/remove one hospital: what a ledger without DP-SGD beneath is charged with). Charging
the record-level figure alone left the hospital-level rounds uncapped: once DP-SGD was the
cheaper path, a coordinator could announce hospital rounds beyond the study's and the
budget never refused one (found by review, session 5;
tests/privacy/test_attack_layered_hospital_uncapped.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from common.core.errors import ConfigError
from common.privacy.accountant import EpsilonReport, account
from common.privacy.mechanisms import DistributedDiscreteGaussian, Mechanism, Segment
from common.privacy.purpose import Purpose
from common.privacy.signed import CHARGE_RECORD_LEVEL, CHARGE_UNIT, CHARGES

PURPOSE_TRAINING = Purpose.TRAINING
PurposeMechanisms = tuple[str, Sequence[Mechanism]]


def is_update(purpose: str, mechanism: Mechanism) -> bool:
    """A hospital-level model-update round (a DDGauss mechanism of a training entry);
    statistics and evaluation are DDGauss releases too, but not of the model."""
    return purpose == PURPOSE_TRAINING and isinstance(mechanism, DistributedDiscreteGaussian)


def layered_entry(purpose: str, mechanisms: Sequence[Mechanism]) -> bool:
    """A training entry with DP-SGD segments AND a hospital-level DDGauss round."""
    return any(isinstance(m, Segment) for m in mechanisms) and any(
        is_update(purpose, m) for m in mechanisms
    )


def is_layered(entries: Sequence[PurposeMechanisms]) -> bool:
    return any(layered_entry(purpose, ms) for purpose, ms in entries)


def replaced(mechanism: DistributedDiscreteGaussian) -> DistributedDiscreteGaussian:
    """The same release under the replace-one-update relation: sensitivities doubled
    (what one record added or removed inside a hospital that stays in the round moves)."""
    return dataclasses.replace(
        mechanism,
        l2_sensitivity=2.0 * mechanism.l2_sensitivity,
        l1_sensitivity=2.0 * mechanism.effective_l1_sensitivity,
    )


def dpsgd_path(entries: Sequence[PurposeMechanisms]) -> list[Mechanism]:
    """Path A: each layered round's DP-SGD segments (its DDGauss is post-processing);
    a DDGauss round without DP-SGD beneath by its replace-relation bound; the rest as is."""
    out: list[Mechanism] = []
    for purpose, mechanisms in entries:
        layered = layered_entry(purpose, mechanisms)
        for m in mechanisms:
            if isinstance(m, DistributedDiscreteGaussian) and purpose == PURPOSE_TRAINING:
                if not layered:
                    out.append(replaced(m))
            else:
                out.append(m)
    return out


def hospital_path(entries: Sequence[PurposeMechanisms]) -> list[Mechanism]:
    """Path B: each layered round by its DDGauss bound (replace relation) alone, its
    DP-SGD segments dropped; every other mechanism as is."""
    out: list[Mechanism] = []
    for purpose, mechanisms in entries:
        layered = layered_entry(purpose, mechanisms)
        for m in mechanisms:
            if isinstance(m, DistributedDiscreteGaussian) and purpose == PURPOSE_TRAINING:
                out.append(replaced(m))
            elif not (layered and isinstance(m, Segment)):
                out.append(m)
    return out


def unit_level(entries: Sequence[PurposeMechanisms]) -> list[Mechanism]:
    """The unit-level history (add/remove one hospital, or one intermediary): every
    release, each layered round by its DDGauss round at S alone. Its DP-SGD segments bound
    records, not a unit; the released update is the DDGauss mechanism's output whatever
    trained it, so at the unit level they add no cost (and no protection)."""
    out: list[Mechanism] = []
    for purpose, mechanisms in entries:
        layered = layered_entry(purpose, mechanisms)
        out.extend(m for m in mechanisms if not (layered and isinstance(m, Segment)))
    return out


@dataclass(frozen=True)
class RecordLevel:
    """The record/patient-level epsilon of a hospital-mode history and both paths to it."""

    epsilon: float
    dpsgd_path: float
    hospital_path: float
    accountant_used: str


def record_level(
    entries: Sequence[PurposeMechanisms], *, delta: float, accountant: str
) -> RecordLevel:
    """The per-patient (per-record with `record_level = "record"`) epsilon of a hospital-mode
    history: the better of paths A and B. Without DP-SGD beneath any round both paths are
    the same composition, every DDGauss training round at the replace relation (2S: a
    patient added or removed inside a unit that stays in the round) with every
    other release, so it is computed once; that figure exceeds the
    add/remove composition (`charged` of a ledger without `charge = "record_level"`),
    and is the honest per-patient figure."""
    b = account(hospital_path(entries), delta=delta, accountant=accountant)
    if not is_layered(entries):
        return RecordLevel(b.epsilon, b.epsilon, b.epsilon, b.accountant)
    a = account(dpsgd_path(entries), delta=delta, accountant=accountant)
    best = a if a.epsilon <= b.epsilon else b
    return RecordLevel(best.epsilon, a.epsilon, b.epsilon, best.accountant)


def charged(
    entries: Sequence[PurposeMechanisms], *, delta: float, accountant: str,
    charge: str = CHARGE_UNIT,
) -> EpsilonReport:
    """What a ledger charges its budget with after `entries`, by its terms' `charge`. A
    pure function of the history and the terms, so verify recomposes it exactly.

    * `CHARGE_RECORD_LEVEL` (hospital-unit ledgers created with it): the per-record/
      per-patient figure. Without DP-SGD beneath, path B (`hospital_path`: every DDGauss
      training round at the replace relation 2S, composed with every other release); it
      dominates the add/remove composition at S (same releases, each round's sensitivity
      doubled; RDP is increasing in the sensitivity), so the budget caps the per-patient
      guarantee and, with it, the one per unit. The study plans z for it
      (`common.study.hospital_terms.study_terms`).
    * `CHARGE_UNIT` (the default, every ledger written before the field existed): the
      whole history composed (`account`, each DDGauss round at its add/remove
      sensitivity S). For a hospital-unit ledger that is the unit-level figure, NOT the
      per-patient one (`record_level`, at 2S), which it understates.

    Either way a layered history (DP-SGD beneath) is charged the larger of the
    record/patient-level epsilon (the better of the two paths) and the unit-level one
    (`unit_level`), so the budget caps both."""
    if charge not in CHARGES:
        raise ConfigError("charge", f"must be one of {CHARGES}, got {charge!r}")
    if not is_layered(entries):
        if charge == CHARGE_RECORD_LEVEL:
            return account(hospital_path(entries), delta=delta, accountant=accountant)
        return account([m for _, ms in entries for m in ms], delta=delta, accountant=accountant)
    a = account(dpsgd_path(entries), delta=delta, accountant=accountant)
    b = account(hospital_path(entries), delta=delta, accountant=accountant)
    record = a if a.epsilon <= b.epsilon else b
    unit = account(unit_level(entries), delta=delta, accountant=accountant)
    return record if record.epsilon >= unit.epsilon else unit


def charged_by_purpose(
    entries: Sequence[PurposeMechanisms], *, delta: float, accountant: str,
    charge: str = CHARGE_UNIT,
) -> dict[str, float]:
    """What is spent on what: each purpose's entries composed ALONE and charged as the
    ledger charges them (`charged`), by purpose name. They do not add up to the whole
    history's charge, which composes everything (`medfed ledger show`, the demo's
    report)."""
    grouped: dict[str, list[PurposeMechanisms]] = {}
    for purpose, mechanisms in entries:
        grouped.setdefault(purpose, []).append((purpose, mechanisms))
    return {purpose: charged(pairs, delta=delta, accountant=accountant, charge=charge).epsilon
            for purpose, pairs in sorted(grouped.items())}
