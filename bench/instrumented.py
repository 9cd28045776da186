"""The `medfed` services with test instrumentation: what tests and benchmarks watch in
a round, kept out of the product (a hospital's configuration cannot make its site write
a plaintext update anywhere: the product's observer is `common.core.observer.NoObserver`).

    python -m bench.instrumented coordinator serve ... --debug-write-aggregates
    python -m bench.instrumented coordinator serve ... --model-dim 5000
    python -m bench.instrumented site run ... --debug-write-updates
    python -m bench.instrumented site run ... --debug-pause-after 1:masked_input

take every flag of `medfed coordinator serve` / `medfed site run` and these:

--model-dim D             (coordinator) serve a zero-initialised flat model of D float32
                          elements and no study, for transport tests and benchmarks whose
                          sites run the deterministic double (`bench.transport_site`; a
                          site that trains refuses a coordinator without a study)
--debug-write-aggregates  (coordinator) each round's unmasked ring sum, as little-endian
                          uint32 words, to STATE/aggregates/round-NNNNNN.u32 (written as a
                          stream: a test may make it a pipe to hold the coordinator between
                          its sum and its record) and the sites it sums, one a line, to
                          STATE/aggregates/round-NNNNNN.survivors
--debug-write-updates     (site) each round's ring vector before its masks, as little-endian
                          uint32 words, to STATE/debug-updates/round-NNNNNN.u32
--debug-pause-after R:P   (site) after phase P of round R (common.core.observer.PHASES) print
                          {"event": "paused", "round": R, "phase": P} on stdout and wait
                          --debug-pause-seconds (default 3600; SIGTERM ends the wait) so a
                          fault test can kill the site there

`bench.transport_site` takes them too (its sites are the deterministic double).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from common.commands.cli import main_with
from common.core.codec import TensorSpec
from common.core.config import SiteSettings
from common.core.modelfile import flat_layout
from common.core.observer import PHASES, ObserverFactory
from coordinator import cli as coordinator_cli
from coordinator.checkpoints import InitialModel
from site_agent import cli as site_cli
from site_agent.site_training import TrainingHook

AGGREGATES_DIR = "aggregates"
UPDATES_DIR = "debug-updates"
DEFAULT_PAUSE_SECONDS = 3600.0
MAX_MODEL_DIM = 1 << 30
_PAUSE_AT = re.compile(rf"^(\d+):({'|'.join(PHASES)})$")


def instrumented_argv(*args: str) -> list[str]:
    """argv running this command with this interpreter."""
    return [sys.executable, "-m", "bench.instrumented", *args]


class Instrumentation:
    """A `common.core.observer.RoundObserver` that writes sums and updates under `state` and
    pauses a site after one phase, as its flags say."""

    def __init__(
        self, state: Path, *, write_aggregates: bool = False, write_updates: bool = False,
        pause_after: tuple[int, str] | None = None,
        pause_seconds: float = DEFAULT_PAUSE_SECONDS,
    ) -> None:
        self.state = state
        self.write_aggregates = write_aggregates
        self.write_updates = write_updates
        self.pause_after = pause_after
        self.pause_seconds = pause_seconds

    def after_phase(self, round_number: int, phase: str, *, stop: threading.Event) -> None:
        if self.pause_after != (round_number, phase):
            return
        print(json.dumps({"event": "paused", "round": round_number, "phase": phase}),
              flush=True)
        stop.wait(self.pause_seconds)

    def update_before_masking(self, round_number: int, vector: np.ndarray) -> None:
        if not self.write_updates:
            return
        folder = self.state / UPDATES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        vector.astype("<u4", copy=False).tofile(folder / f"round-{round_number:06d}.u32")

    def aggregate_unmasked(
        self, round_number: int, aggregate: np.ndarray, survivors: tuple[str, ...]
    ) -> None:
        if not self.write_aggregates:
            return
        folder = self.state / AGGREGATES_DIR
        folder.mkdir(parents=True, exist_ok=True)
        words = np.ascontiguousarray(aggregate.astype("<u4", copy=False))
        # A stream (not ndarray.tofile, which needs a seekable file), so a test can make
        # the file a pipe and hold the coordinator between its sum and its record.
        with open(folder / f"round-{round_number:06d}.u32", "wb") as out:
            out.write(words.data)
        (folder / f"round-{round_number:06d}.survivors").write_text(
            "\n".join(survivors) + "\n")


def flat_model(dim: int) -> InitialModel:
    """The model a coordinator without a study serves (`--model-dim`): `dim` float32
    zeros as one flat tensor."""

    def build() -> tuple[tuple[TensorSpec, ...], np.ndarray]:
        return flat_layout(dim), np.zeros(dim, dtype=np.float32)

    return build


def _model_dim(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_MODEL_DIM:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of elements in "
                                         f"1..{MAX_MODEL_DIM}")
    return value


def _pause_at(text: str) -> tuple[int, str]:
    match = _PAUSE_AT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not ROUND:PHASE with PHASE one of {', '.join(PHASES)}")
    return int(match.group(1)), match.group(2)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def flag_parser() -> argparse.ArgumentParser:
    """The instrumentation flags, read before the `medfed` command line they sit in."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.instrumented", add_help=False, allow_abbrev=False,
        description="test instrumentation (these flags sit anywhere in the command line)")
    parser.add_argument("--model-dim", type=_model_dim, metavar="D",
                        help="coordinator serve: a zero-initialised flat model of D "
                        "elements and no study (sites: bench.transport_site)")
    parser.add_argument("--debug-write-aggregates", action="store_true",
                        help="coordinator serve: write each round's unmasked ring sum "
                        f"under STATE/{AGGREGATES_DIR}")
    parser.add_argument("--debug-write-updates", action="store_true",
                        help="site run: write each round's ring update before masking "
                        f"under STATE/{UPDATES_DIR}")
    parser.add_argument("--debug-pause-after", type=_pause_at, metavar="ROUND:PHASE",
                        help=f"site run: pause after this phase ({', '.join(PHASES)}) of "
                        "this round")
    parser.add_argument("--debug-pause-seconds", type=_seconds,
                        default=DEFAULT_PAUSE_SECONDS, metavar="SECONDS",
                        help="site run: pause length (default %(default)s)")
    return parser


