"""The site agent's client loop: enrol, wait for rounds, train, run SecAgg+, repeat.

Dials out only. Every round announcement is checked against this site's own policy
before anything is computed; the privacy ledger is consulted before training and
written before the update leaves the site; the SecAgg+ client verifies every
signature and aborts (sending nothing more) whenever the coordinator misbehaves.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from common import egress, wire
from common.bundle import (
    HEADER_MARGIN_BYTES,
    bundle_from_bytes,
    bundle_size_limit,
    read_bundle,
)
from common.codec import (
    ChunkAssembler,
    all_finite,
    bytes_to_flat,
    check_finite,
    digest,
    iter_chunks,
    layout_bytes,
)
from common.config import SiteSettings
from common.convergence import describe_loss_trend, loss_trend
from common.crypto.random import numpy_generator, system_random
from common.crypto.signing import SigningKey, VerifyingKey
from common.errors import (
    STUDY_FAILED_PREFIX,
    AbortReason,
    BudgetExhausted,
    CertificateRejected,
    ConfigError,
    CryptoError,
    EvaluationsUsed,
    FederationFinished,
    LedgerForkError,
    MedfedError,
    ProtocolAbort,
    RoundFailed,
    StudyFailed,
    StudyRefused,
    ValidationError,
)
from common.pki import (
    check_roster_certificate,
    load_certificate,
    public_key_fingerprint,
    read_private_key_pem,
    site_id_from_certificate,
)
from common.privacy.accountant import Segment
from common.privacy.ledger import PrivacyLedger, recovery_hint
from common.privacy.mechanisms import Mechanism
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.round import RoundPlan, VerifiedRound, validate_for_site
from common.secagg import messages as sm
from common.secagg import round_floor
from common.secagg.client import SecAggClient
from common.statistics import StatisticsPlan, plan_statistics
from common.study import (
    GlobalStatistics,
    Study,
    check_statistics,
    statistics_from_bytes,
    study_from_enrolment,
    study_sha256,
)
from common.tls import SiteTlsFiles, channel_credentials_from_files, server_host_names
from site_agent import dp_release
from site_agent import hospital as hospital_round
from site_agent.datacheck import site_policy
from site_agent.hooks import LocalUpdate, TrainingHook
from site_agent.metrics import SiteMetrics
from site_agent.revocation import SiteRevocation
from site_agent.round_timeline import RoundTimeline
from site_agent.statistics_pin import RELEASED_WAY_OUT, StatisticsPin

log = logging.getLogger("medfed.site")

AGENT_VERSION = "medfed-site/0.1"
NEXT_STUDY_POLL_SECONDS = 60.0
MAX_BUNDLE_BYTES = 1 << 31
"""The final-model download's bound when this process heard no announcement of the
study and its hook cannot size the study's model (otherwise `bundle_size_limit`)."""
WAIT_SECONDS = 30
STOP_CHECK_SECONDS = 0.2
"""How often a site waiting for a round checks whether it was told to stop: the
coordinator holds that wait up to WAIT_SECONDS, and SIGTERM (`docker stop` sends SIGKILL
ten seconds later) should not wait that long."""
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
HEARTBEAT_FINAL = {
    grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
}
"""Heartbeat answers after which beating on is pointless (the round ended for us, or
the coordinator does not listen for heartbeats)."""
PURPOSE_STATISTICS = "statistics"
# Ledger purposes released within a round (the cohort count has its own numbering).
ROUND_PURPOSES = (dp_release.PURPOSE_TRAINING, dp_release.PURPOSE_EVALUATION,
                  PURPOSE_STATISTICS)
# What gRPC's details say when the TLS handshake itself failed (another CA, an expired or
# revoked certificate, a server name that does not match): retrying does not heal these.
PREMASK_MAX_BYTES = 16 << 20
"""Uploads up to this size have their SecAgg+ masks expanded while ShareKeys is in
flight (one more upload-sized buffer until masking), so masking after training is one
addition; larger ones are masked after training (site memory stays <= 3 models)."""
TLS_FAILURE_MARKERS = ("handshake", "CERTIFICATE_VERIFY_FAILED", "certificate", "tlsv1 alert",
                       "SSL_ERROR", "Hostname Verification", "verification check failed")
HOSTNAME_MISMATCH_MARKER = "hostname verification"
"""gRPC's words when the coordinator's certificate does not name the host dialled."""


