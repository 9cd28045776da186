"""This site's membership of the federation: enrolment with its budget and ledger head,
joining the coordinator's study (checked against the site's own policy and data), the
CA's revocation list the coordinator relays, the roster identity check SecAgg+ makes
for every neighbour, the ledger's replication to the coordinator, and the budget
report sent with every call.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

import grpc
from cryptography import x509

from common.core.config import SiteSettings
from common.core.errors import AbortReason, ConfigError, LedgerForkError, ProtocolAbort
from common.crypto.signing import VerifyingKey
from common.privacy.carry import is_carried
from common.privacy.ledger import PrivacyLedger, ledger_notes, recovery_hint
from common.proto.medfed.v1 import federation_pb2 as pb
from common.proto.medfed.v1 import federation_pb2_grpc as pb_grpc
from common.protocol.pki import check_roster_certificate, public_key_fingerprint
from common.rounds import wire
from common.study import Study, study_from_enrolment, study_sha256
from site_agent.datacheck import site_policy
from site_agent.metrics import SiteMetrics
from site_agent.revocation import SiteRevocation
from site_agent.site_training import TrainingHook
from site_agent.study_gate import check_served

log = logging.getLogger("medfed.site")

AGENT_VERSION = "medfed-site/0.1"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def check_members_listed(study: Study, settings: SiteSettings) -> None:
    """A study without [[members]] lets any certificate the CA signs into a round: refused
    at enrolment (ConfigError naming policy.allow_open_membership, the study and the way
    out) unless this site pins its own policy.members (checked at every roster) or opts
    in with policy.allow_open_membership, which is logged as a warning."""
    if study.members:
        return
    if settings.policy.members is not None:
        log.info(
            "study %r lists no [[members]]; this site's policy.members pins the %d sites "
            "a round may name", study.study.name, len(settings.policy.members),
            extra={"event": "members_pinned_by_site"},
        )
        return
    if not settings.policy.allow_open_membership:
        raise ConfigError(
            "policy.allow_open_membership",
            f"the coordinator's study {study.study.name!r} (sha256 "
            f"{study_sha256(study)[:12]}...) lists no [[members]], so any site certificate "
            "the CA signs could be in its rounds (a CA holder could run sybil sites), and "
            "this site refuses open membership (the default). Ask the coordinator for a "
            "study listing its hospitals' key fingerprints (`medfed study init "
            "--member-from CSR`), or pin them in this site's [policy.members] (`medfed pki "
            "members`), or opt in with policy.allow_open_membership = true",
        )
    log.warning(
        "study %r lists no [[members]]: any site certificate the CA signs may be in a "
        "round (a CA holder could run sybil sites); policy.allow_open_membership = true "
        "lets this site join it", study.study.name,
        extra={"event": "open_membership"},
    )


class Membership:
    """The study joined, the ledger (opened once the study names its privacy unit),
    the revocation list and how far the coordinator's ledger replica reaches."""

    def __init__(
        self,
        settings: SiteSettings,
        hook: TrainingHook,
        *,
        metrics: SiteMetrics,
        ca_cert: x509.Certificate,
        ledger: PrivacyLedger | None,
        open_ledger: Callable[[], PrivacyLedger | None] | None = None,
    ) -> None:
        self.settings = settings
        self.hook = hook
        self.metrics = metrics
        # Roster certificates are checked against our own copy of the federation CA,
        # and against the CA's CRL that the coordinator relays (it cannot forge one).
        self.ca_cert = ca_cert
        self.revocation = SiteRevocation(ca_cert)
        self.ledger = ledger
        self._open_ledger = open_ledger
        self.study: Study | None = None
        self.study_sha256 = b""
        self.replica_seq = 0
        # Once the ledger refused a round of the federation's (fixed) plan, every later
        # one would be refused too: reported, and the coordinator stops asking.
        self.declined_for_budget = False

    # ------------------------------------------------------------------ budget
    def budget_pb(self) -> pb.BudgetStatus:
        """The budget report every call carries (figures only, never data); also
        updates the site's budget gauges."""
        status = None
        if self.ledger is not None:
            status = self.ledger.status()
            self.metrics.observe_budget(status.spent_epsilon, status.budget_epsilon)
        return wire.budget_to_pb(
            status, privacy_unit=self.hook.privacy_unit, exhausted=self.declined_for_budget
        )

    # ----------------------------------------------------------------- enrolment
    def start(self, stub: pb_grpc.FederationStub, resp: pb.EnrollResponse) -> None:
        """After enrolling (`resp`): join the coordinator's study, and enrol again when
        joining opened the ledger, so the coordinator checks its head."""
        self.replica_seq = resp.ledger_seq_held
        if self.join(resp):
            # The ledger opened only now (its privacy unit follows from the study): enrol
            # again with its head, so the coordinator checks it against its replica.
            resp = self.enroll(stub)
            self.replica_seq = resp.ledger_seq_held

    def enroll(self, stub: pb_grpc.FederationStub) -> pb.EnrollResponse:
        """Enrol with our budget and ledger head. A refusal of a reported ledger head
        (the coordinator's replica holds more: a reset, shrunk or forked ledger) ends
        the agent with the way out, instead of reconnecting for ever."""
        # Before the study is known the ledger may not be open yet: report no budget at
        # all rather than an empty ledger, which the coordinator's replica rightly
        # refuses as a reset for a site that already spent (a restarted site).
        budget = self.budget_pb() if self.ledger is not None else pb.BudgetStatus()
        request = pb.EnrollRequest(
            agent_version=AGENT_VERSION, budget=budget, device=self.hook.device
        )
        try:
            resp: pb.EnrollResponse = stub.Enroll(request, timeout=30)
        except grpc.RpcError as exc:
            refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            if not refused or self.ledger is None or not budget.ledger_head:
                raise
            details = exc.details() or ""
            if self._carried():
                # The replica still holds the terms before `medfed ledger carry`: it can
                # check a carry only from the whole new history (entries it receives
                # anyway), after which this head extends it.
                try:
                    self._send_carried_history(stub)
                    resp = stub.Enroll(request, timeout=30)
                except grpc.RpcError as again:
                    if again.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    details = again.details() or ""
                else:
                    return resp
            raise self._refused(details) from None
        return resp

    def _refused(self, details: str) -> LedgerForkError:
        if self.ledger is None:
            return LedgerForkError(f"the coordinator refused this site's privacy ledger "
                                   f"(FAILED_PRECONDITION: {details})")
        path = self.ledger.path
        return LedgerForkError(
            f"the coordinator refused this site's privacy ledger {path} "
            f"(FAILED_PRECONDITION: {details}); the site stops rather than spend "
            "a budget it already spent. Move the ledger aside and " + recovery_hint(path)
        )

    def _carried(self) -> bool:
        """Whether this site's ledger opens with a history carried from older terms."""
        return self.ledger is not None and is_carried(ledger_notes(self.ledger.path))

    def _send_carried_history(self, stub: pb_grpc.FederationStub) -> None:
        """Send the replica this carried ledger's whole signed history (the entries it
        already holds, re-recorded under the new terms, and any after them)."""
        ledger = self.ledger
        if ledger is None:
            return
        history = ledger.export()
        log.info(
            "this site's ledger was carried into new terms: sending its %d signed entries "
            "for the coordinator's replica to check the carry", len(history.entries),
            extra={"event": "ledger_carry_sent", "entries": len(history.entries)},
        )
        resp = stub.ReplicateLedger(
            pb.ReplicateLedgerRequest(history=history.to_bytes()), timeout=30
        )
        self.replica_seq = resp.ledger_seq_held

    def join(self, resp: pb.EnrollResponse) -> bool:
        """Check the coordinator's study against this site's approval, policy and data
        BEFORE any key or update is sent; a mismatch (StudyNotApproved, DataError naming
        file, row and column, or PrivacyError) ends the agent with that message. True
        when the ledger opened now."""
        study = None
        if resp.study_sha256:
            study = study_from_enrolment(bytes(resp.study), announced_sha256=resp.study_sha256)
            if self.study is not None and study_sha256(self.study) != resp.study_sha256:
                log.info("the coordinator runs a new study: %s", study.study.name)
            # Before anything else about the study: the approval (StudyNotApproved).
            check_served(study, self.settings)
            check_members_listed(study, self.settings)
        self.hook.join_study(study, site_policy(self.settings))
        self.study = study
        self.study_sha256 = bytes.fromhex(resp.study_sha256) if study is not None else b""
        if self.ledger is None and self._open_ledger is not None:
            self.ledger = self._open_ledger()
            return self.ledger is not None
        return False

    # ---------------------------------------------------------------- revocation
    def accept_crl(self, der: bytes) -> None:
        self.revocation.offer(der, now=utcnow())
        if self.revocation.current is not None:
            self.metrics.crl_next_update.set(self.revocation.current.next_update.timestamp())

    def identity(self, site_id: str, certificate_der: bytes) -> VerifyingKey:
        """The key a roster entry must be signed with: from a site certificate that chains
        to OUR copy of the federation CA and names that site (a coordinator cannot swap
        in keys of its own), is not on the CA's CRL and, when this site pins the
        consortium's members, is the pinned one.

        ProtocolAbort NOT_A_SITE / REVOKED_PEER / UNKNOWN_MEMBER end the round."""
        now = utcnow()
        cert = check_roster_certificate(
            certificate_der, ca_cert=self.ca_cert, now=now, site_id=site_id
        )
        self.revocation.check_peer(site_id, cert, now=now)
        fingerprint = public_key_fingerprint(cert)
        members = self.settings.policy.members
        if members is not None and members.get(site_id) != fingerprint:
            raise ProtocolAbort(
                AbortReason.UNKNOWN_MEMBER,
                f"roster entry {site_id!r} is not a pinned member of this consortium "
                "(policy.members)",
            )
        study = self.study
        if study is not None and study.members:
            pinned = study.member_fingerprints().get(site_id)
            if pinned != fingerprint:
                what = ("is not a member" if pinned is None
                        else f"holds key {fingerprint[:16]}..., not the member's "
                        f"{pinned[:16]}...")
                raise ProtocolAbort(
                    AbortReason.UNKNOWN_MEMBER,
                    f"roster entry {site_id!r} {what} of study {study.study.name!r} "
                    "(its [[members]]); no share is sent",
                )
        return VerifyingKey.from_certificate(cert)

    # --------------------------------------------------------------- replication
    def replicate(self, stub: pb_grpc.FederationStub) -> None:
        """Send the coordinator's replica the signed entries it lacks (parameters only)."""
        if self.ledger is None:
            return
        if len(self.ledger.entries()) <= self.replica_seq:
            return
        history = self.ledger.export(after_seq=self.replica_seq).to_bytes()
        try:
            resp = stub.ReplicateLedger(pb.ReplicateLedgerRequest(history=history), timeout=30)
        except grpc.RpcError as exc:
            # A carried ledger ahead of the replica's (old-terms) head: the suffix cannot
            # show the carry, the whole history can.
            if (exc.code() != grpc.StatusCode.FAILED_PRECONDITION or self.replica_seq == 0
                    or not self._carried()):
                raise
            try:
                self._send_carried_history(stub)
            except grpc.RpcError as again:
                if again.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                raise self._refused(again.details() or "") from None
            return
        self.replica_seq = resp.ledger_seq_held
