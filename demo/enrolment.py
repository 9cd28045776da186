"""The demo's federation before any process starts, made the way a consortium makes its
own: the PKI (`medfed pki`), the study's member hospitals pinned by key and approved at
every site (`medfed study init --member-from`, `medfed site approve`), and each site's
split key in its state folder, so the demo's in-process baselines hold out the patients
the sites hold out."""

from __future__ import annotations

from pathlib import Path

from common.protocol.pki import (
    init_ca,
    issue_coordinator,
    issue_site,
    load_certificate,
    public_key_fingerprint,
    site_paths,
)
from common.study import Study, load_study
from site_agent.approvals import Approvals
from site_agent.unit_split import site_split_key


def make_pki(pki: Path, sites: list[str]) -> None:
    """A federation CA in `pki`, a certificate for the coordinator on 127.0.0.1 and
    localhost, and one per site."""
    init_ca(pki)
    issue_coordinator(pki, ["127.0.0.1", "localhost"])
    for site in sites:
        issue_site(pki, site)


def pin_members_and_approve(study_file: Path, pki: Path, *,
                            site_states: dict[str, Path]) -> Study:
    """The study lists its hospitals by public-key SHA-256 ([[members]], as `medfed
    study init --member-from` writes them) and every hospital approves it (`medfed site
    approve`, in its state folder of `site_states`): each site then joins only this
    study and refuses any round naming anyone else, or a member under another key (a CA
    holder's sybil sites). The study as served, members included."""
    members = "".join(
        f'\n[[members]]\nname = "{site}"\nfingerprint = "'
        f'{public_key_fingerprint(load_certificate(site_paths(pki, site)[0]))}"\n'
        for site in site_states)
    with study_file.open("a", encoding="utf-8") as handle:
        handle.write("\n# The hospitals of this study and their keys (public-key SHA-256)."
                     + members)
    study = load_study(study_file)
    for state in site_states.values():
        Approvals(state).approve_study(study)
    return study


def split_keys(site_states: dict[str, Path]) -> dict[str, bytes]:
    """Each site's split key, made in its state folder before it starts (the site
    reads the same file)."""
    return {site: site_split_key(state) for site, state in site_states.items()}
