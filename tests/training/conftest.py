"""Shared fixtures for the training tests: one thread, small synthetic sites."""

from __future__ import annotations

import warnings

import pytest
import torch

from site_agent.data import SiteData, prepare_site_split
from site_agent.synthetic import generate_cohort

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet_opacus_hook_warning() -> None:
    # Opacus' full backward hooks warn when the model inputs need no gradient.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")


@pytest.fixture(scope="session")
def site_split() -> tuple[SiteData, SiteData]:
    """Standardised train / held-out split of one mid-size synthetic hospital."""
    cohort = generate_cohort(["urban_academic"], seed=11, patients_per_site=500)
    train, held_out, _ = prepare_site_split(cohort["urban_academic"], key=b"k" * 32)
    return train, held_out
