"""What sites send into the round in flight: each message is checked against the round,
its phase and SecAgg+ session, handed to the round's aggregator, and then long-polls
until its phase closes (`phases.ActiveRound.wait_closed`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from common.core.errors import AbortReason, ProtocolAbort, StateError, ValidationError
from common.protocol.secagg import messages as sm
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.server import SecAggServer
from common.rounds.announcement import Announcement
from coordinator.aggregation import Aggregator, SecureAggregator, aggregator_for
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound, Liveness, PhaseState, RoundPhase
from coordinator.sessions import SiteRegistry
from coordinator.store import CoordinatorStore
from coordinator.uploads import Transfers, iter_model

log = logging.getLogger("medfed.coordinator")


class RoundInbox:
    """The round in flight as the sites see it (one round at a time)."""

    def __init__(
        self, store: CoordinatorStore, sessions: SiteRegistry, transfers: Transfers
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.transfers = transfers
        self.round: ActiveRound | None = None
        self.aggregator: Aggregator | None = None
        # Held while an upload is added to the sum and while a phase closes, so no
        # upload lands in a sum that is being closed.
        self.lock = asyncio.Lock()

    def open(self, rnd: ActiveRound, aggregator: Aggregator) -> None:
        self.round, self.aggregator = rnd, aggregator

    def open_round(
        self, ann: Announcement, model_bytes: bytes | memoryview, *, liveness: Liveness,
        started: float, identity: IdentityVerifier, metrics: CoordinatorMetrics,
        max_colluding_sites: int,
    ) -> tuple[ActiveRound, Aggregator]:
        """The round `ann` announces, with its aggregator, as the one in flight (upload
        slots sized for its vector)."""
        self.transfers.prepare(ann.vector_length)
        rnd = ActiveRound(ann, model_bytes, liveness=liveness, started=started)
        aggregator = aggregator_for(rnd, identity=identity, metrics=metrics,
                                    max_colluding_sites=max_colluding_sites)
        self.open(rnd, aggregator)
        return rnd, aggregator

    def close(self) -> None:
        self.round, self.aggregator = None, None

    def rejoin(self, site_id: str, *, after_round: int) -> ActiveRound | None:
        """The round in flight if `site_id` was chosen for it and may still join."""
        current = self.round
        if current is not None and current.number > after_round and current.can_rejoin(site_id):
            return current
        return None

    def heartbeat(self, site_id: str, round_number: int) -> None:
        """A selected site is alive (phases.ActiveRound.wait_ready drops silent ones).

        A site no longer expected in the phase in flight hears FAILED_PRECONDITION,
        so it can stop beating."""
        rnd = self._round_for(site_id, round_number)
        state = rnd.phases.get(rnd.phase)
        if state is not None and site_id not in state.expected and not state.closed.is_set():
            raise StateError(f"site {site_id} was dropped from round {round_number}")
        rnd.heard_from(site_id)

    def decline(self, site_id: str, round_number: int, *, reason: str = "",
                lasting: bool = False) -> None:
        """`lasting`: the reason cannot change (the engine ends the study when such
        declines leave the round fewer than min_sites)."""
        self._round_for(site_id, round_number).decline(
            site_id, lasting_reason=(reason or "no reason given") if lasting else None)
        log.info("site %s declined round %d%s", site_id, round_number,
                 f": {reason}" if reason else "",
                 extra={"event": "site_declined", "site": site_id,
                        "round_number": round_number, "reason": reason})

    def _round_for(self, site_id: str, round_number: int) -> ActiveRound:
        rnd = self.round
        if rnd is None or rnd.number != round_number:
            if self.store.round_status(round_number) == "abandoned":
                raise ProtocolAbort(
                    AbortReason.ROUND_ABANDONED,
                    f"round {round_number} was abandoned (coordinator restart)",
                )
            raise ProtocolAbort(
                AbortReason.WRONG_ROUND, f"round {round_number} is not the round in flight"
            )
        if site_id not in rnd.announcement.participants:
            raise StateError(f"site {site_id} is not a participant of round {round_number}")
        return rnd

    def _in_phase(self, site_id: str, round_number: int, phase: RoundPhase, *,
                  session_id: bytes | None) -> tuple[ActiveRound, PhaseState, Aggregator]:
        """The round, phase and aggregator a site's `phase` message belongs to (the
        session id is checked unless None)."""
        rnd = self._round_for(site_id, round_number)
        state = rnd.require_phase(phase, site_id)
        aggregator = self.aggregator
        if aggregator is None:
            raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "no round in flight")
        if session_id is not None:
            aggregator.check_session(session_id)
        return rnd, state, aggregator

    def model_chunks(self, site_id: str, round_number: int, chunk_bytes: int) -> Iterator[
        tuple[int, bytes]
    ]:
        """Check the caller now; then copy one chunk at a time (not the whole model)."""
        rnd = self._round_for(site_id, round_number)
        rnd.heard_from(site_id)
        return iter_model(rnd, chunk_bytes)

    def download_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.transfers.download_slot()

    async def _submit(self, site_id: str, round_number: int, phase: RoundPhase,
                      session_id: bytes | None, deliver: Callable[[SecAggServer], None],
                      *, recorded: bool = False) -> Any:
        """Hand a site's SecAgg+ message to the server, then long-poll the phase (and,
        `recorded`, the round's record)."""
        rnd, state, aggregator = self._in_phase(site_id, round_number, phase,
                                                session_id=session_id)
        rnd.heard_from(site_id)
        deliver(_secure(aggregator))
        state.mark(site_id)
        output = await rnd.wait_closed(phase)
        if recorded:
            await rnd.wait_recorded()
        return output

    async def advertise(
        self, site_id: str, round_number: int, nonce: bytes, msg: sm.AdvertiseKeys
    ) -> sm.Roster:
        rnd = self._round_for(site_id, round_number)
        if nonce != rnd.announcement.round_nonce:
            raise ProtocolAbort(AbortReason.WRONG_ROUND, "round nonce does not match")
        rnd.require_phase(RoundPhase.ADVERTISE_KEYS, site_id)
        if msg.site_id != site_id:
            raise ValidationError("advertisement names another site")
        cert = self.sessions.session(site_id).certificate_der
        roster: sm.Roster = await self._submit(
            site_id, round_number, RoundPhase.ADVERTISE_KEYS, None,
            lambda server: server.receive_advertisement(site_id, msg, certificate_der=cert),
        )
        return roster

    async def share_keys(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ShareKeysOut
    ) -> sm.SharesForRecipient:
        per_site: dict[str, sm.SharesForRecipient] = await self._submit(
            site_id, round_number, RoundPhase.SHARE_KEYS, session_id,
            lambda server: server.receive_shares(site_id, msg),
        )
        return per_site.get(site_id, sm.SharesForRecipient(shares=()))

    async def upload(self, site_id: str, round_number: int, session_id: bytes, length: int,
                     chunks: AsyncIterator[tuple[int, bytes]]) -> sm.SurvivorList:
        """Receive one masked (or, in plain rounds, quantized) vector in chunks."""
        rnd, _, aggregator = self._in_phase(
            site_id, round_number, RoundPhase.MASKED_INPUT, session_id=session_id
        )
        rnd.heard_from(site_id)
        if length != rnd.announcement.vector_length:
            raise ProtocolAbort(
                AbortReason.WRONG_LENGTH,
                f"vector of {length} elements, round needs {rnd.announcement.vector_length}",
            )
        await self.transfers.receive(
            rnd, site_id, length, chunks, into=aggregator, lock=self.lock
        )
        log.info("round %d: masked input of %s added", rnd.number, site_id,
                 extra={"event": "masked_input_added", "round_number": rnd.number,
                        "site": site_id})
        survivors: sm.SurvivorList = await rnd.wait_closed(RoundPhase.MASKED_INPUT)
        if not rnd.announcement.secure_aggregation:
            # The last phase of a plain round: answered once the round is recorded.
            await rnd.wait_recorded()
        return survivors

    async def consistency(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.ConsistencySignature
    ) -> sm.ConsistencySignatures:
        sigs: sm.ConsistencySignatures = await self._submit(
            site_id, round_number, RoundPhase.CONSISTENCY_CHECK, session_id,
            lambda server: server.receive_consistency(site_id, msg),
        )
        return sigs

    async def unmask(
        self, site_id: str, round_number: int, session_id: bytes, msg: sm.UnmaskShares
    ) -> int:
        """Answered once the round is recorded as completed (its abort raised when it
        ended otherwise), never when only the share arrived."""
        contributors: int = await self._submit(
            site_id, round_number, RoundPhase.UNMASK, session_id,
            lambda server: server.receive_unmask(site_id, msg), recorded=True,
        )
        return contributors



def _secure(aggregator: Aggregator) -> SecAggServer:
    if not isinstance(aggregator, SecureAggregator):
        raise ProtocolAbort(AbortReason.UNEXPECTED_MESSAGE, "this round is not secure")
    return aggregator.server
