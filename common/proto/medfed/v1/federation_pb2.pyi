from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BudgetStatus(_message.Message):
    __slots__ = ("epsilon_budget", "epsilon_spent", "delta", "privacy_unit", "exhausted", "ledger_entries", "ledger_head", "ledger_last_round")
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_UNIT_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_HEAD_FIELD_NUMBER: _ClassVar[int]
    LEDGER_LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    epsilon_budget: float
    epsilon_spent: float
    delta: float
    privacy_unit: str
    exhausted: bool
    ledger_entries: int
    ledger_head: str
    ledger_last_round: int
    def __init__(self, epsilon_budget: _Optional[float] = ..., epsilon_spent: _Optional[float] = ..., delta: _Optional[float] = ..., privacy_unit: _Optional[str] = ..., exhausted: _Optional[bool] = ..., ledger_entries: _Optional[int] = ..., ledger_head: _Optional[str] = ..., ledger_last_round: _Optional[int] = ...) -> None: ...

class EnrollRequest(_message.Message):
    __slots__ = ("agent_version", "budget", "device")
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    budget: BudgetStatus
    device: str
    def __init__(self, agent_version: _Optional[str] = ..., budget: _Optional[_Union[BudgetStatus, _Mapping]] = ..., device: _Optional[str] = ...) -> None: ...

