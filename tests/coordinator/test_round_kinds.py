"""The coordinator's kinds of round (`coordinator.round_kind`): the run loop's kinds are
the modules of coordinator/round_kinds/, asked in rank order: the study's statistics,
then training, then the final evaluation; a query runs in place of the study's next
round. The engine itself names none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.core.errors import ConfigError
from coordinator.round_kind import ROUND_KINDS, register_round_kind, round_kinds

REPO = Path(__file__).resolve().parents[2]


def test_the_kinds_are_the_modules_of_the_round_kinds_folder_in_rank_order() -> None:
    folder = REPO / "coordinator/round_kinds"
    files = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    kinds = round_kinds()
    assert sorted(kind.name for kind in kinds) == files
    assert [k.name for k in kinds if not k.in_place_of_study_round] == [
        "statistics", "training", "evaluation"]
    assert [k.name for k in kinds if k.in_place_of_study_round] == ["query"]
    assert [k.name for k in kinds if not k.spends_budget] == ["evaluation"]


def test_the_run_loop_names_no_kind_of_round() -> None:
    """coordinator/engine.py imports neither a kind's module nor what only one kind
    uses (the query inbox, the statistics, a model step or a release's decoding)."""
    tree = ast.parse((REPO / "coordinator/engine.py").read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    for name in ("coordinator.queries", "coordinator.release_round", "coordinator.hospital_sum",
                 "coordinator.round_kinds", "common.releases.egress.STATISTICS",
                 "coordinator.training_round.apply_update"):
        assert not any(i == name or i.startswith(name + ".") or i.endswith("." + name)
                       for i in imported), name
    for module in ("queries", "release_round", "hospital_sum", "training_round"):
        assert f"coordinator.{module}" not in imported


def test_a_second_kind_of_the_same_name_or_rank_is_refused() -> None:
    kinds = {k.name: k for k in round_kinds()}
    training = kinds["training"]

    class Impostor(type(training)):  # type: ignore[misc]
        name = "test_impostor"

    with pytest.raises(ConfigError, match="has the rank of 'training'"):
        register_round_kind(Impostor())

    class Twin(type(kinds["evaluation"])):  # type: ignore[misc]
        name = "training"
        rank = 999

    with pytest.raises(ConfigError, match="registered twice"):
        register_round_kind(Twin())
    assert "test_impostor" not in ROUND_KINDS and ROUND_KINDS["training"] is training
