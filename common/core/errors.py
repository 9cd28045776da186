"""The one exception hierarchy of medfed.

::

    MedfedError                      base of everything medfed raises on purpose
    ├── ConfigError                  bad configuration or flag; names the field
    │   └── StudyNotApproved         the coordinator serves a study this site's state
    │                                has not approved (`medfed site approve`)
    ├── DataError                    bad site data; names file, row and column
    ├── ValidationError              a malformed message at a trust boundary
    │                                (servicers map it to INVALID_ARGUMENT)
    ├── CryptoError                  EVERY decryption, signature or key-agreement
    │                                failure: one type, no detail an attacker can use
    ├── ProtocolAbort(reason)        the secure-aggregation round must stop;
    │                                `reason` is an `AbortReason`
    ├── PkiError                     certificate or key material problems
    │   └── CertificateRejected      peer certificate not acceptable (expired,
    │                                revoked, wrong CA, no site id)
    ├── PrivacyError
    │   ├── BudgetExhausted          this round would exceed the site's epsilon budget
    │   ├── EvaluationsUsed          the site's evaluation allowance is on its ledger:
    │   │                            it declines an evaluation-only round for good
    │   ├── StudyRefused             this site can never take part in the study the
    │   │                            coordinator runs (its statistics were already
    │   │                            released): it declines and stops
    │   └── LedgerIntegrityError     the hash chain of a ledger does not verify
    │       └── LedgerForkError      a ledger head does not extend the known history
    │                                (fork, shrink, reset)
    ├── StateError                   persisted state is missing or inconsistent
    │   └── LedgerUnavailable        a ledger file is missing, unreadable, read-only
    │                                or damaged; names the file and what to do
    ├── Unauthenticated              the caller presented no certificate at all
    ├── Unavailable                  the coordinator cannot serve now (its round engine
    │   │                            failed); sites retry with backoff
    │   └── DatabaseUnavailable      the connection to the state database is lost (a
    │                                server restart, a failover); the engine retries
    ├── ResourceExhausted            one caller holds too many calls or request bytes
    │                                in flight (RESOURCE_EXHAUSTED); it retries later
    ├── RoundFailed                  this round cannot go on for this site
    ├── FederationFinished           the coordinator ran its whole study
    └── StudyFailed                  the coordinator ended the study unfinished: its
                                     sites declined a round for a reason that cannot
                                     change (budget, evaluations used)

`common.rounds.wire.status_for` translates these to gRPC status codes (one table,
`common.rounds.wire.STATUS_FOR_ERROR`); anything else reaching a servicer is INTERNAL.

What is not in this hierarchy, on purpose:

* a caller's programming error (a non-positive chunk size, a too-small buffer, a window
  below 1) is Python's own ValueError/TypeError; pydantic validators raise ValueError,
  which the settings and study loaders turn into ConfigError / ValidationError;
* one private signal, `common.privacy.accountant._PrvTooCostly`, is raised and caught
  inside the accountant (it falls back to RDP) and never leaves it.

Broad handlers: ``except BaseException`` appears only to clean up (remove a temporary
file, roll back a transaction, tell waiting sites to retry) and re-raise, or to carry a
worker thread's error to the thread that waits for it (the site agent's download
thread). ``except Exception`` appears only at boundaries that must never crash, each
with its reason on the line: the servicers' last-resort mapping to INTERNAL
(coordinator/servicer.py), the TLS interceptor's refusal reporter (common/protocol/tls.py)
and the HTTPS metrics server's (common/protocol/metrics_http.py),
the logging handler (common/core/logs.py) and the command line's last resort
(common/commands/cli.py:
one error record with the cause and exit code 1, never a traceback per log line).
"""

from __future__ import annotations

import enum


class MedfedError(Exception):
    """Base class of every error medfed raises on purpose."""


class ConfigError(MedfedError):
    """Invalid configuration; `field` names the offending setting."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class StudyNotApproved(ConfigError):
    """The study the coordinator serves is not the one this site's state approved (or the
    site approved none): the site sends nothing that depends on it. A `--once` site stops
    with the message (how to approve); a long-running one waits for the approval."""

    def __init__(self, message: str) -> None:
        super().__init__("approved study", message)


class DataError(MedfedError):
    """Invalid site data; names where it is so a data manager can fix it."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        row: int | None = None,
        column: str | None = None,
    ) -> None:
        self.file = file
        self.row = row
        self.column = column
        self.message = message
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)


class ValidationError(MedfedError):
    """A message from another party is malformed (wrong length, range, type)."""


class CryptoError(MedfedError):
    """A decryption, signature or key-agreement check failed.

    Deliberately carries no detail: every such failure looks the same to the caller.
    """

    def __init__(self, message: str = "cryptographic verification failed") -> None:
        super().__init__(message)


