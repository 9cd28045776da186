"""A hospital-level study's DP terms: the whole-update clip S, the noise multiplier z and
the intermediaries v that every member and the coordinator read from the study
(`common.privacy.hospital` holds the mechanism; this is what a study asks of it)."""

from __future__ import annotations

from common.core.errors import ConfigError
from common.privacy.hospital import (
    AUTO_START_INTERMEDIARIES,
    EVALUATION_RESERVE,
    MAX_AUTO_INTERMEDIARIES,
    PER_PATIENT_SENSITIVITY,
    HospitalTerms,
    plan_noise_multiplier,
)
from common.study.schema import Study


def study_terms(study: Study) -> HospitalTerms:
    """S and z of a hospital-level study. z defaults to the smallest noise for which the
    study's rounds of model updates cost at most privacy.epsilon minus the once-per-study
    statistics and count releases, less `EVALUATION_RESERVE` of that for evaluation
    (`plan_noise_multiplier`), at the relation its sites' ledgers charge: without DP-SGD
    beneath (`record_level = "none"`) the per-patient one, each round at 2S
    (`PER_PATIENT_SENSITIVITY`; `common.privacy.layered.charged`), so z is twice the
    add/remove-one-hospital plan; with DP-SGD beneath the per-patient figure is the
    DP-SGD path's and the rounds are planned at S (the unit-level figure the ledger
    also caps)."""
    privacy = study.privacy
    if privacy.unit != "hospital":
        raise ConfigError("privacy.unit", "hospital-level terms need unit = 'hospital'")
    if privacy.update_clip_norm is None:
        raise ConfigError(
            "privacy.update_clip_norm", "unit = 'hospital' needs the whole-update clip norm S"
        )
    z = privacy.update_noise_multiplier
    if z is None:
        left = privacy.epsilon - privacy.statistics_epsilon - privacy.count_epsilon
        if left <= 0:
            raise ConfigError(
                "privacy.epsilon", "leaves nothing for model updates after statistics and count"
            )
        z = plan_noise_multiplier(
            epsilon=left * (1 - EVALUATION_RESERVE), delta=privacy.delta,
            rounds=study.study.rounds,
            sensitivity=PER_PATIENT_SENSITIVITY if privacy.record_level == "none" else 1.0)
    # "auto" (the adaptive rule, common/privacy/intermediaries.py): v starts at
    # AUTO_START_INTERMEDIARIES and each round announces the next (`for_round`); the
    # units carry their clipped norms so the coordinator can evaluate the rule.
    fixed = privacy.intermediaries
    if isinstance(fixed, int):
        return HospitalTerms(clip=privacy.update_clip_norm, noise_multiplier=z,
                             intermediaries=fixed)
    return HospitalTerms(clip=privacy.update_clip_norm, noise_multiplier=z,
                         intermediaries=AUTO_START_INTERMEDIARIES, norm_segment=True)


def intermediaries_cap(study: Study) -> int | None:
    """The largest v a round of this study may announce: the fixed v itself, or
    `MAX_AUTO_INTERMEDIARIES` under "auto"; None when the study is not hospital-level."""
    if study.privacy.unit != "hospital":
        return None
    fixed = study.privacy.intermediaries
    return fixed if isinstance(fixed, int) else MAX_AUTO_INTERMEDIARIES
