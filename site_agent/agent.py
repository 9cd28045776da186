"""The site agent's client loop: enrol, wait for rounds, train, run SecAgg+, repeat.

Dials out only. Every round announcement is checked against this site's own policy
before anything is computed; the privacy ledger is consulted before training and
written before the update leaves the site; the SecAgg+ client verifies every
signature and aborts (sending nothing more) whenever the coordinator misbehaves.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import random
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from common import egress, wire
from common.codec import (
    ChunkAssembler,
    bytes_to_flat,
    digest,
    iter_chunks,
    layout_bytes,
)
from common.config import SiteSettings
from common.crypto.random import numpy_generator, system_random
from common.crypto.signing import SigningKey, VerifyingKey
from common.errors import (
    AbortReason,
    BudgetExhausted,
    CertificateRejected,
    ConfigError,
    CryptoError,
    FederationFinished,
    ProtocolAbort,
    RoundFailed,
    ValidationError,
)
from common.pki import (
    check_issued_by,
    check_validity_window,
    load_certificate,
    parse_certificate,
    site_id_from_certificate,
)
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.round import VerifiedRound, validate_for_site
from common.secagg import messages as sm
from common.secagg.client import SecAggClient
from common.tls import SiteTlsFiles, channel_credentials_from_files
from site_agent import dp_release
from site_agent.hooks import LocalUpdate, TrainingHook
from site_agent.metrics import SiteMetrics

log = logging.getLogger("medfed.site")

AGENT_VERSION = "medfed-site/0.1"
WAIT_SECONDS = 30
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
# Ledger purposes released within a round (the cohort count has its own numbering).
ROUND_PURPOSES = (dp_release.PURPOSE_TRAINING, dp_release.PURPOSE_EVALUATION)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class SiteAgent:
    def __init__(
        self,
        settings: SiteSettings,
        hook: TrainingHook,
        *,
        metrics: SiteMetrics,
        ledger: PrivacyLedger | None,
        stop: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.site_id = settings.site
        self.hook = hook
        self.metrics = metrics
        self.ledger = ledger
        self.stop = stop or threading.Event()
        ca, cert, key = settings.tls_paths()
        self.tls_files = SiteTlsFiles(ca=ca, cert=cert, key=key)
        self.credentials = channel_credentials_from_files(self.tls_files)
        # The coordinator knows us by the id in our certificate; a different `site`
        # setting would make every announcement look as if it left us out.
        certified = site_id_from_certificate(load_certificate(cert))
        if certified != self.site_id:
            raise ConfigError(
                "site", f"is {self.site_id!r} but certificate {cert} names site {certified!r}"
            )
        self.signing_key = SigningKey.from_pem(key.read_bytes())
        # Roster certificates are checked against our own copy of the federation CA;
        # revocation is enforced by the coordinator (hospitals get no CRL).
        self.ca_cert = load_certificate(ca)
        self.last_round = 0
        self.rounds_done = 0
        self._declined_for_budget = False
        self._backoff = settings.reconnect.initial_backoff_seconds
        self._replica_seq = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.FederationStub | None = None

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
        """Serve rounds until the federation finishes (0) or we are told to stop."""
        while not self.stop.is_set():
            try:
                self._session()
                return 0
            except FederationFinished:
                log.info("federation finished after round %d", self.last_round)
                return 0
            except grpc.RpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    log.error("coordinator refused our certificate: %s", exc.details())
                    return 3
                log.warning("connection problem (%s): %s; reconnecting", code, exc.details())
                self.metrics.connected.set(0)
                self._disconnect()
                self._sleep_backoff()
        return 0

    def _session(self) -> None:
        stub = self._connect()
        resp = stub.Enroll(
            pb.EnrollRequest(
                agent_version=AGENT_VERSION, budget=self.budget_pb(), device=self.hook.device
            ),
            timeout=30,
        )
        self.metrics.connected.set(1)
        self._backoff = self.settings.reconnect.initial_backoff_seconds
        log.info("enrolled in federation %s", resp.federation_id)
        self._replica_seq = resp.ledger_seq_held
        while not self.stop.is_set():
            self._replicate(stub)
            waited = stub.WaitForRound(
                pb.WaitForRoundRequest(
                    wait_seconds=WAIT_SECONDS, after_round=self.last_round, budget=self.budget_pb()
                ),
                timeout=WAIT_SECONDS + 15,
            )
            if waited.federation_finished:
                raise FederationFinished("done")
            if not waited.has_round:
                continue
            self._take_part(stub, waited.round)
            limit = self.settings.exit_after_rounds
            if limit is not None and self.rounds_done >= limit:
                return

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
        self.last_round = max(self.last_round, ann.round)
        try:
            rnd = validate_for_site(
                wire.announcement_from_pb(ann), policy=self.settings.policy, site_id=self.site_id
            )
            self._run_round(stub, rnd)
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
    def _run_round(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> None:
        segments = self.hook.planned_segments(rnd.plan)
        evaluation = self._evaluation_mechanisms(rnd)
        if self.ledger is not None and (segments or evaluation):
            # The ledger's reserve() is idempotent per round number (a crash-restart
            # must not double-charge), so a second training for a round number already
            # on the ledger would release a fresh noisy update at no recorded cost: a
            # coordinator re-announcing a round could average the DP noise away.
            if any(entry.round == rnd.number and entry.purpose in ROUND_PURPOSES
                   for entry in self.ledger.entries()):
                raise RoundFailed(
                    f"round {rnd.number} is already on this site's privacy ledger: "
                    "refusing to release a second update for it"
                )
            after = self.ledger.preview(rnd.number, [*segments, *evaluation])
            if after > self.ledger.budget_epsilon:
                raise BudgetExhausted(
                    f"round {rnd.number} would bring epsilon to {after:.3f} "
                    f"> budget {self.ledger.budget_epsilon:g}"
                )
        client = self._secagg_client(rnd) if rnd.announcement.secure_aggregation else None
        try:
            # Keys first (two short barriers), then download and train: uploads then
            # overlap other sites' training, as they would in plain FedAvg.
            keys = self._exchange_keys(stub, rnd, client) if client is not None else None
            global_flat = self._download(stub, rnd)
            if self.ledger is not None and segments:
                # Write-ahead: the spend is on disk before any update can leave the site.
                self.ledger.reserve(rnd.number, segments, now=_utcnow())
            if self.ledger is not None and evaluation:
                self.ledger.reserve(rnd.number, evaluation, now=_utcnow(),
                                    purpose=dp_release.PURPOSE_EVALUATION)
            if self.ledger is not None and (segments or evaluation):
                self.budget_pb()
            started = time.perf_counter()
            update = self._private_histogram(rnd, self.hook.train(rnd.plan, global_flat),
                                             evaluated=bool(evaluation))
            self.metrics.training_seconds.observe(time.perf_counter() - started)
            self.metrics.samples_used.set(update.num_samples)
            self.metrics.patients_used.set(update.patients)
            vector = self._encode(rnd, update)
            if self.settings.debug_write_updates:
                self._write_debug(rnd.number, vector)
            if client is not None and keys is not None:
                self._finish_secure_aggregation(stub, rnd, client, keys, vector)
            else:
                stub.UploadMaskedInput(
                    self._upload_stream(rnd, b"", vector),
                    timeout=self._deadline(rnd, training=True),
                )
        except BaseException:
            if client is not None:
                client.abort()  # nothing more is ever revealed for this round
            raise
        self.rounds_done += 1
        self.metrics.rounds.labels(outcome="completed").inc()
        log.info("round %d done", rnd.number)

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

    def _download(self, stub: pb_grpc.FederationStub, rnd: VerifiedRound) -> np.ndarray:
        total = layout_bytes(rnd.plan.layout)
        if total != rnd.announcement.model_bytes:
            raise ValidationError("announced model size does not match its layout")
        buffer = bytearray(total)
        assembler = ChunkAssembler(buffer, total_bytes=total, max_chunk_bytes=4 << 20)
        for chunk in stub.DownloadModel(pb.DownloadModelRequest(round=rnd.number), timeout=300):
            assembler.add(chunk.offset, chunk.data)
        assembler.finish()
        if digest(buffer) != rnd.announcement.model_sha256:
            raise ValidationError("downloaded model does not match the announced SHA-256")
        return bytes_to_flat(buffer, rnd.plan.layout)

    def _encode(self, rnd: VerifiedRound, update: LocalUpdate) -> np.ndarray:
        """The upload, built from the round's egress manifest (common.egress): the
        segments listed there and nothing else."""
        n_sites = len(rnd.params.participants) if rnd.params else 2
        manifest = rnd.announcement.manifest()
        if update.delta.size != manifest.slice_of(egress.MODEL_UPDATE).stop:
            raise RoundFailed("update does not match the model size")
        if not np.all(np.isfinite(update.delta)):
            raise RoundFailed("update contains NaN or infinity")
        weight = min(int(update.num_samples), rnd.announcement.weight_cap)
        # Scale by n_k / cap so FedAvg's weights come out of the secure sum.
        scaled = update.delta * np.float32(weight / rnd.announcement.weight_cap)
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
        vector.astype("<u4").tofile(folder / f"round-{round_number:06d}.u32")

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
        """The key a roster entry must be signed with: from a certificate that chains to
        OUR copy of the federation CA and names that site (a coordinator cannot swap
        in keys of its own)."""
        cert = parse_certificate(certificate_der)
        now = _utcnow()
        check_issued_by(cert, self.ca_cert, what=f"certificate of {site_id}")
        check_validity_window(cert, now, what=f"certificate of {site_id}")
        if site_id_from_certificate(cert) != site_id:
            raise CertificateRejected(f"roster certificate does not name {site_id}")
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
        )

    def _exchange_keys(
        self, stub: pb_grpc.FederationStub, rnd: VerifiedRound, client: SecAggClient
    ) -> sm.SharesForRecipient:
        """AdvertiseKeys and ShareKeys: returns the encrypted shares addressed to us."""
        adv = client.advertise_keys()
        roster_pb = stub.AdvertiseKeys(
            wire.advertise_to_pb(adv, round_number=rnd.number, nonce=rnd.announcement.round_nonce),
            timeout=self._deadline(rnd),
        )
        self._debug_pause(rnd.number, "advertise_keys")
        shares_out = client.receive_roster(wire.roster_from_pb(roster_pb))
        received = stub.ShareKeys(
            wire.share_keys_to_pb(
                shares_out, round_number=rnd.number, session=client.session_id
            ),
            timeout=self._deadline(rnd),
        )
        self._debug_pause(rnd.number, "share_keys")
        return wire.shares_for_recipient_from_pb(received)

    def _finish_secure_aggregation(
        self,
        stub: pb_grpc.FederationStub,
        rnd: VerifiedRound,
        client: SecAggClient,
        shares: sm.SharesForRecipient,
        vector: np.ndarray,
    ) -> None:
        """MaskedInput, ConsistencyCheck and Unmask."""
        session = client.session_id
        masked = client.receive_shares(shares, vector)
        survivors_pb = stub.UploadMaskedInput(
            self._upload_stream(rnd, session, masked.vector),
            timeout=self._deadline(rnd, training=True),
        )
        self._debug_pause(rnd.number, "masked_input")
        signature = client.receive_survivors(wire.survivors_from_pb(survivors_pb))
        sigs_pb = stub.ConsistencyCheck(
            pb.ConsistencyCheckRequest(
                round=rnd.number, session_id=session, signature=signature.signature
            ),
            timeout=self._deadline(rnd),
        )
        self._debug_pause(rnd.number, "consistency_check")
        reveal = client.receive_consistency(wire.signatures_from_pb(sigs_pb))
        result = stub.Unmask(
            wire.unmask_to_pb(reveal, round_number=rnd.number, session=session),
            timeout=self._deadline(rnd),
        )
        client.complete()
        log.info("round %d unmasked: %d contributors", rnd.number, result.contributors)
