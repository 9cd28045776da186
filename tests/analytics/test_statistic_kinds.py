"""A kind of statistic is one module (`common.releases.analytics.statistic`): the kinds
a query may name are the modules of common/releases/analytics/statistics/, and a kind
written in a file of its own, registered by importing it, runs through everything a
query does (the file's validation, the study check, the site's vector, the answer, the
approval screen) with nothing else in the product naming it."""

from __future__ import annotations

import importlib.util
import io
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import ValidationError
from common.releases.analytics import statistic
from common.releases.analytics.answer import answer_query
from common.releases.analytics.query import query_from_mapping
from common.releases.analytics.vector import block_slices, query_blocks, site_vector
from common.study import study_sha256
from site_agent.approve_cli import describe_query
from tests.analytics.helpers import NAN, followup_study, query_of, table_of

REPO = Path(__file__).resolve().parents[2]
STUDY = followup_study()

TOY = '''
"""TEST ONLY: units whose numeric feature lies below, within or above a range."""

import numpy as np

from common.releases.analytics.estimates import count_estimate
from common.releases.analytics.statistic import (
    Reading, StatisticKind, register_statistic, require_feature)
from common.releases.noisy_counts import credible_z


class Banded(StatisticKind):
    name = "test_banded"
    options = frozenset({"feature", "range"})

    def check_fields(self, spec):
        require_feature(spec)
        if spec.range is None:
            raise ValueError("kind = 'test_banded' needs range = [low, high]")

    def check_against_study(self, spec, check):
        check.feature("feature", spec.feature, "numeric")

    def cells(self, spec, study):
        return ("below", "within", "above")

    def count(self, spec, study, units, *, inside):
        x = units.numeric[spec.feature]
        low, high = spec.range
        slot = np.where(x < low, 0, np.where(x > high, 2, 1))
        usable = inside & ~np.isnan(x)
        counts = np.bincount(slot[usable], minlength=3).astype(np.int64)
        return counts, inside & np.isnan(x)

    def answer(self, spec, study, sums, *, sigma, level, rng):
        cut = credible_z(3)
        return Reading([count_estimate(float(v), sigma=sigma, cell=cell, quantity="count",
                                       cut=cut, level=level)
                        for v, cell in zip(sums, self.cells(spec, study))],
                       notes=["banded by hand"])


register_statistic(Banded())
'''


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[str]:
    """The toy kind's module, written to a file of its own and imported (which registers
    it); unregistered afterwards."""
    path = tmp_path / "test_banded.py"
    path.write_text(TOY, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("medfed_test_banded", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield "test_banded"
    finally:
        statistic.STATISTIC_KINDS.pop("test_banded", None)
        sys.modules.pop(spec.name, None)


def _query(kind_lines: str) -> str:
    return f"""
name = "banded"
study_sha256 = "{study_sha256(STUDY)}"

[[statistics]]
name = "patients"
kind = "count"
epsilon = 0.5

[[statistics]]
name = "ages"
{kind_lines}
epsilon = 0.5
"""


def test_the_kinds_are_the_modules_of_the_statistics_folder() -> None:
    folder = REPO / "common/releases/analytics/statistics"
    files = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    assert statistic.load_statistics() == tuple(files)
    assert files == ["count", "histogram", "kaplan_meier", "mean", "rate"]
    for name in files:
        assert statistic.statistic_kind(name).name == name


def test_a_kind_nothing_registered_is_refused_naming_the_field() -> None:
    text = _query('kind = "test_banded"\nfeature = "Age (years)"\nrange = [40, 70]')
    with pytest.raises(ValidationError, match=r"statistics\[1\]\.kind: 'test_banded' is "
                                              r"not a kind of statistic; known: count, "):
        query_from_mapping(tomllib.loads(text), source="q")


def test_a_kind_of_one_file_runs_through_the_whole_query(toy: str) -> None:
    # The file's validation: the kind's own fields, and only those.
    with pytest.raises(ValidationError, match=r"statistics\[1\]: kind = 'test_banded' "
                                              r"needs range"):
        query_from_mapping(tomllib.loads(_query(
            f'kind = "{toy}"\nfeature = "Age (years)"')), source="q")
    with pytest.raises(ValidationError, match=r"statistics\[1\]: bins does not apply"):
        query_from_mapping(tomllib.loads(_query(
            f'kind = "{toy}"\nfeature = "Age (years)"\nrange = [40, 70]\nbins = [1, 2]')),
            source="q")
    # The study check: a categorical feature is refused by the kind's own rule.
    with pytest.raises(ValidationError, match=r"statistics\[1\]\.feature: feature 'Sex' is "
                                              r"categorical"):
        query_of(_query(f'kind = "{toy}"\nfeature = "Sex"\nrange = [40, 70]'), STUDY)

    query = query_of(_query(f'kind = "{toy}"\nfeature = "Age (years)"\nrange = [40, 70]'),
                     STUDY)
    # The site's vector: its three cells, then the missing cell every kind has.
    rows = [("a", 30.0, "F", 1.0, 10.0, "icu", "alive"),
            ("b", 50.0, "M", 1.0, 10.0, "icu", "dead"),
            ("c", 65.0, "F", NAN, 10.0, "icu", "alive"),
            ("d", 90.0, "M", 1.0, 10.0, "icu", "alive")]
    vector = site_vector(query, table_of(rows), study=STUDY)
    ages = vector[block_slices(query, study=STUDY)["ages"]]
    assert ages.tolist() == [1, 2, 1, 0]
    (count, banded) = query_blocks(query, study=STUDY, n_noise=2)
    assert banded.cells == ("below", "within", "above", "missing")
    assert (banded.l1_sensitivity, banded.l2_sensitivity) == (1.0, 1.0)
    assert banded.sigma == pytest.approx(count.sigma, rel=0.01)  # same epsilon, same bound

    # The answer: the kind's estimates, notes, and the missing cell read for every kind.
    answer = answer_query(query, vector, study=STUDY, noise_sigmas=[0.0, 0.0], contributors=1)
    read = answer.statistic("ages")
    assert [(e.cell, e.value) for e in read.estimates] == [
        ("below", 1.0), ("within", 2.0), ("above", 1.0)]
    assert read.missing.value == 0.0 and read.notes == ("banded by hand",)

    # The approval screen.
    out = io.StringIO()
    describe_query(query, "0" * 64, STUDY, out)
    assert "  - ages: test_banded of Age (years), epsilon 0.5, 4 cells, range (40.0, 70.0)" \
        in out.getvalue()


def test_a_second_kind_of_the_same_name_is_refused(toy: str) -> None:
    class Impostor(statistic.StatisticKind):
        name = toy

        def cells(self, spec: statistic.StatisticSpec, study: object) -> tuple[str, ...]:
            return ()

        def count(self, *args: object, **kwargs: object) -> tuple[np.ndarray, np.ndarray]:
            raise AssertionError

        def answer(self, *args: object, **kwargs: object) -> statistic.Reading:
            raise AssertionError

    with pytest.raises(ValidationError, match="registered twice"):
        statistic.register_statistic(Impostor())
