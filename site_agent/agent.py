"""The site agent's client loop: enrol, wait for rounds, take part, repeat.

Dials out only. Every round announcement is checked against this site's own policy
before anything is computed; the privacy ledger is consulted before training and
written before the update leaves the site; the SecAgg+ client verifies every
signature and aborts (sending nothing more) whenever the coordinator misbehaves.

`SiteAgent` composes the parts, each in its module: the line to the coordinator and
its backoff (connection), enrolment, the study joined, the CRL and the ledger's
replication (membership), the SecAgg+ phases (phases), model rounds (training_round),
the statistics and evaluation releases (releases), the model-sized transfers
(transfers) and the final model (final_model). What is left here is the loop and how
each round's outcome is answered.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from common.core.config import SiteSettings
from common.core.errors import (
    STUDY_FAILED_PREFIX,
    BudgetExhausted,
    CertificateRejected,
    ConfigError,
    CryptoError,
    EvaluationsUsed,
    FederationFinished,
    ModelOutOfBounds,
    ProtocolAbort,
    QueryRefused,
    RoundFailed,
    StudyFailed,
    StudyNotApproved,
    StudyRefused,
    ValidationError,
)
from common.core.observer import RoundObserver
from common.crypto.signing import SigningKey
from common.privacy.ledger import PrivacyLedger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.pki import (
    Role,
    load_certificate,
    read_private_key_pem,
    site_id_from_certificate,
)
from common.protocol.tls import TlsFiles
from common.releases.convergence import describe_loss_trend, loss_trend
from common.rounds import wire
from common.rounds.announcement import validate_for_site
from common.study import Study, check_statistics, statistics_from_bytes
from site_agent.connection import RETRYABLE, Connection, Heartbeats
from site_agent.final_model import FinalModel
from site_agent.membership import Membership, utcnow
from site_agent.metrics import SiteMetrics
from site_agent.phases import SecAggPhases
from site_agent.releases import RoundRelease
from site_agent.revocation import SiteRevocation
from site_agent.site_training import TrainingHook
from site_agent.statistics_pin import StatisticsPin
from site_agent.training_round import TrainingRound

log = logging.getLogger("medfed.site")

NEXT_STUDY_POLL_SECONDS = 60.0
WAIT_SECONDS = 30
STOP_CHECK_SECONDS = 0.2
"""How often a site waiting for a round checks whether it was told to stop: the
coordinator holds that wait up to WAIT_SECONDS, and SIGTERM (`docker stop` sends SIGKILL
ten seconds later) should not wait that long."""


class SiteAgent:
    def __init__(
        self,
        settings: SiteSettings,
        hook: TrainingHook,
        *,
        metrics: SiteMetrics,
        ledger: PrivacyLedger | None,
        stop: threading.Event | None = None,
        open_ledger: Callable[[], PrivacyLedger | None] | None = None,
        observer: RoundObserver | None = None,
    ) -> None:
        """`observer`: what a test plugs in to watch the rounds (`common.core.observer`)."""
        self.settings = settings
        self.site_id = settings.site
        self.hook = hook
        self.metrics = metrics
        self.stop = stop or threading.Event()
        ca, cert, key = settings.tls_paths()
        # The coordinator knows us by the id in our certificate; a different `site`
        # setting would make every announcement look as if it left us out.
        own_cert = load_certificate(cert)
        certified = site_id_from_certificate(own_cert)
        if certified != self.site_id:
            raise ConfigError(
                "site", f"is {self.site_id!r} but certificate {cert} names site {certified!r}"
            )
        files = TlsFiles(role=Role.SITE, ca=ca, cert=cert, key=key)
        self.connection = Connection(settings, files, stop=self.stop)
        # PkiError (refused at start-up) if group or others can read the key.
        signing_key = SigningKey.from_pem(read_private_key_pem(key))
        ca_cert = load_certificate(ca)
        metrics.observe_certificates(own=own_cert, ca=ca_cert)
        self.membership = Membership(settings, hook, metrics=metrics, ca_cert=ca_cert,
                                     ledger=ledger, open_ledger=open_ledger)
        self.phases = SecAggPhases(settings, signing_key=signing_key,
                                   identity=self.membership.identity, stop=self.stop,
                                   observer=observer)
        pin = StatisticsPin(settings.state)
        self.statistics_pin = pin
        self.rounds = TrainingRound(settings, hook, membership=self.membership,
                                    phases=self.phases, metrics=metrics)
        self.releases = RoundRelease(settings, hook, membership=self.membership,
                                     phases=self.phases, metrics=metrics, pin=pin)
        self.final_model = FinalModel(settings, hook, pin)
        self.last_round = 0
        # The coordinator's heartbeat interval while a long-poll is open (its Enroll
        # answer; 0: it expects no beats between rounds).
        self.poll_beat_seconds = 0.0

    # The parts' state, read by operators' tools and tests.
    @property
    def ledger(self) -> PrivacyLedger | None:
        return self.membership.ledger

    @property
    def study(self) -> Study | None:
        return self.membership.study

    @property
    def revocation(self) -> SiteRevocation:
        return self.membership.revocation

    @property
    def losses(self) -> list[float]:
        return self.rounds.losses

    @property
    def rounds_done(self) -> int:
        return self.rounds.rounds_done

    def budget_pb(self) -> pb.BudgetStatus:
        return self.membership.budget_pb()

    # ------------------------------------------------------------------- loop
    def run(self) -> int:
        """Serve rounds until the federation finishes (0) or we are told to stop.

        With a study, the final model is stored first; then `once` exits 0, otherwise the
        agent stays up and enrols again for the next study."""
        while not self.stop.is_set():
            try:
                self._session()
                return 0
            except FederationFinished:
                log.info("federation finished" + (
                    f" after round {self.last_round}" if self.last_round else
                    " before this site took part in a round")
                    + (f"; {describe_loss_trend(self.losses)}" if self.losses else ""),
                    extra={"event": "site_finished", "local_losses": self.losses,
                           "still_improving": loss_trend(self.losses).improving})
                if self.study is None:
                    return 0
                try:
                    self.final_model.store(self.connection.stub(),
                                           self.membership.study_sha256)
                except grpc.RpcError as exc:
                    log.warning("final model download failed (%s): %s; retrying",
                                exc.code(), exc.details())
                    self.connection.close()
                    self.connection.sleep_backoff()
                    continue
                except ValidationError as exc:
                    # The coordinator's final model is refused (malformed, another
                    # study's, not final, too large): no file of it is kept, and the
                    # previous final model stays. `once` ends with the error; a
                    # long-running site stays up for the next study.
                    log.error("final model refused: %s", exc,
                              extra={"event": "final_model_refused", "reason": str(exc)})
                    if self.settings.once:
                        raise
                if self.settings.once:
                    return 0
                log.info("waiting for the next study (run with --once to exit instead)")
                self.connection.close()
                self.stop.wait(NEXT_STUDY_POLL_SECONDS)
            except StudyNotApproved as exc:
                # Nothing was sent for the study. `once` stops with how to approve; a
                # long-running site says it and asks again later, taking up a study
                # approved meanwhile (the pin is re-read at every enrolment).
                log.error("%s", exc, extra={"event": "study_not_approved"})
                if self.settings.once:
                    raise
                self.connection.close()
                self.stop.wait(NEXT_STUDY_POLL_SECONDS)
            except grpc.RpcError as exc:
                if self.stop.is_set():
                    break  # the stop cancelled the call in flight (Connection)
                code = exc.code()
                if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    log.error("coordinator refused our certificate: %s", exc.details())
                    return 3
                details = exc.details() or ""
                if (code == grpc.StatusCode.FAILED_PRECONDITION
                        and details.startswith(STUDY_FAILED_PREFIX)):
                    # The coordinator ended the study unfinished (its sites declined a
                    # round for good): retrying would not change that.
                    failure = StudyFailed(details.removeprefix(STUDY_FAILED_PREFIX))
                    log.error("the coordinator ended the study unfinished: %s",
                              failure.reason,
                              extra={"event": "study_failed", "reason": failure.reason})
                    if self.settings.once:
                        raise failure from None
                    log.info("waiting for the next study (run with --once to exit instead)")
                    self.connection.close()
                    self.stop.wait(NEXT_STUDY_POLL_SECONDS)
                    continue
                self.connection.count_tls_failure(exc)
                log.warning("connection problem (%s): %s; reconnecting", code, exc.details())
                self.metrics.connected.set(0)
                self.connection.close()
                self.connection.sleep_backoff()
        return 0

    def _session(self) -> None:
        stub = self.connection.stub()
        membership = self.membership
        resp = membership.enroll(stub)
        self.metrics.connected.set(1)
        membership.accept_crl(resp.crl_der)
        self.connection.established()
        log.info("enrolled in federation %s", resp.federation_id)
        self.poll_beat_seconds = resp.heartbeat_ms / 1000
        membership.start(stub, resp)
        while not self.stop.is_set():
            membership.replicate(stub)
            waited = self._wait_for_round(stub)
            if waited is None:
                return  # told to stop while no round was running
            membership.accept_crl(waited.crl_der)
            if waited.federation_finished:
                raise FederationFinished("done")
            if not waited.has_round:
                continue
            self._take_part(stub, waited.round)
            limit = self.settings.exit_after_rounds
            if limit is not None and self.rounds_done >= limit:
                membership.replicate(stub)  # leave the replica our latest entries
                return

    def _wait_for_round(self, stub: pb_grpc.FederationStub) -> pb.WaitForRoundResponse | None:
        """The coordinator's long poll for the next round; None once `stop` is set (the
        poll is cancelled: a stop never waits for the coordinator to answer)."""
        beat = self.poll_beat_seconds
        call = stub.WaitForRound.future(
            pb.WaitForRoundRequest(
                wait_seconds=WAIT_SECONDS, after_round=self.last_round,
                budget=self.membership.budget_pb(), heartbeats=beat > 0,
            ),
            timeout=WAIT_SECONDS + 15,
        )
        answered = threading.Event()
        call.add_done_callback(lambda _call: answered.set())
        # While the poll is open the site beats (round 0), so the coordinator tells a
        # waiting site from a frozen or cut-off one (`medfed status`: silent).
        with Heartbeats(stub, 0, beat) if beat > 0 else contextlib.nullcontext():
            while not answered.wait(STOP_CHECK_SECONDS):
                if self.stop.is_set():
                    call.cancel()
                    return None
        reply: pb.WaitForRoundResponse = call.result()
        return reply

    def _take_part(self, stub: pb_grpc.FederationStub, ann: pb.RoundAnnouncement) -> None:
        heard_at = time.perf_counter()
        self.last_round = max(self.last_round, ann.round)
        try:
            rnd = validate_for_site(
                wire.announcement_from_pb(ann), policy=self.settings.policy,
                site_id=self.site_id, study=self.study,
            )
            if rnd.params is not None:
                # Fail closed before anything is computed: without a fresh CRL a revoked
                # certificate could sit in the roster unnoticed.
                self.revocation.require_fresh(now=utcnow())
            announced = rnd.announcement
            if announced.study_sha256 != self.membership.study_sha256:
                raise RoundFailed("the round belongs to another study than the one joined")
            if announced.release:  # a DP release carried alone by its round
                self.releases.run(stub, rnd)
                return
            self.final_model.announced(announced.study_sha256, announced.model_elements)
            if announced.statistics:
                stats = statistics_from_bytes(announced.statistics)
                if self.study is not None:
                    check_statistics(self.study, stats)
                    self.statistics_pin.accept(stats)  # one release per study
                    self.rounds.statistics_arrived(stats)
            self.rounds.run(stub, rnd, heard_at=heard_at)
        except StudyRefused as exc:
            # Never able to take part in this run of the study: tell the coordinator
            # (it logs why and stops waiting for us), then stop with the way out.
            log.error("declining round %d and leaving the study: %s", ann.round, exc)
            self.metrics.rounds.labels(outcome="failed").inc()
            try:
                stub.DeclineRound(
                    pb.DeclineRoundRequest(
                        round=ann.round, reason=pb.DeclineRoundRequest.STATISTICS_RELEASED,
                        budget=self.budget_pb(),
                    ),
                    timeout=30,
                )
            except grpc.RpcError as rpc_exc:
                log.warning("could not tell the coordinator (%s): %s", rpc_exc.code(),
                            rpc_exc.details())
            raise
        except EvaluationsUsed as exc:
            # Waiting does not help: say so (the coordinator ends the study when too
            # few sites are left to answer it), then wait for what it decides.
            log.error("declining round %d: %s", ann.round, exc)
            self.metrics.rounds.labels(outcome="failed").inc()
            stub.DeclineRound(
                pb.DeclineRoundRequest(
                    round=ann.round, reason=pb.DeclineRoundRequest.EVALUATIONS_USED,
                    budget=self.budget_pb(),
                ),
                timeout=30,
            )
        except ModelOutOfBounds as exc:
            # The served model is beyond the study's public bound: a fact about the
            # model, not the data, so the site says why (the coordinator logs it).
            log.error("declining round %d: %s", ann.round, exc,
                      extra={"event": "model_out_of_bounds", "reason": str(exc)})
            self.metrics.rounds.labels(outcome="failed").inc()
            stub.DeclineRound(
                pb.DeclineRoundRequest(
                    round=ann.round, reason=pb.DeclineRoundRequest.MODEL_OUT_OF_BOUNDS,
                    budget=self.budget_pb(),
                ),
                timeout=30,
            )
        except QueryRefused as exc:
            # Not approved, or its allowance used: this query only (not the study).
            log.error("declining round %d: %s", ann.round, exc,
                      extra={"event": "query_refused", "reason": str(exc)})
            self.metrics.rounds.labels(outcome="failed").inc()
            stub.DeclineRound(
                pb.DeclineRoundRequest(
                    round=ann.round, reason=pb.DeclineRoundRequest.QUERY_NOT_APPROVED,
                    budget=self.budget_pb(),
                ),
                timeout=30,
            )
        except BudgetExhausted as exc:
            log.warning("declining round %d: %s", ann.round, exc)
            # A query the budget cannot pay says nothing of the training plan's rounds.
            if not ann.release_payload:
                self.membership.declined_for_budget = True
            self.metrics.rounds.labels(outcome="declined_budget").inc()
            stub.DeclineRound(
                pb.DeclineRoundRequest(
                    round=ann.round,
                    reason=pb.DeclineRoundRequest.BUDGET_EXHAUSTED,
                    budget=self.budget_pb(),
                ),
                timeout=30,
            )
        except ProtocolAbort as exc:
            log.error("round %d aborted: %s", ann.round, exc)
            self.metrics.rounds.labels(outcome="aborted").inc()
        except (RoundFailed, ValidationError, CryptoError, ConfigError,
                CertificateRejected) as exc:
            log.error("round %d failed: %s", ann.round, exc)
            self.metrics.rounds.labels(outcome="failed").inc()
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE or self.stop.is_set():
                raise
            log.warning("round %d ended by coordinator: %s %s", ann.round, exc.code(),
                        exc.details())
            self.metrics.rounds.labels(outcome="aborted").inc()
