"""A site's privacy policy against a study: what the site accepts (`SitePrivacyPolicy`,
built from its own config) and the check every site runs before it sends any key or
update (`check_study_against_policy`). The site's policy always wins."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from common.core.errors import ModelOutOfBounds, PrivacyError
from common.study.hospital_terms import intermediaries_cap
from common.study.schema import DEFAULT_MAX_ABS_WEIGHT, UNIT_STRENGTH, PrivacyUnit, Study


@dataclass(frozen=True)
class SitePrivacyPolicy:
    """What a site accepts; built from its own config (`SiteSettings.privacy` / `.policy`).

    ``unit``: the weakest privacy unit the site accepts. ``allowed_model_factories``:
    custom model factories this site is willing to import and run.
    """

    epsilon: float
    delta: float
    unit: PrivacyUnit = "record"
    max_epsilon_per_round: float | None = None
    allowed_model_factories: tuple[str, ...] = ()
    max_count_epsilon: float | None = None
    max_intermediaries: int | None = None
    """Hospital-level studies: the most intermediaries this site splits into (None: the
    protocol's own bound)."""
    max_evaluations: int | None = None
    """DP evaluations this site's ledger may record (its ``policy.max_evaluations``);
    None: no limit of its own (each evaluation is still charged to its budget)."""
    max_colluding_sites: int | None = None
    """The most colluding sites this site assumes (its ``policy.max_colluding_sites``): a
    study assuming fewer is refused. None: any."""
    min_round_sites: int | None = None
    """This site's round floor (``policy.min_round_sites``): a study whose floor
    max(min_round_sites, T + 2) is lower is refused. None: any."""
    min_evaluation_noise_std: float | None = None
    """The least noise std per summed evaluation count this site accepts (its
    ``privacy.evaluation_noise_std``): a study whose ``privacy.evaluation.noise_std`` is
    smaller is refused. None: the study's, whatever it is (each evaluation is still
    charged to the budget at the study's noise)."""


def study_round_terms(
    study: Study | None, *, max_colluding_sites: int, min_round_sites: int
) -> tuple[int, int]:
    """(T, min_round_sites) that size a round's distributed noise and floor: the study's
    when the site joined one (the same at every member; the site's own policy was
    checked against them at joining), else the site's own (`max_colluding_sites`,
    `min_round_sites`: its policy)."""
    if study is None:
        return max_colluding_sites, min_round_sites
    return study.privacy.max_colluding_sites, study.privacy.min_round_sites


ROUND_CAP_SLACK = 1e-9
"""Float slack of a per-round cap comparison (compositions are deterministic)."""


def per_round_cap(study: Study | None, *, site_cap: float | None) -> tuple[float | None, str]:
    """The most epsilon one round may add to a site's ledger, and where it comes from:
    the smaller of the site's ``policy.max_epsilon_per_round`` (`site_cap`) and the
    study's ``privacy.max_epsilon_per_round``, whichever are set; (None, "") when
    neither is. Measured as the composed increase of the ledger
    (`common.privacy.accountant.epsilon_added`)."""
    caps = ([] if site_cap is None
            else [(site_cap, "this site's policy.max_epsilon_per_round")])
    if study is not None and study.privacy.max_epsilon_per_round is not None:
        caps.append((study.privacy.max_epsilon_per_round,
                     "the study's privacy.max_epsilon_per_round"))
    if not caps:
        return None, ""
    cap, source = min(caps, key=lambda c: c[0])
    return cap, source


def check_study_against_policy(study: Study, policy: SitePrivacyPolicy) -> None:
    """Join only if the study's requests are at least as strict as the site's policy.

    Raises `PrivacyError` listing every request the policy does not allow. Passing does
    not hand control to the study: the site still plans its training noise under its own
    policy. The two once-per-study releases are the consortium's to declare (every site
    spends the study's `statistics_epsilon` and `count_epsilon`, so the releases are
    equally noisy and the hospital-level plan holds), hence checked against the site's
    limits here.
    """
    requested = study.privacy
    problems = []
    if requested.epsilon > policy.epsilon:
        problems.append(
            f"privacy.epsilon = {requested.epsilon:g} exceeds this site's {policy.epsilon:g}"
        )
    if requested.delta > policy.delta:
        problems.append(f"privacy.delta = {requested.delta:g} exceeds this site's {policy.delta:g}")
    if UNIT_STRENGTH[requested.unit] < UNIT_STRENGTH[policy.unit]:
        problems.append(
            f"privacy.unit = {requested.unit!r} is weaker than this site's {policy.unit!r}"
        )
    if policy.max_epsilon_per_round is not None and (
        requested.max_epsilon_per_round is None
        or requested.max_epsilon_per_round > policy.max_epsilon_per_round
    ):
        problems.append(
            "privacy.max_epsilon_per_round is not set, and this site caps every round at "
            f"{policy.max_epsilon_per_round:g}: the study must declare a cap no larger"
            if requested.max_epsilon_per_round is None else
            f"privacy.max_epsilon_per_round = {requested.max_epsilon_per_round:g} exceeds "
            f"this site's {policy.max_epsilon_per_round:g}"
        )
    # The statistics release is one release too (the site plans its noise from the
    # study's statistics_epsilon): a study asking for a nearly noiseless one, which
    # holds the unit and missing counts, is refused by the per-round cap and budget.
    cap = policy.epsilon if policy.max_epsilon_per_round is None else min(
        policy.max_epsilon_per_round, policy.epsilon)
    if requested.statistics_epsilon > cap:
        problems.append(
            f"privacy.statistics_epsilon = {requested.statistics_epsilon:g} exceeds this "
            f"site's {cap:g}"
        )
    count_cap = cap if policy.max_count_epsilon is None else min(cap, policy.max_count_epsilon)
    if requested.count_epsilon > count_cap:
        problems.append(
            f"privacy.count_epsilon = {requested.count_epsilon:g} exceeds this site's "
            f"{count_cap:g} (its privacy.count_epsilon limit for the one DP cohort count)"
        )
    if requested.unit == "hospital" and policy.max_intermediaries is not None:
        most = intermediaries_cap(study) or 1
        if most > policy.max_intermediaries:
            problems.append(
                f"privacy.intermediaries = {requested.intermediaries!r} splits a hospital "
                f"into up to {most} intermediaries, more than this site's "
                f"policy.max_intermediaries = {policy.max_intermediaries} (the "
                f"hospital-level epsilon becomes up to {most}-fold)"
            )
    if (policy.max_colluding_sites is not None
            and requested.max_colluding_sites < policy.max_colluding_sites):
        problems.append(
            f"privacy.max_colluding_sites = {requested.max_colluding_sites} assumes fewer "
            f"colluding sites than this site's policy ({policy.max_colluding_sites}): every "
            "member would add too little noise for this site's threat model"
        )
    if policy.min_round_sites is not None:
        floor = max(requested.min_round_sites, requested.max_colluding_sites + 2)
        own = max(policy.min_round_sites, (policy.max_colluding_sites or 0) + 2)
        if floor < own:
            problems.append(
                f"the study's round floor max(privacy.min_round_sites, "
                f"privacy.max_colluding_sites + 2) = {floor} is below this site's {own}"
            )
    if policy.max_evaluations is not None and study.max_evaluations > policy.max_evaluations:
        # Refused now, not at the last round: a site that cannot pay the final
        # evaluation would leave every site without the final model.
        problems.append(
            f"privacy.evaluation.max_evaluations = "
            f"{json.dumps(requested.evaluation.max_evaluations)} "
            f"asks {study.max_evaluations} DP evaluations ({study.evaluations_planned_text()}),"
            f" more than this site's policy.max_evaluations = {policy.max_evaluations}: "
            "raise policy.max_evaluations in this site's config, or lower study.rounds"
        )
    noise_std = requested.evaluation.noise_std
    if policy.min_evaluation_noise_std is not None and noise_std < policy.min_evaluation_noise_std:
        problems.append(
            f"privacy.evaluation.noise_std = {noise_std:g} adds less noise to the DP "
            f"evaluation than this site's privacy.evaluation_noise_std = "
            f"{policy.min_evaluation_noise_std:g} (the least it accepts)"
        )
    factory = study.model.custom
    if factory is not None and factory not in policy.allowed_model_factories:
        problems.append(f"model.custom = {factory!r} is not in this site's allowed factories")
    if problems:
        raise PrivacyError("study refused by this site's policy: " + "; ".join(problems))


WEIGHT_CHECK_ELEMENTS = 1 << 20
"""Weights checked per window (`check_served_weights`): no model-sized temporary."""


def largest_weight(flat: np.ndarray) -> float:
    """max |w| over a flat model (NaN when it holds NaN), read window by window."""
    values = flat.reshape(-1)
    largest = 0.0
    for start in range(0, values.size, WEIGHT_CHECK_ELEMENTS):
        window = values[start : start + WEIGHT_CHECK_ELEMENTS]
        if window.size:
            top = float(np.max(np.abs(window)))
            if top != top:  # NaN
                return top
            largest = max(largest, top)
    return largest


def check_served_weights(flat: np.ndarray, study: Study | None, *, what: str) -> None:
    """ModelOutOfBounds unless every weight of `flat` is finite and within the study's
    public bound, ``[model] max_abs_weight`` (the default without a study). A site checks
    every global model it is served before training on it; the bound and the model are
    public, so declining there says nothing about the site's data. `what` names the
    model in the message."""
    bound = study.model.max_abs_weight if study is not None else DEFAULT_MAX_ABS_WEIGHT
    largest = largest_weight(flat)
    if not largest <= bound:
        raise ModelOutOfBounds(
            f"{what} holds a weight of magnitude {largest:.4g}, beyond the study's "
            f"model.max_abs_weight = {bound:g}: refusing to train or evaluate on it (a "
            "model that large can overflow float32 on chosen records)")
