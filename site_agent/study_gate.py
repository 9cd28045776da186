"""The one gate every study passes before this site sends anything that depends on it:
the study its own state approved.

A hospital's privacy officer approves a study once (`medfed site approve STUDY.toml`:
the members with their key fingerprints, the model, the privacy terms and the rounds,
then its SHA-256 pinned under STATE/approved/). Nothing else lets a site join a study:
not a flag (`--study FILE` only names which approved study the site expects), not an
empty state folder (a site that approved nothing joins nothing), not the coordinator
(whatever it serves is compared with the pin, byte for byte through the SHA-256).
Without the gate a coordinator holding the CA could serve a study listing certificates
it minted next to a victim's and read the victim's update from the sum, or write a
one-round study that spends a third of the budget at once.

`check_at_start` runs before the agent loads torch or dials out, for what the site's
own settings name (`study_file`, `study_sha256`); `check_served` runs at enrolment,
when the coordinator's study is known, before the site checks its data or sends a key.
"""

from __future__ import annotations

from pathlib import Path

from common.core.config import SiteSettings
from common.core.errors import ConfigError, StudyNotApproved
from common.study import Study, load_study, study_sha256
from site_agent.approvals import Approvals


def approve_hint(settings: SiteSettings, *, study: str = "STUDY.toml") -> str:
    """The command that approves `study` for this site's state folder."""
    return f"`medfed site approve {study} --state {settings.state}`"


def _short(study: Study) -> str:
    return f"{study.study.name!r} (sha256 {study_sha256(study)})"


def approved_study(state: Path) -> Study | None:
    """The study pinned under `state` (StateError naming the pin when it is damaged)."""
    return Approvals(state).study()


def check_at_start(settings: SiteSettings) -> Study | None:
    """What the site's own settings ask of its approval, before it dials out: `study_file`
    and `study_sha256` each name the approved study, and it must be pinned. Returns the
    pinned study (None when none is: `check_served` refuses at enrolment, naming the
    coordinator's study)."""
    pinned = approved_study(settings.state)
    if settings.study_sha256 is not None:
        if pinned is None:
            raise ConfigError(
                "study_sha256",
                f"this site's config names the approved study {settings.study_sha256}, but "
                f"its state folder {settings.state} pins no study: approve the study file "
                f"with `medfed site approve STUDY.toml --config CONFIG` (it checks the file "
                "against study_sha256), then start the site again",
            )
        if study_sha256(pinned) != settings.study_sha256:
            raise ConfigError(
                "study_sha256",
                f"this site's config names the approved study {settings.study_sha256}, but "
                f"its state folder {settings.state} pins {_short(pinned)}: approve the study "
                "the config names (`medfed site approve STUDY.toml --config CONFIG`), or "
                "correct study_sha256",
            )
    if settings.study_file is not None:
        named = load_study(settings.study_file)
        if pinned is None or study_sha256(pinned) != study_sha256(named):
            where = ("pins no study" if pinned is None else f"pins another study, {_short(pinned)}")
            raise ConfigError(
                "study_file",
                f"{settings.study_file} is {_short(named)}, but this site's state folder "
                f"{settings.state} {where}: a site joins only a study its privacy officer "
                f"approved; read it and approve it with "
                f"{approve_hint(settings, study=str(settings.study_file))}",
            )
    return pinned


def check_served(study: Study, settings: SiteSettings) -> None:
    """The coordinator's study is the approved one (re-read from the state folder now, so
    a study approved while a long-running site waited is taken up), else
    StudyNotApproved with the one line that says how to approve."""
    pinned = approved_study(settings.state)
    if pinned is None:
        raise StudyNotApproved(
            f"the coordinator serves study {_short(study)}, and this site's state folder "
            f"{settings.state} has approved no study, so it joins none: its privacy officer "
            f"reads the study (members and their key fingerprints, model, privacy terms, "
            f"rounds) and approves it with {approve_hint(settings)}"
        )
    if study_sha256(pinned) != study_sha256(study):
        raise StudyNotApproved(
            f"the coordinator serves study {_short(study)}, not the study this site "
            f"approved, {_short(pinned)}: nothing is sent for it. If the consortium "
            f"replaced the study, read the new one and approve it with "
            f"{approve_hint(settings)}"
        )
