"""When the sites' declines end a study (coordinator/engine.py `declined_for_good`): only
declines whose reason cannot change, and only when every participant declined so."""

from __future__ import annotations

from coordinator.engine import declined_for_good
from coordinator.phases import ActiveRound
from tests.coordinator.test_phases import SITES, announcement

REASON = "its policy.max_evaluations are used up on its ledger"


def aborted_round() -> ActiveRound:
    return ActiveRound(announcement(), b"")


def test_every_site_declining_for_good_ends_the_study_naming_the_reason() -> None:
    rnd = aborted_round()
    for site in SITES:
        rnd.decline(site, lasting_reason=REASON)
    failure = declined_for_good(rnd, min_sites=len(SITES), kind="the final evaluation round")
    assert failure is not None
    assert failure.reason.startswith("the final evaluation round (round number 1) cannot run")
    assert f"{', '.join(sorted(SITES))}: {REASON}" in failure.reason
    assert str(failure) == "study failed: " + failure.reason


def test_sites_merely_not_ready_never_end_the_study() -> None:
    rnd = aborted_round()
    for site in SITES:
        rnd.decline(site)  # NOT_READY or no reason: may take part next time
    assert declined_for_good(rnd, min_sites=2, kind="training round 1 of 3") is None


def test_a_lasting_decline_ends_the_study_only_when_no_participant_is_left() -> None:
    """One or more sites declining for good leave the others to carry on (the round
    waits for min_sites able sites; the declined site's operator may still act, e.g. on
    the way out a statistics refusal names); all of them declining ends the study."""
    rnd = aborted_round()
    rnd.decline(SITES[0], lasting_reason="its privacy budget cannot pay for the round")
    assert declined_for_good(rnd, min_sites=len(SITES), kind="training round 1 of 3") is None
    for site in SITES[1:-1]:
        rnd.decline(site, lasting_reason="its privacy budget cannot pay for the round")
    assert declined_for_good(rnd, min_sites=len(SITES), kind="training round 1 of 3") is None
    rnd.decline(SITES[-1], lasting_reason="its privacy budget cannot pay for the round")
    failure = declined_for_good(rnd, min_sites=len(SITES), kind="training round 1 of 3")
    assert failure is not None and "budget" in failure.reason
    assert f"leaving 0 of min_sites={len(SITES)}" in failure.reason
