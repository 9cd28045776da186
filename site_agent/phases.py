"""The SecAgg+ phases as a site runs them, for any vector it releases (a model update,
the statistics): AdvertiseKeys and ShareKeys (the masks expanded meanwhile for small
uploads), then MaskedInput, ConsistencyCheck and Unmask. The client
(`common.protocol.secagg.client`) verifies every signature and the roster; a round that fails
here is aborted by the caller and nothing more is revealed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import grpc
import numpy as np

from common.core.config import SiteSettings
from common.core.errors import AbortReason, ProtocolAbort, RoundFailed
from common.core.observer import NoObserver, RoundObserver
from common.crypto.random import system_random
from common.crypto.signing import SigningKey
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.secagg import messages as sm
from common.protocol.secagg.client import SecAggClient
from common.protocol.secagg.identity import IdentityVerifier
from common.rounds import wire
from common.rounds.announcement import VerifiedRound
from site_agent.connection import Heartbeats
from site_agent.round_timeline import RoundTimeline
from site_agent.transfers import upload_stream

log = logging.getLogger("medfed.site")

PREMASK_MAX_BYTES = 16 << 20
"""Uploads up to this size have their SecAgg+ masks expanded while ShareKeys is in
flight (one more upload-sized buffer until masking), so masking after training is one
addition; larger ones are masked after training (site memory stays <= 3 models)."""


def deadline(rnd: VerifiedRound, *, training: bool = False) -> float:
    """RPC timeout for a long-poll: the phase deadline plus slack."""
    base = rnd.phase_timeout * 2 + 30
    if training:
        base += max(rnd.train_deadline - time.time(), 0)
    return base


def confirmed(rnd: VerifiedRound, *, completed: bool, timeline: RoundTimeline) -> None:
    """The coordinator's answer to the round's last call: the round is recorded as
    completed (`completed`), the one fact that lets a site log it as done."""
    if not completed:
        raise RoundFailed(f"round {rnd.number}: the coordinator did not record the round "
                          "as completed")
    timeline.mark("recorded")


class SecAggPhases:
    """This site's side of every SecAgg+ round: its signing key, the roster identity
    check and the thread that expands masks while ShareKeys waits."""

    def __init__(
        self,
        settings: SiteSettings,
        *,
        signing_key: SigningKey,
        identity: IdentityVerifier,
        stop: threading.Event,
        observer: RoundObserver | None = None,
    ) -> None:
        self.settings = settings
        # Shown each update before masking and each phase's end (common.core.observer); the
        # product's watches nothing.
        self.observer = observer or NoObserver()
        self.signing_key = signing_key
        self.identity = identity
        self.stop = stop
        self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")

    def client(self, rnd: VerifiedRound) -> SecAggClient:
        if rnd.params is None:
            raise ProtocolAbort(AbortReason.INVALID_PARAMETERS, "no SecAgg parameters")
        return SecAggClient(
            rnd.params,
            site_id=self.settings.site,
            signing_key=self.signing_key,
            identity=self.identity,
            rng=system_random,
            # This site's own floor (policy), not the library default.
            min_round_sites=self.settings.policy.min_round_sites,
            max_colluding_sites=self.settings.policy.max_colluding_sites,
        )

    def after_phase(self, round_number: int, phase: str) -> None:
        self.observer.after_phase(round_number, phase, stop=self.stop)

    def exchange_keys(
        self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, client: SecAggClient,
        adv: sm.AdvertiseKeys, *, heard_at: float, timeline: RoundTimeline,
    ) -> tuple[sm.SharesForRecipient, Future[None] | None]:
        """AdvertiseKeys (`adv`, built by `client`) and ShareKeys: returns the encrypted
        shares addressed to us, and the job expanding our masks meanwhile (small
        uploads: PREMASK_MAX_BYTES)."""
        seconds = time.perf_counter() - heard_at
        log.info(
            "round %d: advertising keys %.3f s after the announcement", rnd.number, seconds,
            extra={"event": "advertised_keys", "round_number": rnd.number,
                   "seconds": round(seconds, 6)},
        )
        timeline.mark("advertised")
        roster_pb = stub.AdvertiseKeys(
            wire.advertise_to_pb(adv, round_number=rnd.number, nonce=rnd.announcement.round_nonce),
            timeout=deadline(rnd),
        )
        timeline.mark("roster")
        self.after_phase(rnd.number, "advertise_keys")
        shares_out = client.receive_roster(wire.roster_from_pb(roster_pb))
        # While the ShareKeys barrier waits for the slowest site (and the model is
        # downloading), not after training, on the critical path of the round.
        premask = (
            self._masker.submit(client.prepare_masks)
            if rnd.announcement.vector_length * 4 <= PREMASK_MAX_BYTES else None
        )
        received = stub.ShareKeys(
            wire.share_keys_to_pb(
                shares_out, round_number=rnd.number, session=client.session_id
            ),
            timeout=deadline(rnd),
        )
        timeline.mark("shares")
        self.after_phase(rnd.number, "share_keys")
        return wire.shares_for_recipient_from_pb(received), premask

    def finish(
        self,
        stub: pb_grpc.FederationStub,
        rnd: VerifiedRound,
        client: SecAggClient,
        shares: sm.SharesForRecipient,
        premask: Future[None] | None,
        vector: np.ndarray,
        *,
        heartbeats: Heartbeats,
        timeline: RoundTimeline,
    ) -> None:
        """MaskedInput, ConsistencyCheck and Unmask."""
        self.observer.update_before_masking(rnd.number, vector)
        session = client.session_id
        if premask is not None:
            premask.result()  # the masks are ready (or its error is raised here)
        masked = client.receive_shares(shares, vector)
        timeline.mark("masked")
        log.debug("round %d: update masked", rnd.number)
        survivors_pb = stub.UploadMaskedInput(
            upload_stream(rnd, session, masked.vector,
                          after_first_chunk=partial(self.after_phase, rnd.number, "upload")),
            timeout=deadline(rnd, training=True),
        )
        timeline.mark("uploaded")
        log.debug("round %d: masked input uploaded", rnd.number)
        heartbeats.stop()  # the last phases follow at once and keep their deadlines
        self.after_phase(rnd.number, "masked_input")
        signature = client.receive_survivors(wire.survivors_from_pb(survivors_pb))
        sigs_pb = stub.ConsistencyCheck(
            pb.ConsistencyCheckRequest(
                round=rnd.number, session_id=session, signature=signature.signature
            ),
            timeout=deadline(rnd),
        )
        timeline.mark("consistency")
        self.after_phase(rnd.number, "consistency_check")
        reveal = client.receive_consistency(wire.signatures_from_pb(sigs_pb))
        # What the site knows from here on: its shares went out. The coordinator answers
        # only once it recorded the round as completed (its sum decoded and stored).
        log.info("round %d: unmasking shares sent", rnd.number,
                 extra={"event": "round_unmask_sent", "round_number": rnd.number})
        try:
            result = stub.Unmask(
                wire.unmask_to_pb(reveal, round_number=rnd.number, session=session),
                timeout=deadline(rnd),
            )
        except grpc.RpcError as exc:
            log.warning("round %d: the coordinator did not confirm the round (%s): not "
                        "done here; the coordinator's record says whether it completed",
                        rnd.number, exc.code(),
                        extra={"event": "round_unconfirmed", "round_number": rnd.number,
                               "code": exc.code().name})
            raise
        client.complete()
        confirmed(rnd, completed=result.completed, timeline=timeline)
        log.info("round %d recorded by the coordinator: %d contributors", rnd.number,
                 result.contributors)

    def upload_plain(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound,
                     vector: np.ndarray, *, timeline: RoundTimeline) -> None:
        """A round without secure aggregation (the site's policy allows it): the
        vector goes up as it is."""
        self.observer.update_before_masking(rnd.number, vector)
        # Answered once the coordinator recorded the round (an error otherwise).
        stub.UploadMaskedInput(
            upload_stream(rnd, b"", vector), timeout=deadline(rnd, training=True),
        )
        confirmed(rnd, completed=True, timeline=timeline)
