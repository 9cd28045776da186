"""The coordinator's query inbox (`coordinator.queries`): every file read from it is
validated before it can become a round, and what could not run is reported to the
operator's `medfed query run` with the reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from common.analytics.query import query_bytes, query_from_mapping, query_sha256
from common.study import Study, study_from_mapping, study_sha256
from coordinator import queries
from coordinator.query_cli import QueryFailed, wait_for
from tests.study.helpers import study_mapping


@pytest.fixture(scope="module")
def study() -> Study:
    return study_from_mapping(study_mapping(), source="test")


def payload(study: Study, name: str = "counts") -> bytes:
    return query_bytes(query_from_mapping({
        "name": name, "study_sha256": study_sha256(study),
        "statistics": [{"name": "patients", "kind": "count", "epsilon": 0.5}]}))


def test_a_valid_query_is_taken_and_a_bad_one_is_refused_with_its_reason(
    study: Study, tmp_path: Path,
) -> None:
    inbox = queries.folder(tmp_path, queries.INBOX)
    inbox.mkdir(parents=True)
    (inbox / "notes.txt").write_text("not a query")  # not <sha256>.query: ignored
    # Bytes that do not hash to the file's name.
    wrong = "0" * 64
    (inbox / f"{wrong}.query").write_bytes(payload(study))
    # A query of another study.
    other = study_from_mapping({**study_mapping(), "study": {
        "name": "another", "rounds": 3, "classes": ["no", "yes"]}}, source="test")
    foreign = payload(other)
    foreign_sha = hashlib.sha256(foreign).hexdigest()
    (inbox / f"{foreign_sha}.query").write_bytes(foreign)
    # The same query, not canonical.
    spaced = payload(study).replace(b",", b", ")
    spaced_sha = hashlib.sha256(spaced).hexdigest()
    (inbox / f"{spaced_sha}.query").write_bytes(spaced)

    assert queries.pending(tmp_path, study) is None
    for sha, reason in ((wrong, "do not hash"), (foreign_sha, "study"),
                        (spaced_sha, "canonical")):
        assert not queries.inbox_path(tmp_path, sha).exists()
        with pytest.raises(QueryFailed, match=reason):
            wait_for(tmp_path, sha, timeout=1)
    assert (inbox / "notes.txt").exists()

    good = payload(study, "good")
    sha = queries.submit(tmp_path, good)
    pending = queries.pending(tmp_path, study)
    assert pending is not None and (pending.sha256, pending.name) == (sha, "good")
    assert pending.payload == good and pending.release.sha256 == sha
    assert sha == query_sha256(pending.release.query_def)


def test_waiting_for_an_answer_that_does_not_come_says_where_the_query_waits(
    study: Study, tmp_path: Path,
) -> None:
    sha = queries.submit(tmp_path, payload(study))
    with pytest.raises(QueryFailed, match=r"waits in .*inbox"):
        wait_for(tmp_path, sha, timeout=0.3)
    # A new submission clears an earlier failure of the same query.
    queries.fail(tmp_path, sha, "round 3 did not complete")
    with pytest.raises(QueryFailed, match="round 3 did not complete"):
        wait_for(tmp_path, sha, timeout=1)
    queries.submit(tmp_path, payload(study))
    assert not queries.failed_path(tmp_path, sha).exists()
    assert queries.pending(tmp_path, study) is not None