class EnrollResponse(_message.Message):
    __slots__ = ("federation_id", "current_round", "ledger_seq_held", "crl_der", "study", "study_sha256", "heartbeat_ms")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    LEDGER_SEQ_HELD_FIELD_NUMBER: _ClassVar[int]
    CRL_DER_FIELD_NUMBER: _ClassVar[int]
    STUDY_FIELD_NUMBER: _ClassVar[int]
    STUDY_SHA256_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    current_round: int
    ledger_seq_held: int
    crl_der: bytes
    study: bytes
    study_sha256: str
    heartbeat_ms: int
    def __init__(self, federation_id: _Optional[str] = ..., current_round: _Optional[int] = ..., ledger_seq_held: _Optional[int] = ..., crl_der: _Optional[bytes] = ..., study: _Optional[bytes] = ..., study_sha256: _Optional[str] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class ReplicateLedgerRequest(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: bytes
    def __init__(self, history: _Optional[bytes] = ...) -> None: ...

class ReplicateLedgerResponse(_message.Message):
    __slots__ = ("ledger_seq_held",)
    LEDGER_SEQ_HELD_FIELD_NUMBER: _ClassVar[int]
    ledger_seq_held: int
    def __init__(self, ledger_seq_held: _Optional[int] = ...) -> None: ...

class WaitForRoundRequest(_message.Message):
    __slots__ = ("wait_seconds", "after_round", "budget", "heartbeats")
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    wait_seconds: int
    after_round: int
    budget: BudgetStatus
    heartbeats: bool
    def __init__(self, wait_seconds: _Optional[int] = ..., after_round: _Optional[int] = ..., budget: _Optional[_Union[BudgetStatus, _Mapping]] = ..., heartbeats: _Optional[bool] = ...) -> None: ...

class RoundAnnouncement(_message.Message):
    __slots__ = ("round", "round_nonce", "participants", "threshold", "neighbours", "vector_length", "quantization_bits", "clip", "histogram_bins", "secure_aggregation", "model", "model_sha256", "model_bytes", "local_epochs", "learning_rate", "fedprox_mu", "planned_rounds", "train_deadline_ms", "phase_timeout_ms", "weight_cap", "max_chunk_bytes", "heartbeat_ms", "study_sha256", "kind", "statistics", "hospital_noise_multiplier", "hospital_intermediaries", "hospital_norm_segment", "histogram_edges", "release", "release_payload")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TRAINING: _ClassVar[RoundAnnouncement.Kind]
        STATISTICS: _ClassVar[RoundAnnouncement.Kind]
        HOSPITAL: _ClassVar[RoundAnnouncement.Kind]
        RELEASE: _ClassVar[RoundAnnouncement.Kind]
    TRAINING: RoundAnnouncement.Kind
    STATISTICS: RoundAnnouncement.Kind
    HOSPITAL: RoundAnnouncement.Kind
    RELEASE: RoundAnnouncement.Kind
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    VECTOR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_BITS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_BINS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    FEDPROX_MU_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    STUDY_SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    HOSPITAL_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    HOSPITAL_INTERMEDIARIES_FIELD_NUMBER: _ClassVar[int]
    HOSPITAL_NORM_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_EDGES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    round: int
    round_nonce: bytes
    participants: _containers.RepeatedScalarFieldContainer[str]
    threshold: int
    neighbours: int
    vector_length: int
    quantization_bits: int
    clip: float
    histogram_bins: int
    secure_aggregation: bool
    model: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    model_sha256: bytes
    model_bytes: int
    local_epochs: int
    learning_rate: float
    fedprox_mu: float
    planned_rounds: int
    train_deadline_ms: int
    phase_timeout_ms: int
    weight_cap: int
    max_chunk_bytes: int
    heartbeat_ms: int
    study_sha256: bytes
    kind: RoundAnnouncement.Kind
    statistics: bytes
    hospital_noise_multiplier: float
    hospital_intermediaries: int
    hospital_norm_segment: bool
    histogram_edges: _containers.RepeatedScalarFieldContainer[float]
    release: str
    release_payload: bytes
    def __init__(self, round: _Optional[int] = ..., round_nonce: _Optional[bytes] = ..., participants: _Optional[_Iterable[str]] = ..., threshold: _Optional[int] = ..., neighbours: _Optional[int] = ..., vector_length: _Optional[int] = ..., quantization_bits: _Optional[int] = ..., clip: _Optional[float] = ..., histogram_bins: _Optional[int] = ..., secure_aggregation: _Optional[bool] = ..., model: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., model_sha256: _Optional[bytes] = ..., model_bytes: _Optional[int] = ..., local_epochs: _Optional[int] = ..., learning_rate: _Optional[float] = ..., fedprox_mu: _Optional[float] = ..., planned_rounds: _Optional[int] = ..., train_deadline_ms: _Optional[int] = ..., phase_timeout_ms: _Optional[int] = ..., weight_cap: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., study_sha256: _Optional[bytes] = ..., kind: _Optional[_Union[RoundAnnouncement.Kind, str]] = ..., statistics: _Optional[bytes] = ..., hospital_noise_multiplier: _Optional[float] = ..., hospital_intermediaries: _Optional[int] = ..., hospital_norm_segment: _Optional[bool] = ..., histogram_edges: _Optional[_Iterable[float]] = ..., release: _Optional[str] = ..., release_payload: _Optional[bytes] = ...) -> None: ...

class WaitForRoundResponse(_message.Message):
    __slots__ = ("has_round", "round", "federation_finished", "crl_der")
    HAS_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FEDERATION_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CRL_DER_FIELD_NUMBER: _ClassVar[int]
    has_round: bool
    round: RoundAnnouncement
    federation_finished: bool
    crl_der: bytes
    def __init__(self, has_round: _Optional[bool] = ..., round: _Optional[_Union[RoundAnnouncement, _Mapping]] = ..., federation_finished: _Optional[bool] = ..., crl_der: _Optional[bytes] = ...) -> None: ...

class DeclineRoundRequest(_message.Message):
    __slots__ = ("round", "reason", "budget")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[DeclineRoundRequest.Reason]
        BUDGET_EXHAUSTED: _ClassVar[DeclineRoundRequest.Reason]
        NOT_READY: _ClassVar[DeclineRoundRequest.Reason]
        STATISTICS_RELEASED: _ClassVar[DeclineRoundRequest.Reason]
        EVALUATIONS_USED: _ClassVar[DeclineRoundRequest.Reason]
        QUERY_NOT_APPROVED: _ClassVar[DeclineRoundRequest.Reason]
        MODEL_OUT_OF_BOUNDS: _ClassVar[DeclineRoundRequest.Reason]
    REASON_UNSPECIFIED: DeclineRoundRequest.Reason
    BUDGET_EXHAUSTED: DeclineRoundRequest.Reason
    NOT_READY: DeclineRoundRequest.Reason
    STATISTICS_RELEASED: DeclineRoundRequest.Reason
    EVALUATIONS_USED: DeclineRoundRequest.Reason
    QUERY_NOT_APPROVED: DeclineRoundRequest.Reason
    MODEL_OUT_OF_BOUNDS: DeclineRoundRequest.Reason
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    round: int
    reason: DeclineRoundRequest.Reason
    budget: BudgetStatus
    def __init__(self, round: _Optional[int] = ..., reason: _Optional[_Union[DeclineRoundRequest.Reason, str]] = ..., budget: _Optional[_Union[BudgetStatus, _Mapping]] = ...) -> None: ...

class DeclineRoundResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DownloadModelRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AdvertiseKeysRequest(_message.Message):
    __slots__ = ("round", "round_nonce", "encryption_public_key", "masking_public_key", "signature")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_NONCE_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    MASKING_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    round: int
    round_nonce: bytes
    encryption_public_key: bytes
    masking_public_key: bytes
    signature: bytes
    def __init__(self, round: _Optional[int] = ..., round_nonce: _Optional[bytes] = ..., encryption_public_key: _Optional[bytes] = ..., masking_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class RosterEntry(_message.Message):
    __slots__ = ("site_id", "encryption_public_key", "masking_public_key", "signature", "certificate_der")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    MASKING_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_DER_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    encryption_public_key: bytes
    masking_public_key: bytes
    signature: bytes
    certificate_der: bytes
    def __init__(self, site_id: _Optional[str] = ..., encryption_public_key: _Optional[bytes] = ..., masking_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., certificate_der: _Optional[bytes] = ...) -> None: ...

class AdvertiseKeysResponse(_message.Message):
    __slots__ = ("roster",)
    ROSTER_FIELD_NUMBER: _ClassVar[int]
    roster: _containers.RepeatedCompositeFieldContainer[RosterEntry]
    def __init__(self, roster: _Optional[_Iterable[_Union[RosterEntry, _Mapping]]] = ...) -> None: ...

class EncryptedShare(_message.Message):
    __slots__ = ("peer_site_id", "ciphertext")
    PEER_SITE_ID_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    peer_site_id: str
    ciphertext: bytes
    def __init__(self, peer_site_id: _Optional[str] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class ShareKeysRequest(_message.Message):
    __slots__ = ("round", "session_id", "shares", "self_mask_commitment")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    SELF_MASK_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    session_id: bytes
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    self_mask_commitment: bytes
    def __init__(self, round: _Optional[int] = ..., session_id: _Optional[bytes] = ..., shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ..., self_mask_commitment: _Optional[bytes] = ...) -> None: ...

class ShareKeysResponse(_message.Message):
    __slots__ = ("shares",)
    SHARES_FIELD_NUMBER: _ClassVar[int]
    shares: _containers.RepeatedCompositeFieldContainer[EncryptedShare]
    def __init__(self, shares: _Optional[_Iterable[_Union[EncryptedShare, _Mapping]]] = ...) -> None: ...

class MaskedInputHeader(_message.Message):
    __slots__ = ("round", "session_id", "vector_length")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VECTOR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    round: int
    session_id: bytes
    vector_length: int
    def __init__(self, round: _Optional[int] = ..., session_id: _Optional[bytes] = ..., vector_length: _Optional[int] = ...) -> None: ...

class MaskedInputChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: MaskedInputHeader
    chunk: ModelChunk
    def __init__(self, header: _Optional[_Union[MaskedInputHeader, _Mapping]] = ..., chunk: _Optional[_Union[ModelChunk, _Mapping]] = ...) -> None: ...

class MaskedInputResponse(_message.Message):
    __slots__ = ("survivors", "dropped")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class ConsistencyCheckRequest(_message.Message):
    __slots__ = ("round", "session_id", "signature")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    round: int
    session_id: bytes
    signature: bytes
    def __init__(self, round: _Optional[int] = ..., session_id: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SurvivorSignature(_message.Message):
    __slots__ = ("site_id", "signature")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    signature: bytes
    def __init__(self, site_id: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ConsistencyCheckResponse(_message.Message):
    __slots__ = ("signatures",)
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    signatures: _containers.RepeatedCompositeFieldContainer[SurvivorSignature]
    def __init__(self, signatures: _Optional[_Iterable[_Union[SurvivorSignature, _Mapping]]] = ...) -> None: ...

class RevealedShare(_message.Message):
    __slots__ = ("owner_site_id", "kind", "share")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RevealedShare.Kind]
        SELF_MASK_SEED: _ClassVar[RevealedShare.Kind]
        MASKING_KEY: _ClassVar[RevealedShare.Kind]
    KIND_UNSPECIFIED: RevealedShare.Kind
    SELF_MASK_SEED: RevealedShare.Kind
    MASKING_KEY: RevealedShare.Kind
    OWNER_SITE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    owner_site_id: str
    kind: RevealedShare.Kind
    share: bytes
    def __init__(self, owner_site_id: _Optional[str] = ..., kind: _Optional[_Union[RevealedShare.Kind, str]] = ..., share: _Optional[bytes] = ...) -> None: ...

class UnmaskRequest(_message.Message):
    __slots__ = ("round", "session_id", "shares")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    round: int
    session_id: bytes
    shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    def __init__(self, round: _Optional[int] = ..., session_id: _Optional[bytes] = ..., shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ...) -> None: ...

class UnmaskResponse(_message.Message):
    __slots__ = ("completed", "contributors")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    completed: bool
    contributors: int
    def __init__(self, completed: _Optional[bool] = ..., contributors: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteState(_message.Message):
    __slots__ = ("site_id", "state", "last_contact_unix_ms", "epsilon_spent", "epsilon_budget", "privacy_unit")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTACT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_UNIT_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    state: str
    last_contact_unix_ms: int
    epsilon_spent: float
    epsilon_budget: float
    privacy_unit: str
    def __init__(self, site_id: _Optional[str] = ..., state: _Optional[str] = ..., last_contact_unix_ms: _Optional[int] = ..., epsilon_spent: _Optional[float] = ..., epsilon_budget: _Optional[float] = ..., privacy_unit: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("federation_id", "total_rounds", "completed_rounds", "current_round", "phase", "finished", "sites", "eta_seconds", "aborted_rounds", "now_unix_ms", "training_rounds", "evaluation_round", "statistics_round", "current_kind", "auc_round", "auc", "auc_interval_low", "auc_interval_high")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NOW_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_ROUND_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_ROUND_FIELD_NUMBER: _ClassVar[int]
    CURRENT_KIND_FIELD_NUMBER: _ClassVar[int]
    AUC_ROUND_FIELD_NUMBER: _ClassVar[int]
    AUC_FIELD_NUMBER: _ClassVar[int]
    AUC_INTERVAL_LOW_FIELD_NUMBER: _ClassVar[int]
    AUC_INTERVAL_HIGH_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    total_rounds: int
    completed_rounds: int
    current_round: int
    phase: str
    finished: bool
    sites: _containers.RepeatedCompositeFieldContainer[SiteState]
    eta_seconds: float
    aborted_rounds: int
    now_unix_ms: int
    training_rounds: int
    evaluation_round: bool
    statistics_round: str
    current_kind: str
    auc_round: int
    auc: float
    auc_interval_low: float
    auc_interval_high: float
    def __init__(self, federation_id: _Optional[str] = ..., total_rounds: _Optional[int] = ..., completed_rounds: _Optional[int] = ..., current_round: _Optional[int] = ..., phase: _Optional[str] = ..., finished: _Optional[bool] = ..., sites: _Optional[_Iterable[_Union[SiteState, _Mapping]]] = ..., eta_seconds: _Optional[float] = ..., aborted_rounds: _Optional[int] = ..., now_unix_ms: _Optional[int] = ..., training_rounds: _Optional[int] = ..., evaluation_round: _Optional[bool] = ..., statistics_round: _Optional[str] = ..., current_kind: _Optional[str] = ..., auc_round: _Optional[int] = ..., auc: _Optional[float] = ..., auc_interval_low: _Optional[float] = ..., auc_interval_high: _Optional[float] = ...) -> None: ...

class DownloadFinalModelRequest(_message.Message):
    __slots__ = ("study_sha256",)
    STUDY_SHA256_FIELD_NUMBER: _ClassVar[int]
    study_sha256: bytes
    def __init__(self, study_sha256: _Optional[bytes] = ...) -> None: ...
