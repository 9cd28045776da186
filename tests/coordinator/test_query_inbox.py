"""The coordinator's query inbox (`coordinator.queries`): every file read from it is
validated before it can become a round, and what could not run is reported to the
operator's `medfed query run` with the reason."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from common.releases.analytics.query import query_bytes, query_from_mapping, query_sha256
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


def test_the_privacy_card_of_a_later_model_names_the_queries_answered_before_it(
    study: Study, tmp_path: Path,
) -> None:
    """A query answered in round 3 is on the card of the model after round 4 (and of
    every later one), not on round 3's or earlier; the card reads back from a real
    bundle's JSON, and a card without queries keeps its stored form."""
    from common.releases.bundle import PrivacyCard, card_json
    from coordinator.bundles import queries_before

    sha = queries.submit(tmp_path, payload(study, "before-training"))
    pending = queries.pending(tmp_path, study)
    assert pending is not None
    release = pending.release
    total = np.zeros(release.length, dtype=np.int64)
    sigmas = [plan.sigma for plan in release.plans(n_noise=3)]
    answer = release.decode_blocks(total, noise_sigmas=sigmas, round_number=3, contributors=3)
    queries.keep_answer(tmp_path, release, total, noise_sigmas=sigmas, contributors=3,
                        round_number=3, answer=answer)
    assert not queries.inbox_path(tmp_path, sha).exists()

    assert queries_before(tmp_path, 3) == ()
    named = queries_before(tmp_path, 4)
    assert [(q.name, q.sha256, q.round, q.contributors) for q in named] == [
        ("before-training", sha, 3, 3)]
    assert named[0].epsilon == pytest.approx(release.query_def.epsilon)
    # A damaged answer file is left off the card, never written onto it.
    broken = queries.folder(tmp_path, queries.ANSWERS) / f"{'1' * 64}-round-000002.json"
    broken.write_text("{not json")
    assert [q.sha256 for q in queries_before(tmp_path, 9)] == [sha]

    card = {"unit": "patient", "accountant": "per-site ledger", "mechanisms": ["m"],
            "rounds": 4, "sites": [{"site": "a", "epsilon": 1.0, "delta": 1e-5}]}
    plain = PrivacyCard.model_validate(card)
    assert "queries" not in card_json(plain)
    with_queries = PrivacyCard.model_validate({**card, "queries": [
        q.model_dump(mode="json") for q in named]})
    assert PrivacyCard.model_validate(card_json(with_queries)).queries == named


def test_a_finished_study_fails_waiting_queries_and_refuses_new_ones_at_once(
    study: Study, tmp_path: Path,
) -> None:
    waiting = queries.submit(tmp_path, payload(study, "waiting"))
    assert queries.closed_reason(tmp_path) is None
    assert queries.close(tmp_path, "the study has finished") == [waiting]
    assert queries.closed_reason(tmp_path) == "the study has finished"
    with pytest.raises(QueryFailed, match="the study has finished"):
        wait_for(tmp_path, waiting, timeout=60)  # at once: its failure is written
    # One that reached the inbox after the study closed (a `query run` racing the last
    # round) fails as soon as its waiter looks, not after its timeout.
    late = queries.submit(tmp_path, payload(study, "late"))
    with pytest.raises(QueryFailed, match="the study has finished"):
        wait_for(tmp_path, late, timeout=60)
    assert not queries.inbox_path(tmp_path, late).exists()
    # A coordinator that runs rounds again takes queries again.
    queries.reopen(tmp_path)
    again = queries.submit(tmp_path, payload(study, "again"))
    with pytest.raises(QueryFailed, match=r"waits in .*inbox"):
        wait_for(tmp_path, again, timeout=0.3)
