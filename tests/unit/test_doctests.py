"""The doctests of the maths modules: each example in a docstring is run, so a formula
shown next to the code is the formula the code computes."""

from __future__ import annotations

import doctest
import importlib

import pytest

MATHS_MODULES = (
    "common.releases.convergence",
    "common.releases.statistics",
    "common.releases.noisy_counts",
    "common.releases.evaluation",
    "common.releases.evaluation_edges",
    "common.releases.evaluation_interval",
    "common.releases.evaluation_threshold",
    "common.core.codec",
    "common.privacy.accountant",
    "common.privacy.ddgauss",
    "common.privacy.hospital",
    "common.privacy.intermediaries",
    "common.privacy.layered",
    "common.privacy.mechanisms",
    "common.privacy.recompose",
    "common.privacy.rotation",
    "common.protocol.secagg.reconstruction",
)


@pytest.mark.parametrize("name", MATHS_MODULES)
def test_doctests_pass(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_the_maths_modules_have_examples() -> None:
    attempted = {
        name: doctest.testmod(importlib.import_module(name)).attempted for name in MATHS_MODULES
    }
    with_examples = {name for name, count in attempted.items() if count}
    assert {
        "common.releases.convergence", "common.releases.statistics", "common.releases.noisy_counts",
        "common.privacy.ddgauss", "common.privacy.intermediaries",
    } <= with_examples
    assert sum(attempted.values()) >= 20