def _command(words: Sequence[str]) -> tuple[str, ...]:
    """The command and action typed (`site run`), as far as they are there."""
    return tuple(word for word in words if not word.startswith("-"))[:2]


def main(
    argv: Sequence[str] | None = None, *,
    hook_factory: Callable[[SiteSettings], TrainingHook] | None = None,
) -> int:
    """`medfed` with the coordinator and site commands instrumented by the flags above;
    `hook_factory`: the sites' training double, if any (`bench.transport_site`)."""
    words = list(sys.argv[1:] if argv is None else argv)
    flags = flag_parser()
    if "-h" in words or "--help" in words:
        flags.print_help()
        print()
    known, rest = flags.parse_known_args(words)
    command = _command(rest)
    site_flags = (known.debug_write_updates or known.debug_pause_after is not None
                  or "--debug-pause-seconds" in words)
    if known.debug_write_aggregates and command != ("coordinator", "serve"):
        flags.error("--debug-write-aggregates is a flag of `coordinator serve`")
    if known.model_dim is not None and command != ("coordinator", "serve"):
        flags.error("--model-dim is a flag of `coordinator serve`")
    if site_flags and command != ("site", "run"):
        flags.error("--debug-write-updates and --debug-pause-* are flags of `site run`")
    factory: ObserverFactory = partial(
        Instrumentation, write_aggregates=known.debug_write_aggregates,
        write_updates=known.debug_write_updates, pause_after=known.debug_pause_after,
        pause_seconds=known.debug_pause_seconds)
    return main_with([
        partial(coordinator_cli.register, observer_factory=factory,
                model_without_study=(flat_model(known.model_dim)
                                     if known.model_dim is not None else None)),
        partial(site_cli.register, hook_factory=hook_factory, observer_factory=factory),
    ], rest)


if __name__ == "__main__":
    sys.exit(main())
