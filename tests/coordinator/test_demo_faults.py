"""`medfed demo`'s fault plan: a site is killed mid-round only where the federation of
that many sites survives it, and a failure names what failed.

The decision is checked against the real SecAgg+ state machines: with the coordinator's
threshold and the sites' policy, a round that loses the killed site right after its
masked input (where the demo kills it) completes where the demo injects the dropout
and aborts where it does not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import ProtocolAbort
from common.core.processes import ManagedProcess
from common.protocol.secagg.phases import Phase
from coordinator.selection import round_parameters
from demo.options import HISTOGRAM_BINS, DemoOptions
from demo.processes import FederationProcesses
from demo.terms import dropout_decision, federation_terms
from demo.watch import waiting_for
from tests.secagg.secagg_harness import (
    make_federation,
    plaintext_sum,
    random_inputs,
    run_round,
)


@pytest.mark.parametrize("n_sites", [2, 3, 4, 5, 6])
def test_dropout_injected_exactly_where_secagg_survives_it(n_sites: int) -> None:
    terms = federation_terms(n_sites, histogram_bins=HISTOGRAM_BINS)
    decision = dropout_decision(n_sites, aggregation=terms.aggregation, policy=terms.policy)
    assert decision.threshold == round_parameters(n_sites, terms.aggregation)[0]
    federation = make_federation(
        n_sites, threshold=decision.threshold,
        min_round_sites=terms.policy.min_round_sites,
        max_colluding_sites=terms.policy.max_colluding_sites,
    )
    inputs = random_inputs(federation.params, seed=n_sites)
    victim = federation.params.participants[-1]
    dropouts = {victim: Phase.CONSISTENCY_CHECK}  # killed after its masked input
    if decision.inject:
        total, survivors = run_round(federation, inputs, dropouts=dropouts)
        assert victim in survivors  # its input is in the sum, its masks removed
        assert np.array_equal(total, plaintext_sum(inputs, survivors))
        assert "killed mid-round" in decision.line
    else:
        with pytest.raises(ProtocolAbort):
            run_round(federation, inputs, dropouts=dropouts)
        assert decision.line.startswith("[fault] no dropout injected")
    # The product's defaults (T = 1, rounds of >= 3): from 4 sites on one may drop.
    assert decision.inject == (n_sites >= 4)


def test_two_sites_run_with_lowered_terms_and_say_so() -> None:
    two = federation_terms(2, histogram_bins=HISTOGRAM_BINS)
    assert two.aggregation.max_colluding_sites == two.policy.max_colluding_sites == 0
    assert two.policy.min_round_sites == 2
    assert two.note is not None and "2 sites" in two.note
    three = federation_terms(3, histogram_bins=HISTOGRAM_BINS)
    assert three.note is None
    assert three.policy.min_round_sites == 3 and three.aggregation.max_colluding_sites == 1
    with pytest.raises(Exception, match="at least 2 site CSVs"):
        federation_terms(1, histogram_bins=HISTOGRAM_BINS)


def test_waiting_line_names_the_round_in_flight_or_the_selection() -> None:
    states = {"north": "running", "west": "killed by the demo (not restarted yet)"}
    opened = [{"msg": "round 3 open: 2 sites, threshold 2, neighbours 0, secure=True"},
              {"msg": "round 3 masked_input deadline: dropping ['west']"}]
    text = waiting_for(opened, states)
    assert text.startswith("round 3 open: 2 sites")
    assert "dropping ['west']" in text
    assert "site agents running: north" in text and "west killed by the demo" in text
    assert "(coordinator:" not in waiting_for(opened[:1], states)  # said once, not twice
    done = [*opened, {"event": "round_completed", "round_number": 3, "msg": "done"}]
    assert waiting_for(done, states).startswith("the coordinator is waiting for sites")


def test_coordinator_failure_names_the_dead_site_and_its_log(tmp_path: Path) -> None:
    """Real processes: a "coordinator" that exits with the selection timeout, a site
    agent that exited with its own error; the message names both and their logs."""
    processes = FederationProcesses(DemoOptions(out=tmp_path / "run"))
    logs = tmp_path / "run" / "logs"

    def process(name: str, message: str, code: int) -> ManagedProcess:
        line = json.dumps({"level": "error", "msg": message})
        return ManagedProcess(
            name, [sys.executable, "-c", f"import sys; print({line!r}); sys.exit({code})"],
            log_dir=logs,
        )

    coordinator = process("coordinator", "fewer than min_sites=3 eligible sites for 600 s", 1)
    processes.site_agents["north"] = process("north", "cannot read north.csv", 2)
    processes.site_agents["south"] = ManagedProcess(
        "south", [sys.executable, "-c", "import threading; threading.Event().wait()"], log_dir=logs)
    try:
        assert coordinator.wait_exit(timeout=60) == 1
        assert processes.site_agents["north"].wait_exit(timeout=60) == 2
        processes.site_agents["north"].wait_for(lambda e: "msg" in e, timeout=60,
                                                what="its line")
        coordinator.wait_for(lambda e: "msg" in e, timeout=60, what="its line")
        text = processes.coordinator_failure(coordinator, ["north", "south"])
    finally:
        for proc in (coordinator, *processes.site_agents.values()):
            proc.stop()
    assert "fewer than min_sites=3" in text and str(logs / "coordinator.log") in text
    assert "north exited with code 2: cannot read north.csv" in text
    assert str(logs / "north.log") in text
    assert "south" not in text  # still running: not a suspect
