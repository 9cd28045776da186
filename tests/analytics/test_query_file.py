"""The query file: every refusal names the file and the field; canonical bytes."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from common.core.errors import ValidationError
from common.releases.analytics.query import (
    draft_query,
    load_query,
    query_bytes,
    query_from_bytes,
    query_from_mapping,
    query_sha256,
)
from common.study import study_sha256
from tests.analytics.helpers import every_kind_toml, followup_study
from tests.study.helpers import hospital_study

STUDY = followup_study()
GOOD = every_kind_toml(STUDY)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "query.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_good_file_loads_and_its_digest_is_canonical(tmp_path: Path) -> None:
    query = load_query(write(tmp_path, GOOD), study=STUDY)
    assert query.name == "every-kind" and query.study_sha256 == study_sha256(STUDY)
    assert [s.kind for s in query.statistics] == [
        "count", "rate", "mean", "histogram", "kaplan_meier"]
    assert query.epsilon == pytest.approx(2.5)
    data = query_bytes(query)
    assert query_sha256(query) == hashlib.sha256(data).hexdigest()
    # Reordered keys in the file: the same query, the same digest.
    shuffled = GOOD.replace('name = "every-kind"\nstudy_sha256', 'study_sha256', 1).replace(
        '[[cohort]]', 'name = "every-kind"\n\n[[cohort]]', 1)
    assert query_sha256(load_query(write(tmp_path, shuffled), study=STUDY)) == \
        query_sha256(query)
    assert query_from_bytes(data, study=STUDY, sha256=query_sha256(query)) == query


def test_received_bytes_must_be_canonical_and_match_the_digest() -> None:
    query = query_from_mapping(tomllib.loads(GOOD))
    data = query_bytes(query)
    with pytest.raises(ValidationError, match="do not match"):
        query_from_bytes(data, study=STUDY, sha256="0" * 64)
    with pytest.raises(ValidationError, match="canonical"):
        query_from_bytes(data.replace(b",", b", ", 1), study=STUDY)
    with pytest.raises(ValidationError, match="study_sha256"):
        query_from_bytes(data, study=hospital_study())


BAD = [
    # (replace this, with this, the field the error must name, words it must say)
    ('kind = "count"', 'kind = "median"', "statistics[0].kind", "count"),
    ('feature = "Sex"', 'feature = "Gender"', "statistics[1].by[0].feature",
     "not a feature the study declares"),
    ('grid = [0, 30, 60]', 'grid = [0, 60, 30]', "statistics[4].grid", "strictly increasing"),
    ('grid = [0, 30, 60]\n', '', "statistics[4]", "grid"),
    ('resolution = 1', 'resolution = 0.3', "statistics[2].resolution", "whole number"),
    ('range = [40, 100]', 'levels = ["F"]', "cohort[0].levels", "numeric"),
    ('range = [40, 100]', 'range = [100, 40]', "cohort[0].range", "low < high"),
    ('name = "mortality"', 'name = "patients"', "query", "repeated"),
    ('name = "mortality"', 'name = "mortality"\noutcome = "maybe"', "statistics[1].outcome",
     "not one of the study's classes"),
    ('epsilon = 0.5\n\n[[statistics]]\nname = "mortality"',
     'epsilon = 0.5\nbins = [1, 2]\n\n[[statistics]]\nname = "mortality"',
     "statistics[0]", "bins does not apply"),
    ('name = "every-kind"', 'name = "every-kind"\ncolour = "red"', "colour", "Extra"),
    ('feature = "Ward"', 'feature = "Age (years)"', "statistics[3].bins", "needs"),
    ('name = "every-kind"', 'name = "=cmd"', "name", "pattern"),
]


@pytest.mark.parametrize(("old", "new", "field", "words"), BAD)
def test_a_bad_file_is_refused_naming_file_and_field(
    tmp_path: Path, old: str, new: str, field: str, words: str,
) -> None:
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ValidationError) as caught:
        load_query(path, study=STUDY)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert field in message and words in message


def test_a_query_for_another_study_and_broken_toml_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    with pytest.raises(ValidationError, match=r"query\.toml: study_sha256: .*another study"):
        load_query(path, study=hospital_study())
    path.write_text("name = ", encoding="utf-8")
    with pytest.raises(ValidationError, match=r"query\.toml: not valid TOML"):
        load_query(path, study=STUDY)
    with pytest.raises(ValidationError, match="cannot read"):
        load_query(tmp_path / "absent.toml", study=STUDY)


def test_a_mean_of_an_auto_range_feature_needs_its_own_range(tmp_path: Path) -> None:
    text = GOOD.replace('feature = "Age (years)"\nrange = [0, 100]\nresolution = 1',
                        'feature = "Lactate mmol/L"')
    with pytest.raises(ValidationError, match=r"statistics\[2\]\.range: .*auto"):
        load_query(write(tmp_path, text), study=STUDY)
    text = GOOD.replace('feature = "Age (years)"\nrange = [0, 100]\nresolution = 1',
                        'feature = "Lactate mmol/L"\nrange = [0, 20]\nresolution = 0.1')
    assert load_query(write(tmp_path, text), study=STUDY).statistics[2].range == (0, 20)


def test_drafts_validate_against_their_study(tmp_path: Path) -> None:
    for study in (STUDY, hospital_study()):
        text = draft_query(study, name="draft")
        query = load_query(write(tmp_path, text), study=study)
        assert query.epsilon == pytest.approx(1.0)
        assert query.statistics[0].kind == "count"