class AbortReason(enum.Enum):
    """Why a secure-aggregation round was aborted (client or server side)."""

    TOO_FEW_PARTICIPANTS = "too_few_participants"
    INVALID_PARAMETERS = "invalid_parameters"
    BAD_SIGNATURE = "bad_signature"
    DUPLICATE_PEER = "duplicate_peer"
    UNKNOWN_PEER = "unknown_peer"
    SELF_MISSING = "self_missing"
    SELF_LISTED_AS_DROPPED = "self_listed_as_dropped"
    PEER_BOTH_ALIVE_AND_DROPPED = "peer_both_alive_and_dropped"
    KEY_MISMATCH = "key_mismatch"
    NOT_A_NEIGHBOUR = "not_a_neighbour"
    SURVIVORS_NOT_SUBSET = "survivors_not_subset"
    INCONSISTENT_SURVIVOR_SETS = "inconsistent_survivor_sets"
    DECRYPTION_FAILED = "decryption_failed"
    UNEXPECTED_MESSAGE = "unexpected_message"
    WRONG_ROUND = "wrong_round"
    WRONG_SESSION = "wrong_session"
    WRONG_LENGTH = "wrong_length"
    RECONSTRUCTION_FAILED = "reconstruction_failed"
    ROUND_ABANDONED = "round_abandoned"
    UPLOAD_IDLE = "upload_idle"  # an upload stream sent nothing for too long
    ROUND_TOO_SMALL = "round_too_small"  # fewer sites than this site's floor
    SURVIVORS_BELOW_FLOOR = "survivors_below_floor"  # the sum would cover too few sites
    # A round naming a site that is not a member of the study (or of the site's pinned
    # policy.members), or a member under another key than the one pinned.
    UNKNOWN_MEMBER = "unknown_member"
    REVOKED_PEER = "revoked_peer"  # roster peer's certificate is on the CA's CRL
    NOT_A_SITE = "not_a_site"  # a roster entry's certificate is not a site certificate


class ProtocolAbort(MedfedError):
    """The secure-aggregation round stops; nothing more is revealed."""

    def __init__(self, reason: AbortReason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


class PkiError(MedfedError):
    """Certificate or key material cannot be created, loaded or used."""


class CertificateRejected(PkiError):
    """A peer certificate is not acceptable (expired, revoked, foreign CA, no id)."""


class PrivacyError(MedfedError):
    """Base of privacy-accounting errors."""


class BudgetExhausted(PrivacyError):
    """Training this round would take the site past its epsilon budget."""


class EvaluationsUsed(PrivacyError):
    """An evaluation-only round, and the site's `policy.max_evaluations` DP evaluations
    are already on its ledger: it declines (the reason does not change by waiting)."""


class StudyRefused(PrivacyError):
    """This site can never take part in the coordinator's run of its study: it released
    the study's statistics already (a second release would let the noise be averaged
    away). Unlike a failed round, waiting does not help: the site declines and stops."""


class QueryRefused(PrivacyError):
    """A query round this site will not answer: the query is not one it approved (its
    exact SHA-256, for the study it joined), or it ran as many times as the approval
    allows. It declines with that reason; the coordinator learns nothing else."""


class LedgerIntegrityError(PrivacyError):
    """A ledger's hash chain does not verify: an entry was edited, deleted or moved."""


class LedgerForkError(LedgerIntegrityError):
    """A reported or restored ledger head does not extend the history already known
    (the coordinator's replica or the site's anchor): a fork, a shrink or a reset."""


class StateError(MedfedError):
    """Persisted state is missing or inconsistent."""


class LedgerUnavailable(StateError):
    """A privacy ledger cannot be used as it is (missing, unreadable, read-only, damaged).

    The message names the file and the operator's way out; the site does not start (or
    stops) rather than train on a budget it cannot record."""

    def __init__(self, path: object, message: str) -> None:
        self.path = str(path)
        super().__init__(message)


class Unauthenticated(MedfedError):
    """The caller presented no certificate at all."""


class Unavailable(MedfedError):
    """The coordinator cannot serve now: its round engine stopped on an error.

    Never "finished": sites keep retrying with backoff until a restarted coordinator
    (on the same state) takes the federation up again."""


class DatabaseUnavailable(Unavailable):
    """The state database cannot be reached: its connection was lost (a server restart,
    a failover) and one reconnect failed. Not a wrong statement or a full disk (those
    stay the database's own errors): the round in flight is abandoned and the engine
    retries with backoff, up to `database_outage_seconds`."""


class ResourceExhausted(MedfedError):
    """A caller has more calls or request bytes in flight than its share allows: this
    call is refused at once (RESOURCE_EXHAUSTED), the caller's others go on."""


class RoundFailed(MedfedError):
    """This round cannot go on for this site (the next one may)."""


class ModelOutOfBounds(MedfedError):
    """A global model holds a weight beyond its study's public bound (``[model]
    max_abs_weight``): a site declines the round before training on it (the check reads
    the model and the study only, no data), and names the bound and the weight."""


class FederationFinished(MedfedError):
    """The coordinator ran all its rounds: the study is complete."""


STUDY_FAILED_PREFIX = "study failed: "
"""How a `StudyFailed` reads on the wire (the gRPC details a site's poll receives)."""


class StudyFailed(MedfedError):
    """The coordinator ended the study before its last round: the sites it needs
    declined a round for a reason that cannot change (a spent budget, a used evaluation
    allowance, statistics already released), so re-opening the round would loop.

    Not an outage (`Unavailable`): the coordinator keeps serving status, its polls answer
    FAILED_PRECONDITION with this message, and `site run --once` exits non-zero with it.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(STUDY_FAILED_PREFIX + reason)