def tls_failure(exc: grpc.RpcError) -> str | None:
    """The handshake failure gRPC reports in `exc`, or None if it is not one."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = str(exc.details() or "")
    lowered = details.lower()
    if any(marker.lower() in lowered for marker in TLS_FAILURE_MARKERS):
        return details
    return None


def round_of(number: int, planned: int, *, evaluation: bool = False) -> str:
    """``round number 4 (training; the study plans 3 training rounds)``.

    The number is the coordinator's round number, as `medfed status` shows it beside
    "training round k of N": it also counts the statistics round, aborted rounds and
    earlier studies. A site cannot know k (it may have sat rounds out, and nothing it
    holds marks where the study's training began), so it never writes "k of N"."""
    kind = "final evaluation" if evaluation else "training"
    rounds = "training round" if planned == 1 else "training rounds"
    return f"round number {number} ({kind}; the study plans {planned} {rounds})"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def proc_status_bytes(key: str) -> int:
    """A `kB` field of this process's /proc/self/status (VmRSS, VmHWM) in bytes; 0 where
    there is no procfs. For the memory figures `bench round` reports."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def keep_previous_study_model(path: Path, *, new_study: str) -> Path | None:
    """A final model of ANOTHER study already at `path` (this state folder took part in an
    earlier study) is moved beside it as `study-<its study SHA-256, 16 hex>.safetensors`
    rather than overwritten: `final.safetensors` is the latest study's, the earlier ones
    stay. Returns where it was kept (None: nothing to keep)."""
    if not path.exists():
        return None
    try:
        previous = study_sha256(read_bundle(path).study)
    except (OSError, MedfedError) as exc:
        log.warning("replacing %s, which is not a readable model bundle (%s)", path, exc)
        return None
    if previous == new_study:
        return None
    kept = path.with_name(f"study-{previous[:16]}.safetensors")
    os.replace(path, kept)
    log.info("kept the previous study's final model at %s", kept,
             extra={"event": "previous_final_model_kept", "path": str(kept)})
    return kept


class _ModelDownload:
    """The round's model, downloaded in a worker thread while the key phases run."""

    def __init__(self, agent: SiteAgent, stub: pb_grpc.FederationStub,
                 rnd: VerifiedRound) -> None:
        self._call: grpc.Call | None = None
        self._cancelled = threading.Event()
        self._result: np.ndarray | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(agent, stub, rnd), name="model-download", daemon=True
        )
        self._thread.start()

    def _started(self, call: grpc.Call) -> None:
        self._call = call
        if self._cancelled.is_set():
            call.cancel()

    def _run(self, agent: SiteAgent, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> None:
        try:
            self._result = agent._download(stub, rnd, self._started)
            agent._timeline.mark("downloaded")
        except BaseException as exc:  # re-raised in the caller's thread by result()
            self._error = exc

    def result(self) -> np.ndarray:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._result is None:  # pragma: no cover - _run sets one of the two
            raise RoundFailed("model download ended without a model")
        model, self._result = self._result, None
        return model

    def cancel(self) -> None:
        """The round failed: stop the stream, wait for the thread, drop the model."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join()
        self._result = None


class Heartbeats:
    """Tells the coordinator this site is alive, every `interval` seconds from a
    background thread, while the site downloads, plans its noise, trains and encodes:
    otherwise a frozen or cut-off site would hold the round until its deadline."""

    def __init__(self, stub: pb_grpc.FederationStub, round_number: int, interval: float) -> None:
        self.stub = stub
        self.round_number = round_number
        self.interval = interval
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"heartbeat-{round_number}", daemon=True
        )

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.done.set()

    def _run(self) -> None:
        # Fixed rate: a slow call does not push every later beat back.
        due = time.monotonic()
        while not self.done.is_set():
            try:
                self.stub.Heartbeat(
                    pb.HeartbeatRequest(round=self.round_number), timeout=self.interval
                )
            except grpc.RpcError as exc:
                if exc.code() in HEARTBEAT_FINAL:
                    log.info("round %d: heartbeats stop: %s", self.round_number, exc.details())
                    return
                log.debug("round %d: heartbeat failed: %s", self.round_number, exc.code())
            due = max(due + self.interval, time.monotonic())
            self.done.wait(due - time.monotonic())


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
    ) -> None:
        self.settings = settings
        self.site_id = settings.site
        self.hook = hook
        self.metrics = metrics
        self.ledger = ledger
        self._open_ledger = open_ledger
        self.study: Study | None = None
        self.study_sha256 = b""
        self.stop = stop or threading.Event()
        ca, cert, key = settings.tls_paths()
        self.tls_files = SiteTlsFiles(ca=ca, cert=cert, key=key)
        self.credentials = channel_credentials_from_files(self.tls_files)
        # The coordinator knows us by the id in our certificate; a different `site`
        # setting would make every announcement look as if it left us out.
        own_cert = load_certificate(cert)
        certified = site_id_from_certificate(own_cert)
        if certified != self.site_id:
            raise ConfigError(
                "site", f"is {self.site_id!r} but certificate {cert} names site {certified!r}"
            )
        # PkiError (refused at start-up) if group or others can read the key.
        self.signing_key = SigningKey.from_pem(read_private_key_pem(key))
        # Roster certificates are checked against our own copy of the federation CA,
        # and against the CA's CRL that the coordinator relays (it cannot forge one).
        self.ca_cert = load_certificate(ca)
        self.revocation = SiteRevocation(self.ca_cert)
        metrics.observe_certificates(own=own_cert, ca=self.ca_cert)
        self.last_round = 0
        self.rounds_done = 0
        self._declined_for_budget = False
        self._backoff = settings.reconnect.initial_backoff_seconds
        self._tls_failures = 0
        self._last_update: LocalUpdate | None = None  # for the round's "done" log line
        self._replica_seq = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.FederationStub | None = None
        # Noise calibration runs here, concurrently with the key phases (one at a time:
        # a hook's trainer is not shared between threads).
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise-plan")
        self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        self._pending_statistics: GlobalStatistics | None = None
        self._statistics_pin = StatisticsPin(settings.state)
        # This process's local training loss per round: its trend is logged each round
        # and at the study's end (stays in the site's own log; nothing leaves).
        self.losses: list[float] = []
        self._rss_before_download = 0
        self._timeline = RoundTimeline()  # the round in flight's (bench round reads it)
        # Parameters of the study's model as its latest model round announced them:
        # bounds the final-model download (`_final_model_limit`).
        self._announced_elements: int | None = None

    # ------------------------------------------------------------- connection
    def _connect(self) -> pb_grpc.FederationStub:
        if self._stub is None:
            self._channel = grpc.secure_channel(
                self.settings.coordinator,
                self.credentials,
                options=[
                    ("grpc.max_receive_message_length", 8 << 20),
                    ("grpc.max_send_message_length", 8 << 20),
                    ("grpc.keepalive_time_ms", 30_000),
                    # The coordinator's certificate names its host; tests and single-host
                    # demos dial 127.0.0.1, which the certificate lists as an IP SAN.
                ],
            )
            # The generated stub is untyped; every call on it is checked by the tests.
            self._stub = pb_grpc.FederationStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def _disconnect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def _sleep_backoff(self) -> None:
        """Exponential backoff with full jitter, so restarted coordinators are not
        hammered by every hospital at once."""
        delay = random.uniform(0, self._backoff)  # noqa: S311 - jitter, not a secret
        self._backoff = min(self._backoff * 2, self.settings.reconnect.max_backoff_seconds)
        self.stop.wait(delay)

    def budget_pb(self) -> pb.BudgetStatus:
        status = None
        if self.ledger is not None:
            status = self.ledger.status()
            self.metrics.observe_budget(status.spent_epsilon, status.budget_epsilon)
        # Once the ledger refused a round of the federation's (fixed) plan, every later
        # one would be refused too: say so, and the coordinator stops asking.
        return wire.budget_to_pb(
            status, privacy_unit=self.hook.privacy_unit, exhausted=self._declined_for_budget
        )

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
                    self._store_final_model()
                except grpc.RpcError as exc:
                    log.warning("final model download failed (%s): %s; retrying",
                                exc.code(), exc.details())
                    self._disconnect()
                    self._sleep_backoff()
                    continue
                if self.settings.once:
                    return 0
                log.info("waiting for the next study (run with --once to exit instead)")
                self._disconnect()
                self.stop.wait(NEXT_STUDY_POLL_SECONDS)
            except grpc.RpcError as exc:
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
                    self._disconnect()
                    self.stop.wait(NEXT_STUDY_POLL_SECONDS)
                    continue
                cause = tls_failure(exc)
                self._tls_failures = self._tls_failures + 1 if cause is not None else 0
                if cause is not None and (
                        self._tls_failures >= self.settings.reconnect.max_tls_failures):
                    raise CertificateRejected(
                        f"TLS handshake with coordinator {self.settings.coordinator} failed "
                        f"{self._tls_failures} times in a row, giving up: {cause}. "
                        + self._tls_advice(cause)
                    ) from None
                log.warning("connection problem (%s): %s; reconnecting", code, exc.details())
                self.metrics.connected.set(0)
                self._disconnect()
                self._sleep_backoff()
        return 0

    def _tls_advice(self, cause: str) -> str:
        """What to check after repeated handshake failures; for a name mismatch, the
        names the coordinator's certificate holds (read without checking the name)."""
        address = self.settings.coordinator
        if HOSTNAME_MISMATCH_MARKER not in cause.lower():
            return ("Check that the CA file is this federation's and that this site's "
                    "certificate is valid and not expired")
        host = address.rpartition(":")[0] or address
        names = server_host_names(address, self.tls_files)
        held = (f"holds {', '.join(names)}" if names
                else "could not be read (see `openssl s_client -connect " + address + "`)")
        return (f"The coordinator's certificate does not name {host!r}: it {held}. Dial "
                "the coordinator by one of the names its certificate holds (`--coordinator` "
                "or `coordinator` in site.toml), or ask the operator to re-issue its "
                "certificate with this name (`medfed pki issue --coordinator "
                "HOST1,HOST2 --force`)")

    def _session(self) -> None:
        stub = self._connect()
        resp = self._enroll(stub)
        self.metrics.connected.set(1)
        self._accept_crl(resp.crl_der)
        self._backoff = self.settings.reconnect.initial_backoff_seconds
        self._tls_failures = 0
        log.info("enrolled in federation %s", resp.federation_id)
        self._replica_seq = resp.ledger_seq_held
        if self._join(resp):
            # The ledger opened only now (its privacy unit follows from the study): enrol
            # again with its head, so the coordinator checks it against its replica.
            resp = self._enroll(stub)
            self._replica_seq = resp.ledger_seq_held
        while not self.stop.is_set():
            self._replicate(stub)
            waited = self._wait_for_round(stub)
            if waited is None:
                return  # told to stop while no round was running
            self._accept_crl(waited.crl_der)
            if waited.federation_finished:
                raise FederationFinished("done")
            if not waited.has_round:
                continue
            self._take_part(stub, waited.round)
            limit = self.settings.exit_after_rounds
            if limit is not None and self.rounds_done >= limit:
                self._replicate(stub)  # leave the replica our latest entries
                return

    def _wait_for_round(self, stub: pb_grpc.FederationStub) -> pb.WaitForRoundResponse | None:
        """The coordinator's long poll for the next round; None once `stop` is set (the
        poll is cancelled: a stop never waits for the coordinator to answer)."""
        call = stub.WaitForRound.future(
            pb.WaitForRoundRequest(
                wait_seconds=WAIT_SECONDS, after_round=self.last_round, budget=self.budget_pb()
            ),
            timeout=WAIT_SECONDS + 15,
        )
        answered = threading.Event()
        call.add_done_callback(lambda _call: answered.set())
        while not answered.wait(STOP_CHECK_SECONDS):
            if self.stop.is_set():
                call.cancel()
                return None
        reply: pb.WaitForRoundResponse = call.result()
        return reply

    def _enroll(self, stub: pb_grpc.FederationStub) -> pb.EnrollResponse:
        """Enrol with our budget and ledger head. A refusal of a reported ledger head
        (the coordinator's replica holds more: a reset, shrunk or forked ledger) ends
        the agent with the way out, instead of reconnecting for ever."""
        # Before the study is known the ledger may not be open yet: report no budget at
        # all rather than an empty ledger, which the coordinator's replica rightly
        # refuses as a reset for a site that already spent (a restarted site).
        budget = self.budget_pb() if self.ledger is not None else pb.BudgetStatus()
        try:
            resp: pb.EnrollResponse = stub.Enroll(
                pb.EnrollRequest(
                    agent_version=AGENT_VERSION, budget=budget, device=self.hook.device
                ),
                timeout=30,
            )
        except grpc.RpcError as exc:
            refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            if not refused or self.ledger is None or not budget.ledger_head:
                raise
            path = self.ledger.path
            raise LedgerForkError(
                f"the coordinator refused this site's privacy ledger {path} "
                f"(FAILED_PRECONDITION: {exc.details()}); the site stops rather than spend "
                "a budget it already spent. Move the ledger aside and " + recovery_hint(path)
            ) from None
        return resp

    def _join(self, resp: pb.EnrollResponse) -> bool:
        """Check the coordinator's study against this site's policy and data BEFORE
        any key or update is sent; a mismatch (DataError naming file, row and column, or
        PrivacyError) ends the agent with that message. True when the ledger opened now."""
        study = None
        if resp.study_sha256:
            study = study_from_enrolment(bytes(resp.study), announced_sha256=resp.study_sha256)
            if self.study is not None and study_sha256(self.study) != resp.study_sha256:
                log.info("the coordinator runs a new study: %s", study.study.name)
                self._announced_elements = None
        self.hook.join_study(study, site_policy(self.settings))
        self.study = study
        self.study_sha256 = bytes.fromhex(resp.study_sha256) if study is not None else b""
        if self.ledger is None and self._open_ledger is not None:
            self.ledger = self._open_ledger()
            return self.ledger is not None
        return False

    def _accept_crl(self, der: bytes) -> None:
        self.revocation.offer(der, now=_utcnow())
        if self.revocation.current is not None:
            self.metrics.crl_next_update.set(self.revocation.current.next_update.timestamp())

    def _replicate(self, stub: pb_grpc.FederationStub) -> None:
        """Send the coordinator's replica the signed entries it lacks (parameters only)."""
        if self.ledger is None:
            return
        if len(self.ledger.entries()) <= self._replica_seq:
            return
        history = self.ledger.export(after_seq=self._replica_seq).to_bytes()
        resp = stub.ReplicateLedger(pb.ReplicateLedgerRequest(history=history), timeout=30)
        self._replica_seq = resp.ledger_seq_held

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
                self.revocation.require_fresh(now=_utcnow())
            announced = rnd.announcement
            if announced.study_sha256 != self.study_sha256:
                raise RoundFailed("the round belongs to another study than the one joined")
            if announced.is_statistics:
                self._run_statistics_round(stub, rnd)
                return
            self._announced_elements = announced.model_elements
            if announced.statistics:
                stats = statistics_from_bytes(announced.statistics)
                if self.study is not None:
                    check_statistics(self.study, stats)
                    self._statistics_pin.accept(stats)  # one release per study
                    # Encoding the records and re-planning the noise with them takes
                    # seconds (tens on a loaded machine): it runs beside the key phases
                    # (see _contribute), never before them.
                    self._pending_statistics = stats
            self._run_round(stub, rnd, heard_at=heard_at)
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
        except BudgetExhausted as exc:
            log.warning("declining round %d: %s", ann.round, exc)
            self._declined_for_budget = True
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
            if exc.code() in RETRYABLE:
                raise
            log.warning("round %d ended by coordinator: %s %s", ann.round, exc.code(),
                        exc.details())
            self.metrics.rounds.labels(outcome="aborted").inc()

    # ----------------------------------------------------------------- round
    def _run_round(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, *,
                   heard_at: float | None = None) -> None:
        """Take part in `rnd`, heard of at `heard_at` (perf_counter; default now)."""
        heard_at = time.perf_counter() if heard_at is None else heard_at
        self._timeline = RoundTimeline(heard_at)
        plan = rnd.plan
        what = "evaluation only" if plan.local_epochs == 0 else (
            f"{plan.local_epochs} local epoch(s)")
        log.info("%s: selected with %d sites (%s)",
                 round_of(rnd.number, plan.planned_rounds, evaluation=plan.local_epochs == 0),
                 len(rnd.announcement.participants), what,
                 extra={"event": "round_selected", "round_number": rnd.number,
                        "planned_rounds": plan.planned_rounds})
        self._last_update = None
        hospital_round.require_hospital_round(
            rnd, hospital_mode=bool(getattr(self.hook, "hospital", False)))
        evaluation = self._evaluation_mechanisms(rnd)
        self._refuse_recorded_round(rnd)
        with Heartbeats(stub, rnd.number, rnd.heartbeat_seconds) as heartbeats:
            self._contribute(stub, rnd, evaluation=evaluation, heard_at=heard_at,
                             heartbeats=heartbeats)
        self.rounds_done += 1
        self.metrics.rounds.labels(outcome="completed").inc()
        self._log_done(rnd, self._last_update, extra={
            # Memory of the round's model-sized work (bench round reads these): the
            # process peak against its RSS just before the download.
            "rss_before_download_bytes": self._rss_before_download,
            "peak_rss_bytes": proc_status_bytes("VmHWM"),
            **self._timeline.fields(),
        })

    def _plan_noise(self, plan: RoundPlan, evaluation: list[Mechanism]) -> list[Segment]:
        """The planning thread's job: encode the records with the federation's global
        statistics when a new release arrived, then plan this round's noise (its DP
        evaluation release reserved in every round left)."""
        pending, self._pending_statistics = self._pending_statistics, None
        if pending is not None:
            self.hook.set_statistics(pending)
        return list(self.hook.planned_segments(plan, evaluation=evaluation))

    def _refuse_recorded_round(self, rnd: VerifiedRound) -> None:
        if self.ledger is not None and any(
            entry.round == rnd.number and entry.purpose in ROUND_PURPOSES
            for entry in self.ledger.entries()
        ):
            # The ledger's reserve() is idempotent per round number (a crash-restart
            # must not double-charge), so a second training for a round number already
            # on the ledger would release a fresh noisy update at no recorded cost: a
            # coordinator re-announcing a round could average the DP noise away.
            raise RoundFailed(
                f"round {rnd.number} is already on this site's privacy ledger: "
                "refusing to release a second update for it"
            )

    def _contribute(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, *,
                    evaluation: list[Mechanism], heard_at: float,
                    heartbeats: Heartbeats) -> None:
        client = self._secagg_client(rnd) if rnd.announcement.secure_aggregation else None
        self._rss_before_download = proc_status_bytes("VmRSS")
        download: _ModelDownload | None = None
        try:
            # Keys first (two short barriers, the model downloading meanwhile), then
            # train: uploads then overlap other sites' training, as in plain FedAvg.
            advertisement = client.advertise_keys() if client is not None else None
            # Noise calibration can take tens of seconds on a loaded machine: it starts
            # once our keys exist and runs while they are exchanged (keys reveal nothing
            # about the data), so the key phases never wait for it; training does.
            planning = self._planner.submit(self._plan_noise, rnd.plan, evaluation)
            download = _ModelDownload(self, stub, rnd)
            keys = (
                self._exchange_keys(stub, rnd, client, advertisement, heard_at=heard_at)
                if client is not None and advertisement is not None else None
            )
            # The model downloads while the keys are exchanged (two barriers that
            # wait on the slowest site): neither delays the other.
            global_flat = download.result()
            self._timeline.mark("keys_and_model")
            log.debug("round %d: keys exchanged, model downloaded", rnd.number)
            segments: list[Mechanism] = list(planning.result())
            planned_hospital = None
            if rnd.announcement.is_hospital:
                # Hospital-level DP (issue 13): the DDGauss round joins the training
                # entry, so it too is on the ledger before training starts.
                planned_hospital = hospital_round.plan_round(
                    rnd, study=self.study, policy=self.settings.policy)
                segments = [*segments, planned_hospital.mechanism]
            if self.ledger is not None and (segments or evaluation):
                # Training and evaluation as the ledger will hold them (two entries): a
                # round with DP-SGD beneath hospital-level DP is charged per record.
                after = self.ledger.preview(rnd.number, segments, also=[
                    (dp_release.PURPOSE_EVALUATION, evaluation)] if evaluation else [])
                if after > self.ledger.budget_epsilon:
                    raise BudgetExhausted(
                        f"round {rnd.number} would bring epsilon to {after:.3f} "
                        f"> budget {self.ledger.budget_epsilon:g}"
                    )
            if self.ledger is not None and segments:
                # Write-ahead: the spend is on disk before any update can leave the site.
                self.ledger.reserve(rnd.number, segments, now=_utcnow())
            if self.ledger is not None and evaluation:
                self.ledger.reserve(rnd.number, evaluation, now=_utcnow(),
                                    purpose=dp_release.PURPOSE_EVALUATION)
            if self.ledger is not None and (segments or evaluation):
                self.budget_pb()
            log.info("round %d: training", rnd.number,
                     extra={"event": "training_started", "round_number": rnd.number})
            started = time.perf_counter()
            update = self._private_histogram(rnd, self.hook.train(rnd.plan, global_flat),
                                             evaluated=bool(evaluation))
            self._last_update = update
            self._timeline.mark("trained")
            # The hook keeps what it needs (its model's parameters): our copy of the
            # global model is not needed for encoding, masking or the upload.
            del global_flat
            self.metrics.training_seconds.observe(time.perf_counter() - started)
            self.metrics.samples_used.set(update.num_samples)
            self.metrics.patients_used.set(update.patients)
            choice = getattr(self.hook, "grad_sample_choice", None)
            if choice is not None:
                self.metrics.observe_grad_sample(mode=choice.mode, source=choice.source,
                                                 seconds_per_step=choice.seconds_per_step)
            vector = (self._encode(rnd, update) if planned_hospital is None
                      else hospital_round.encode(rnd, update, planned_hospital))
            self._timeline.mark("encoded")
            log.debug("round %d: update trained and encoded", rnd.number)
            if self.settings.debug_write_updates:
                self._write_debug(rnd.number, vector)
            if client is not None and keys is not None:
                self._finish_secure_aggregation(stub, rnd, client, *keys, vector,
                                                heartbeats=heartbeats)
            else:
                stub.UploadMaskedInput(
                    self._upload_stream(rnd, b"", vector),
                    timeout=self._deadline(rnd, training=True),
                )
                self._timeline.mark("uploaded")
        except BaseException:
            if download is not None:
                download.cancel()
            if client is not None:
                client.abort()  # nothing more is ever revealed for this round
            raise

    def _log_done(self, rnd: VerifiedRound, update: LocalUpdate | None, *,
                  extra: dict[str, object]) -> None:
        """What the ML engineer wants per round: data used, local loss, privacy spent."""
        parts = []
        fields: dict[str, object] = {
            "event": "site_round_done", "round_number": rnd.number,
            "planned_rounds": rnd.plan.planned_rounds,
            "evaluation_only": rnd.plan.local_epochs == 0, **extra,
        }
        if update is None:
            pass
        elif rnd.plan.local_epochs == 0:
            parts.append("evaluated the global model (no training)")
        else:
            records = update.records if update.records is not None else update.num_samples
            used = f"trained on {records} records"
            if update.patients:
                # Under DP the trainer sees the released (noisy) count, not the exact one.
                if getattr(self.hook, "released_units", None) == update.patients:
                    unit = "patients" if self.hook.privacy_unit == "patient" else "units"
                    used += f" (DP count of {unit} ~{update.patients})"
                else:
                    used += f" ({update.patients} patients)"
            parts.append(used)
            if update.loss is not None:
                self.losses.append(update.loss)
                loss = f"local loss {update.loss:.4f}"
                if len(self.losses) > 1:
                    loss += f" ({describe_loss_trend(self.losses)})"
                parts.append(loss)
        if update is not None:
            fields["records"] = (update.records if update.records is not None
                                 else update.num_samples)
            fields["patients"] = update.patients
            if update.loss is not None:
                fields["local_loss"] = update.loss
        if self.ledger is not None:
            status = self.ledger.status()
            parts.append(f"epsilon {status.spent_epsilon:.3f} of {status.budget_epsilon:g} "
                         f"spent (delta {status.delta:g})")
            fields["epsilon_spent"] = status.spent_epsilon
            fields["epsilon_budget"] = status.budget_epsilon
        log.info("%s done: %s", round_of(rnd.number, rnd.plan.planned_rounds,
                                         evaluation=rnd.plan.local_epochs == 0),
                 ", ".join(parts) or "contributed", extra=fields)

    def _run_statistics_round(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> None:
        """The study's federated DP statistics release (common/statistics.py): clipped
        per-unit values, discrete Gaussian noise added here in the integer ring, one
        ledger entry (purpose "statistics") written before anything leaves."""
        study = self.study
        if study is None:
            raise RoundFailed("a statistics round needs a study")
        # A re-announced or second release would let the coordinator average its noise
        # away: the round number must be new on the ledger, the study's statistics unset.
        self._refuse_recorded_round(rnd)
        if self._statistics_pin.pinned(study_sha256(study)) is not None:
            raise StudyRefused(
                "this study's statistics were already released "
                f"({self._statistics_pin.path(study_sha256(study))}): refusing a second "
                "release, so this site cannot take part in this run of the study (a "
                "coordinator that started the study again from a fresh state?) and stops. "
                + RELEASED_WAY_OUT
            )
        release = self.hook.statistics_release()
        if release.size != rnd.announcement.vector_length:
            raise ValidationError("statistics vector length differs from this site's study")
        policy = self.settings.policy
        colluding = policy.max_colluding_sites
        floor = round_floor(min_round_sites=policy.min_round_sites,
                            max_colluding_sites=colluding)
        plan = plan_statistics(study, n_noise=max(floor - colluding, 1))
        mechanism = plan.mechanism()
        if self.ledger is not None:
            after = self.ledger.preview(rnd.number, [mechanism], purpose=PURPOSE_STATISTICS)
            if after > self.ledger.budget_epsilon:
                raise BudgetExhausted(
                    f"the statistics release would bring epsilon to {after:.3f} "
                    f"> budget {self.ledger.budget_epsilon:g}"
                )
        heard_at = time.perf_counter()
        client = self._secagg_client(rnd)
        try:
            with Heartbeats(stub, rnd.number, rnd.heartbeat_seconds) as heartbeats:
                keys = self._exchange_keys(stub, rnd, client, client.advertise_keys(),
                                           heard_at=heard_at)
                self._release_statistics(stub, rnd, client, *keys, release, plan,
                                         heartbeats=heartbeats)
        except BaseException:
            client.abort()
            raise
        self.metrics.rounds.labels(outcome="completed").inc()
        log.info("statistics release (round %d) done: sigma %.2f over %d noise shares",
                 rnd.number, plan.sigma, plan.n_noise)

    def _release_statistics(
        self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, client: SecAggClient,
        keys: sm.SharesForRecipient, premask: Future[None] | None, release: np.ndarray,
        plan: StatisticsPlan, *, heartbeats: Heartbeats,
    ) -> None:
        """Ledger entry first (write-ahead), then the noised vector through SecAgg+."""
        mechanism = plan.mechanism()
        if self.ledger is not None:
            self.ledger.reserve(rnd.number, [mechanism], now=_utcnow(), purpose=PURPOSE_STATISTICS)
            self.budget_pb()
        noisy = release + plan.noise(system_random)
        # Built from the round's egress manifest: one "statistics" segment.
        vector = rnd.announcement.manifest().encode(
            {egress.STATISTICS: noisy}, clip=rnd.announcement.clip,
            bits=rnd.announcement.quantization_bits,
            n_sites=len(rnd.params.participants) if rnd.params else 2,
            rng=numpy_generator(system_random),
        )
        if self.settings.debug_write_updates:
            self._write_debug(rnd.number, vector)
        self._finish_secure_aggregation(stub, rnd, client, keys, premask, vector,
                                        heartbeats=heartbeats)

    def _final_model_limit(self) -> tuple[int, str]:
        """The most bytes the final bundle may have, and why: the announced model's
        float32 parameters plus the bundle's header margin (`bundle_size_limit`)."""
        elements = self._announced_elements
        source = "the announced model"
        layout = getattr(self.hook, "layout", None)
        if elements is None and callable(layout):
            elements = sum(spec.elements for spec in layout())
            source = "the study's model"
        if elements is None:
            return MAX_BUNDLE_BYTES, "no model size known to this site"
        return bundle_size_limit(model_elements=elements), (
            f"{source}: {elements} float32 parameters, plus {HEADER_MARGIN_BYTES} bytes "
            "for the bundle's header"
        )

    def _store_final_model(self) -> None:
        """Download the finished study's final bundle to STATE/model/final.safetensors,
        after checking it is a bundle of the study this site joined.

        Streamed to a temporary file (never held whole in memory), refused as soon as it
        runs past the announced model's size, verified, then renamed into place: a
        refused or broken download leaves the previous file and no temporary one."""
        stub = self._connect()
        limit, why = self._final_model_limit()
        folder = self.settings.state / "model"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "final.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as handle:
                written = 0
                for chunk in stub.DownloadFinalModel(
                    pb.DownloadFinalModelRequest(study_sha256=self.study_sha256), timeout=300
                ):
                    if chunk.offset != written:
                        raise ValidationError("final model chunks out of order")
                    if written + len(chunk.data) > limit:
                        raise ValidationError(
                            f"final model too large: more than {limit} bytes ({why})"
                        )
                    handle.write(chunk.data)
                    digest.update(chunk.data)
                    written += len(chunk.data)
                handle.flush()
                os.fsync(handle.fileno())
            bundle = bundle_from_bytes(tmp.read_bytes())  # verifies its own digest
            if bytes.fromhex(study_sha256(bundle.study)) != self.study_sha256:
                raise ValidationError("the final model belongs to another study")
            if not bundle.final:
                raise ValidationError("the coordinator's final model is not marked final")
            pinned = self._statistics_pin.pinned(study_sha256(bundle.study))
            if pinned is not None and bundle.statistics != pinned:
                raise ValidationError("the final model's statistics differ from the study's "
                                      "released statistics this site trained with")
            keep_previous_study_model(path, new_study=study_sha256(bundle.study))
            # The coordinator's file byte for byte (same SHA-256 at every site).
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        sha = digest.hexdigest()
        log.info("final model stored at %s (sha256 %s)", path, sha,
                 extra={"event": "final_model_stored", "path": str(path)})
        print(json.dumps({"event": "final_model", "path": str(path), "sha256": sha}),
              flush=True)

    def _evaluation_mechanisms(self, rnd: VerifiedRound) -> list[Mechanism]:
        """The ledger record of this round's DP score histogram ([] when the site keeps
        no ledger, or its `max_evaluations` are used up in a training round)."""
        if self.ledger is None:
            return []
        policy = self.settings.policy
        if not dp_release.check_evaluation_allowed(self.ledger, policy):
            if rnd.plan.local_epochs == 0:
                raise dp_release.refuse_evaluation_only(rnd.number)
            return []
        if (rnd.plan.local_epochs > 0 and self.study is not None
                and self.study.training.final_evaluation
                and dp_release.evaluations_used(self.ledger) + 1 >= policy.max_evaluations):
            # The last evaluation this policy allows is kept for the study's final
            # evaluation round (training rounds aborted after their ledger entry use
            # evaluations too): this training round sends an all-zero histogram.
            return []
        ann = rnd.announcement
        return [dp_release.evaluation_mechanism(
            noise_std=self.settings.privacy.evaluation_noise_std,
            n_noise=self._noise_sites(rnd),
            bins=ann.histogram_bins,
            # A multi-class study's histogram has one block per class (hooks.evaluate).
            classes=int(getattr(self.hook, "histogram_classes", 1)),
        )]

    def _noise_sites(self, rnd: VerifiedRound) -> int:
        ann = rnd.announcement
        return dp_release.evaluation_noise_sites(
            self.settings.policy, threshold=ann.threshold, secure=ann.secure_aggregation
        )

    def _private_histogram(
        self, rnd: VerifiedRound, update: LocalUpdate, *, evaluated: bool
    ) -> LocalUpdate:
        """Noise the histogram (its ledger entry is already written), or send zeros when
        this round carries no evaluation; unchanged when the site keeps no ledger."""
        if self.ledger is None:
            return update
        if not evaluated:
            histogram = np.zeros_like(np.asarray(update.histogram, dtype=np.int64))
        else:
            histogram = dp_release.noised_histogram(
                update.histogram,
                noise_std=self.settings.privacy.evaluation_noise_std,
                n_noise=self._noise_sites(rnd),
            )
        return dataclasses.replace(update, histogram=histogram)

    def _deadline(self, rnd: VerifiedRound, *, training: bool = False) -> float:
        """RPC timeout for a long-poll: the phase deadline plus slack."""
        base = rnd.phase_timeout * 2 + 30
        if training:
            base += max(rnd.train_deadline - time.time(), 0)
        return base

    def _download(
        self, stub: pb_grpc.FederationStub, rnd: VerifiedRound,
        started: Callable[[grpc.Call], None] | None = None,
    ) -> np.ndarray:
        total = layout_bytes(rnd.plan.layout)
        if total != rnd.announcement.model_bytes:
            raise ValidationError("announced model size does not match its layout")
        # An all-float32 model is assembled straight into the array training gets (one
        # model-sized buffer, no parse copy); other layouts are converted after.
        direct = all(spec.dtype == "<f4" for spec in rnd.plan.layout)
        buffer: np.ndarray | bytearray = (
            np.empty(total // 4, dtype="<f4") if direct else bytearray(total)
        )
        assembler = ChunkAssembler(buffer, total_bytes=total, max_chunk_bytes=4 << 20)
        stream = stub.DownloadModel(pb.DownloadModelRequest(round=rnd.number), timeout=300)
        if started is not None:
            started(stream)
        for chunk in stream:
            assembler.add(chunk.offset, chunk.data)
        assembler.finish()
        if digest(buffer) != rnd.announcement.model_sha256:
            raise ValidationError("downloaded model does not match the announced SHA-256")
        if isinstance(buffer, bytearray):
            return bytes_to_flat(buffer, rnd.plan.layout)
        check_finite(buffer, rnd.plan.layout)
        return buffer.astype(np.float32, copy=False)

    def _encode(self, rnd: VerifiedRound, update: LocalUpdate) -> np.ndarray:
        """The upload, built from the round's egress manifest (common.egress): the
        segments listed there and nothing else."""
        n_sites = len(rnd.params.participants) if rnd.params else 2
        manifest = rnd.announcement.manifest()
        if update.delta.size != manifest.slice_of(egress.MODEL_UPDATE).stop:
            raise RoundFailed("update does not match the model size")
        if not all_finite(update.delta):
            raise RoundFailed("update contains NaN or infinity")
        weight = min(int(update.num_samples), rnd.announcement.weight_cap)
        # Scale by n_k / cap so FedAvg's weights come out of the secure sum; in place
        # when the hook handed over a writeable delta (no model-sized copy).
        factor = np.float32(weight / rnd.announcement.weight_cap)
        delta = update.delta
        if delta.flags.writeable and delta.dtype in (np.float32, np.float64):
            scaled = np.multiply(delta, factor, out=delta)
        else:
            scaled = delta * factor
        return manifest.encode(
            {
                egress.MODEL_UPDATE: scaled,
                egress.WEIGHT: [weight],
                egress.EVALUATION_HISTOGRAM: np.asarray(update.histogram, dtype=np.int64),
            },
            clip=rnd.announcement.clip,
            bits=rnd.announcement.quantization_bits,
            n_sites=n_sites,
            rng=numpy_generator(system_random),
        )

    def _write_debug(self, round_number: int, vector: np.ndarray) -> None:
        folder = self.settings.state / "debug-updates"
        folder.mkdir(parents=True, exist_ok=True)
        vector.astype("<u4", copy=False).tofile(folder / f"round-{round_number:06d}.u32")

    def _upload_stream(
        self, rnd: VerifiedRound, session: bytes, vector: np.ndarray
    ) -> Iterator[pb.MaskedInputChunk]:
        yield pb.MaskedInputChunk(
            header=pb.MaskedInputHeader(
                round=rnd.number, session_id=session, vector_length=vector.size
            )
        )
        for offset, data in iter_chunks(vector, chunk_bytes=rnd.chunk_bytes):
            yield pb.MaskedInputChunk(chunk=pb.ModelChunk(offset=offset, data=data))

    def _debug_pause(self, round_number: int, phase: str) -> None:
        """TEST ONLY fault injection: stop after a phase so a test can kill -9 us there."""
        if self.settings.debug_pause_after != f"{round_number}:{phase}":
            return
        print(
            json.dumps({"event": "paused", "round": round_number, "phase": phase}), flush=True
        )
        self.stop.wait(self.settings.debug_pause_seconds)

    def _identity(self, site_id: str, certificate_der: bytes) -> VerifyingKey:
        """The key a roster entry must be signed with: from a site certificate that chains
        to OUR copy of the federation CA and names that site (a coordinator cannot swap
        in keys of its own), is not on the CA's CRL and, when this site pins the
        consortium's members, is the pinned one.

        ProtocolAbort NOT_A_SITE / REVOKED_PEER / UNKNOWN_MEMBER end the round."""
        now = _utcnow()
        cert = check_roster_certificate(
            certificate_der, ca_cert=self.ca_cert, now=now, site_id=site_id
        )
        self.revocation.check_peer(site_id, cert, now=now)
        members = self.settings.policy.members
        if members is not None and members.get(site_id) != public_key_fingerprint(cert):
            raise ProtocolAbort(
                AbortReason.UNKNOWN_MEMBER,
                f"roster entry {site_id!r} is not a pinned member of this consortium "
                "(policy.members)",
            )
        return VerifyingKey.from_certificate(cert)

    def _secagg_client(self, rnd: VerifiedRound) -> SecAggClient:
        if rnd.params is None:
            raise ProtocolAbort(AbortReason.INVALID_PARAMETERS, "no SecAgg parameters")
        return SecAggClient(
            rnd.params,
            site_id=self.site_id,
            signing_key=self.signing_key,
            identity=self._identity,
            rng=system_random,
            # This site's own floor (policy), not the library default.
            min_round_sites=self.settings.policy.min_round_sites,
            max_colluding_sites=self.settings.policy.max_colluding_sites,
        )

    def _exchange_keys(
        self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, client: SecAggClient,
        adv: sm.AdvertiseKeys, *, heard_at: float,
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
        self._timeline.mark("advertised")
        roster_pb = stub.AdvertiseKeys(
            wire.advertise_to_pb(adv, round_number=rnd.number, nonce=rnd.announcement.round_nonce),
            timeout=self._deadline(rnd),
        )
        self._timeline.mark("roster")
        self._debug_pause(rnd.number, "advertise_keys")
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
            timeout=self._deadline(rnd),
        )
        self._timeline.mark("shares")
        self._debug_pause(rnd.number, "share_keys")
        return wire.shares_for_recipient_from_pb(received), premask

    def _finish_secure_aggregation(
        self,
        stub: pb_grpc.FederationStub,
        rnd: VerifiedRound,
        client: SecAggClient,
        shares: sm.SharesForRecipient,
        premask: Future[None] | None,
        vector: np.ndarray,
        *,
        heartbeats: Heartbeats,
    ) -> None:
        """MaskedInput, ConsistencyCheck and Unmask."""
        session = client.session_id
        if premask is not None:
            premask.result()  # the masks are ready (or its error is raised here)
        masked = client.receive_shares(shares, vector)
        self._timeline.mark("masked")
        log.debug("round %d: update masked", rnd.number)
        survivors_pb = stub.UploadMaskedInput(
            self._upload_stream(rnd, session, masked.vector),
            timeout=self._deadline(rnd, training=True),
        )
        self._timeline.mark("uploaded")
        log.debug("round %d: masked input uploaded", rnd.number)
        heartbeats.stop()  # the last phases follow at once and keep their deadlines
        self._debug_pause(rnd.number, "masked_input")
        signature = client.receive_survivors(wire.survivors_from_pb(survivors_pb))
        sigs_pb = stub.ConsistencyCheck(
            pb.ConsistencyCheckRequest(
                round=rnd.number, session_id=session, signature=signature.signature
            ),
            timeout=self._deadline(rnd),
        )
        self._timeline.mark("consistency")
        self._debug_pause(rnd.number, "consistency_check")
        reveal = client.receive_consistency(wire.signatures_from_pb(sigs_pb))
        result = stub.Unmask(
            wire.unmask_to_pb(reveal, round_number=rnd.number, session=session),
            timeout=self._deadline(rnd),
        )
        client.complete()
        self._timeline.mark("unmasked")
        log.info("round %d unmasked: %d contributors", rnd.number, result.contributors)
