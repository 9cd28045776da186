"""The suite's xdist groups hold: tests that share a module fixture (a federation, built
images) run on one worker, so the fixture is built once (tests/conftest.py).

pytest-xdist's `--dist loadgroup` renames each grouped test's node id to `ID@GROUP` and
schedules by that suffix. pytest 9 keeps node ids where xdist 3.8 cannot rename them, so
every group was silently ignored (each worker rebuilt every shared fixture; four
container tests ran on three workers at once): requirements/dev.in pins pytest 8 until
xdist follows. This test fails where the renaming does not happen.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def shared() -> object:
    return object()


def test_a_test_sharing_a_module_fixture_is_in_its_files_group(
    shared: object, request: pytest.FixtureRequest
) -> None:
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("tests/unit/test_xdist_groups.py",)
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup"):
        # What xdist schedules by: the group suffix on the node id.
        assert request.node.nodeid.endswith("@tests/unit/test_xdist_groups.py"), (
            request.node.nodeid)
