"""Hospital-level DP with intermediaries (Jiang et al., MICCAI 2023): a hospital's patients
dealt into v disjoint units by a keyed hash of each id alone (`assign_intermediaries`),
each unit trained from the global model on its own patients (`train_intermediaries`).

Why a hash and not a shuffle: the per-patient figure charges a patient 2S per round
(common.privacy.layered `replaced`), which holds only if adding or removing one patient
moves its own unit and no other; a permutation of all patients reshuffles nearly
everyone when one is added (up to 2 v S).
"""

from __future__ import annotations

import dataclasses as dc
import hashlib
import hmac
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from common.rounds.announcement import RoundPlan
from site_agent.training_plan import fit_batch_size
from site_agent.unit_split import canonical_unit_id, unit_ids

if TYPE_CHECKING:
    from common.study import Study
    from site_agent.training_config import TrainingConfig

INTERMEDIARY_DOMAIN = b"medfed/v1/intermediary"


def intermediary_key(site_key: bytes) -> bytes:
    """The BLAKE2b key of the patient -> intermediary hash: HMAC-SHA256 of the domain
    under the site's split key (`unit_split.site_split_key`: secret to the site, fixed
    in its state folder, so groups stay stable across rounds and restarts)."""
    return hmac.new(site_key, INTERMEDIARY_DOMAIN, hashlib.sha256).digest()


def assign_intermediaries(keys: np.ndarray, *, v: int, site_key: bytes) -> list[np.ndarray]:
    """Record indices of each of v intermediaries, given one unit id per record (a
    patient id, or `record_unit_keys`): every record of a unit in the group
    `intermediary_of` gives its id. A site with fewer units than v gets some empty
    groups (each a zero update, `train_intermediaries`), never an error: how many
    patients a site holds must not decide whether it can take part in a round."""
    unique, inverse = np.unique(np.asarray(keys), return_inverse=True)
    key = intermediary_key(site_key)
    group_of_unit = np.fromiter((intermediary_of(u, key=key, v=v) for u in unique),
                                dtype=np.int64, count=unique.size)
    group = group_of_unit[inverse.reshape(-1)]
    return [np.flatnonzero(group == k) for k in range(v)]


def intermediary_of(unit: object, *, key: bytes, v: int) -> int:
    """The intermediary (0..v-1) of one patient: BLAKE2b-64 of its id under `key`, mod v.
    A function of the id alone, so one patient added or removed changes only its own
    unit (the 2S per-patient bound; `unit_groups`)."""
    digest = hashlib.blake2b(canonical_unit_id(unit), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % v


def intermediaries_for(
    study: Study | None, plan: RoundPlan, *, hospital: bool, released_units: int | None
) -> int:
    """v a hospital trains in `plan`'s round: the study's fixed v, or under "auto" the
    announced v, lowered to what the site's DP patient count splits into groups of
    `MIN_PATIENTS_PER_INTERMEDIARY` (post-processing of that release: the choice,
    visible in the summed weight, reveals nothing new). 1 outside hospital mode."""
    if study is None or not hospital:
        return 1
    if isinstance(study.privacy.intermediaries, int):
        return study.privacy.intermediaries
    from common.privacy.hospital import MIN_PATIENTS_PER_INTERMEDIARY

    v = max(plan.intermediaries, 1)
    if released_units is not None:
        v = min(v, max(released_units // MIN_PATIENTS_PER_INTERMEDIARY, 1))
    return v


def unit_groups(data: Any, *, v: int, site_key: bytes) -> list[np.ndarray]:
    """Record indices of v disjoint intermediaries of `data`: whole patients (without a
    patient column each record, keyed by its content: `record_unit_keys`), each in the
    group a keyed hash of its id alone gives (`intermediary_of`), fixed for the study by
    the site's split key. A group may come out empty (rare at >=
    `MIN_PATIENTS_PER_INTERMEDIARY` patients per unit): `train_intermediaries` then
    sends a zero update for it."""
    return assign_intermediaries(unit_ids(data), v=v, site_key=site_key)


def train_intermediaries(
    groups: list[np.ndarray],
    *,
    data: Any,
    model_factory: Callable[[], Any],
    base_config: TrainingConfig,
    requested_batch_size: int,
    plan: RoundPlan,
    global_flat: np.ndarray,
) -> tuple[list[np.ndarray], list[float], int]:
    """(one delta per unit, the units' mean losses, records trained on): each unit of
    `groups` trains from the global model on its own records, with `base_config` and a
    batch fitted to its size; the agent clips and rounds each delta alone
    (site_agent.hospital)."""
    from site_agent.trainer import LocalTrainer

    deltas: list[np.ndarray] = []
    losses: list[float] = []
    records = 0
    for index in groups:
        if index.size == 0:
            # An empty intermediary (`unit_groups`) still counts as one unit: a zero
            # update (norm 0), so the weight stays v and reveals nothing about it.
            deltas.append(np.zeros_like(global_flat, dtype=np.float32))
            continue
        subset = data.subset(index)
        config = dc.replace(
            base_config, released_units=None,
            batch_size=fit_batch_size(requested_batch_size, units=len(subset)),
        )
        seed = int.from_bytes(os.urandom(8), "big") >> 1
        result = LocalTrainer(model_factory, subset, config, seed=seed).train_round(
            global_flat, local_epochs=plan.local_epochs, lr=plan.learning_rate,
            fedprox_mu=plan.fedprox_mu,
        )
        deltas.append(np.array(result.delta_flat, dtype=np.float32))
        if result.mean_loss is not None:
            losses.append(result.mean_loss)
        records += result.num_samples
    return deltas, losses, records
