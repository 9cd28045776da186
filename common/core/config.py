"""Service configuration: one pydantic settings model per service.

Sources, lowest to highest priority: built-in defaults < TOML file (``--config``) <
environment (``MEDFED_COORDINATOR_*`` / ``MEDFED_SITE_*``, nested with ``__``) <
command-line flags. Validated once at start-up; any problem becomes a `ConfigError`
naming the field (``deadlines.phase_seconds: Input should be greater than 0``).
"""

from __future__ import annotations

import contextvars
import ipaddress
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar

import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from common.core.errors import ConfigError, ValidationError
from common.core.parsing import parse_toml
from common.core.sqldb import parse_database_url

DEFAULT_COUNT_EPSILON: Final = 0.5
"""Epsilon of a site's one DP cohort count (sensitivity 1, Gaussian). 0.5 gives a noise
std of ~7 at delta 1e-5 (~14% of the smallest cohort a site may train, 50 units) and adds
~0.03 to a history near epsilon 7; 0.1 gave ~34, the size of a small site
(docs/privacy.md "The cohort count", `python -m site_agent.count_table`)."""

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):(\d{1,5})$")
SITE_ID_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_TOML_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("toml", default=None)


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 in brackets); port 0 means "any free port"."""
    match = _HOST_PORT.match(value)
    if not match or int(match.group(2)) > 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return match.group(1), int(match.group(2))


def is_loopback_host(host: str) -> bool:
    """Whether HOST (of ``HOST:PORT``) binds loopback only: ``localhost`` or a loopback
    address. Any other name, and the wildcard addresses, may reach beyond this machine."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_nested_delimiter="__")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _TOML_FILE.get()
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


def _check_listen(value: str) -> str:
    parse_host_port(value)
    return value


# --------------------------------------------------------------------------- coordinator


NO_STUDY_MODEL = (
    "a coordinator trains a study, not a model file: draft one with `medfed study init` "
    "and serve it with `coordinator serve --study study.toml` (the study gives the model, "
    "its features and the training settings)"
)


class TrainingPlanSection(_Section):
    local_epochs: int = Field(default=1, ge=1, le=1000)
    learning_rate: float = Field(default=0.1, gt=0, le=10)
    fedprox_mu: float = Field(default=0.0, ge=0, le=100)
    final_evaluation: bool = Field(
        default=False,
        description="after the training rounds, run one evaluation-only round (no privacy cost)",
    )


class AggregationSection(_Section):
    secure_aggregation: bool = True
    clip: float = Field(default=1.0, gt=0, description="update elements clipped to [-clip, clip]")
    histogram_bins: int = Field(default=20, ge=2, le=1000)
    histogram_classes: int = Field(
        default=1,
        ge=1,
        le=500,
        description="K one-vs-rest blocks in the evaluation histogram (a multi-class "
        "study); histogram_bins covers all of them (bins per class x K)",
    )
    weight_cap: int = Field(
        default=1_000_000, ge=1, description="largest sample count a site may weigh in with"
    )
    threshold: int | Literal["auto"] = "auto"
    neighbours: int | Literal["auto"] = "auto"
    max_colluding_sites: int = Field(default=1, ge=0)
    max_dropouts: int | Literal["auto"] = "auto"
    # Hospital-level DP without a study (`medfed demo --privacy-unit hospital`):
    # each site's whole update clipped to L2 <= hospital_clip_norm, the secure sum noised
    # with std hospital_noise_multiplier * clip by the sites. A study's privacy section
    # (unit = "hospital") takes precedence.
    hospital_clip_norm: float | None = Field(default=None, gt=0)
    hospital_noise_multiplier: float | None = Field(default=None, gt=0, le=1000)


SERVER_OPTIMIZERS: Final = ("fedavg", "fedadam", "fedyogi")
"""The coordinator's server optimizers, by name (`coordinator.optimizers.BUILDERS` builds
each): a new one is its class and builder there and its name here."""


def _known_server_optimizer(name: str) -> str:
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(
            f"unknown server optimizer {name!r}; one of {', '.join(SERVER_OPTIMIZERS)}"
        )
    return name


ServerOptimizerName = Annotated[str, AfterValidator(_known_server_optimizer)]
"""A field naming a server optimizer (the study's and the coordinator config's)."""


class OptimizerSection(_Section):
    name: ServerOptimizerName = "fedavg"
    server_lr: float = Field(default=1.0, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.99, ge=0, lt=1)
    tau: float = Field(default=1e-3, gt=0)


class DeadlineSection(_Section):
    selection_seconds: float = Field(
        default=5.0, gt=0, description="how long to wait for more sites once min_sites are ready"
    )
    train_seconds: float = Field(default=600.0, gt=0)
    phase_seconds: float = Field(default=60.0, gt=0)
    round_start_timeout_seconds: float = Field(
        default=3600.0, gt=0, description="give up waiting for min_sites after this long"
    )
    heartbeat_seconds: float = Field(
        default=5.0, ge=0.2, le=300,
        description="interval of the sites' heartbeats while they take part in a round",
    )
    heartbeat_misses: int = Field(
        default=3, ge=2, le=100,
        description="drop a site silent (no heartbeat, no message) for this many intervals "
        "from the phase it is expected in, as a missed deadline would",
    )


MESSAGE_OVERHEAD_BYTES: Final = 64 << 10
"""Room above `limits.max_chunk_bytes` in the largest request message gRPC accepts
(an upload chunk's framing, a ledger history's certificates)."""


class LimitsSection(_Section):
    max_concurrent_uploads: int = Field(default=2, ge=1, le=64)
    max_chunk_bytes: int = Field(default=4 << 20, ge=1 << 16, le=4 << 20)
    max_sites: int = Field(default=1000, ge=2)
    upload_spool_bytes: int = Field(
        default=16 << 20,
        ge=0,
        description="uploads larger than this are staged in a temporary file under STATE "
        "instead of memory (0: always)",
    )
    upload_idle_seconds: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="cut a masked-input upload that sends no chunk for this long (slow "
        "loris): its staging slot is freed and the site is dropped from that phase",
    )
    max_calls_per_site: int = Field(
        default=16,
        ge=8,
        le=10_000,
        description="calls one site certificate may have in flight at once; one more is "
        "refused with RESOURCE_EXHAUSTED. An honest agent holds at most 7 (a long poll "
        "and its replacement, a heartbeat, a model download, a phase call, an upload, a "
        "ledger replication)",
    )
    max_request_bytes_per_site: int = Field(
        default=16 << 20,
        ge=MESSAGE_OVERHEAD_BYTES + (1 << 16),
        le=1 << 36,
        description="bytes of parsed requests one site may have in flight at once; one "
        "more is refused with RESOURCE_EXHAUSTED. At least one largest message "
        "(max_chunk_bytes + 64 KiB), or an honest site's ledger replication is refused",
    )
    max_request_bytes: int = Field(
        default=256 << 20,
        ge=MESSAGE_OVERHEAD_BYTES + (1 << 16),
        le=1 << 40,
        description="bytes of parsed requests of all sites in flight at once (the "
        "coordinator's memory budget for parsing); at least max_request_bytes_per_site",
    )

    @property
    def max_message_bytes(self) -> int:
        """The largest request message gRPC accepts (`grpc.max_receive_message_length`)."""
        return self.max_chunk_bytes + MESSAGE_OVERHEAD_BYTES

    @model_validator(mode="after")
    def _shares_hold_a_message(self) -> LimitsSection:
        if self.max_request_bytes_per_site < self.max_message_bytes:
            raise ValueError(
                f"max_request_bytes_per_site ({self.max_request_bytes_per_site}) is below "
                f"one largest message, max_chunk_bytes + 64 KiB ({self.max_message_bytes}): "
                "a site's upload chunk or ledger replication would always be refused"
            )
        if self.max_request_bytes < self.max_request_bytes_per_site:
            raise ValueError(
                f"max_request_bytes ({self.max_request_bytes}) is below "
                f"max_request_bytes_per_site ({self.max_request_bytes_per_site}): the "
                "coordinator's budget must hold at least one site's share"
            )
        return self


class CheckpointSection(_Section):
    keep: int = Field(
        default=3,
        ge=1,
        le=1_000_000,
        description="checkpoint files kept on disk (the newest; the one the state database "
        "resumes from is never deleted)",
    )


class CoordinatorSettings(_Settings):
    """Settings of `medfed coordinator serve`."""

    model_config = SettingsConfigDict(
        env_prefix="MEDFED_COORDINATOR_",
        extra="forbid",
        frozen=True,
        env_nested_delimiter="__",
    )

    pki: Path = Field(description="folder with ca.crt, crl.pem, coordinator.crt/.key")
    listen: str = "0.0.0.0:7443"  # public gRPC port (mTLS)
    metrics_listen: str = "127.0.0.1:9464"
    metrics_tls: bool | Literal["auto"] = Field(
        default="auto",
        description="/metrics over HTTPS with the coordinator's certificate, answering only "
        "a monitor certificate of the federation (checked against ca.crt and crl.pem, as "
        "the gRPC port checks its callers): auto = whenever metrics_listen is not a "
        "loopback address; true = always; false = plain HTTP, which beyond loopback is "
        "an explicit choice the coordinator warns about at start-up",
    )
    state: Path = Field(description="folder for the state database and checkpoints")
    database_url: str | None = Field(
        default=None,
        # A PostgreSQL URL may carry a password: keep it out of repr() and tracebacks.
        repr=False,
        description="sqlite:///path or postgresql://...; default STATE/coordinator.db",
    )
    database_outage_seconds: float = Field(
        default=300.0, gt=0, le=86_400,
        description="PostgreSQL: how long the coordinator rides out a lost state database "
        "(a restart, a failover; the round in flight is abandoned, then retried with "
        "backoff) before it stops with an error naming the database",
    )
    federation_id: str = Field(default="medfed", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    rounds: int = Field(default=10, ge=1, le=1_000_000)
    min_sites: int = Field(default=3, ge=2)
    study: Path | None = Field(
        default=None,
        description="study.toml: the model, features and training settings (rounds, "
        "local epochs, learning rate, FedProx, server optimizer, histogram bins) come "
        "from it; this file keeps operational settings only",
    )
    initial_model: Path | None = Field(
        default=None,
        description="the study's untrained network as `medfed model init` wrote it, for a "
        "coordinator without torch (the coordinator image); default: built here",
    )
    training: TrainingPlanSection = TrainingPlanSection()
    aggregation: AggregationSection = AggregationSection()
    optimizer: OptimizerSection = OptimizerSection()
    deadlines: DeadlineSection = DeadlineSection()
    limits: LimitsSection = LimitsSection()
    checkpoints: CheckpointSection = CheckpointSection()
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = Field(
        default="json", description="json: one object per line (log shippers); text: for people"
    )

    _listen = field_validator("listen", "metrics_listen")(_check_listen)

    @property
    def metrics_over_tls(self) -> bool:
        """Whether /metrics is served over HTTPS (`metrics_tls`; auto: beyond loopback)."""
        if self.metrics_tls == "auto":
            return not is_loopback_host(parse_host_port(self.metrics_listen)[0])
        return bool(self.metrics_tls)

    @model_validator(mode="after")
    def _initial_model_of_a_study(self) -> CoordinatorSettings:
        if self.initial_model is not None and self.study is None:
            raise ValueError("initial_model is the untrained network of a study: serve "
                             "one with --study study.toml")
        return self

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        """Refuse a mistyped scheme at start-up, not at the first database access."""
        if value is not None:
            try:
                parse_database_url(value)
            except ConfigError as exc:
                raise ValueError(exc.message) from None
        return value


# --------------------------------------------------------------------------- site agent


class PrivacySection(_Section):
    budget_epsilon: float = Field(default=8.0, gt=0, le=100)
    delta: float = Field(default=1e-5, gt=0, lt=1)
    accountant: Literal["prv", "rdp"] = "prv"
    max_grad_norm: float = Field(default=1.0, gt=0)
    # The weakest privacy unit this site accepts from a study ("auto": any).
    privacy_unit: Literal["auto", "record", "patient", "hospital"] = "auto"
    # The cohort size leaves the site only as ONE DP count (Gaussian, sens. 1).
    # The most this site spends on it: a study declares the value every site spends and
    # is refused above this (docs/privacy.md).
    count_epsilon: float = Field(default=DEFAULT_COUNT_EPSILON, gt=0, le=100)
    # The least noise std per summed count of an evaluation histogram this site accepts.
    # The study sets the noise every member adds ([privacy.evaluation] noise_std, bound
    # into every round), so a peer's settings cannot lower what this site's ledger
    # records; a study asking less than this is refused when the site receives it.
    evaluation_noise_std: float | None = Field(
        default=None, ge=1.0, le=1e6,
        description="the least noise std per summed evaluation count this site accepts: "
        "a study whose [privacy.evaluation] noise_std is smaller is refused at enrolment "
        "(the study's value is the noise every member adds); unset: the study's",
    )
    # A folder (ideally on another volume or machine) where the site keeps a signed
    # receipt of its ledger head after every commit: a lost state folder then cannot be
    # restored from a truncated export (docs/privacy.md, "Head receipts").
    receipts_dir: Path | None = None


STUDY_NAMES_IT = (
    "the study names the columns, labels, missing-value policies and model ([data], "
    "[[features]] and [model] of study.toml, sent by the coordinator at enrolment); remove "
    "it from this site's settings"
)


def _refuse_study_fields(data: Any, fields: tuple[str, ...]) -> Any:
    """A site setting that only a study may declare: refused with where it now lives."""
    if isinstance(data, Mapping):
        given = [name for name in fields if name in data]
        if given:
            raise ValueError(f"{', '.join(given)}: {STUDY_NAMES_IT}")
    return data


class SiteDataSection(_Section):
    """Where this site's records are and how it holds some out; what they contain is
    the study's (common/study/schema.py `DataSection`, `FeatureSpec`)."""

    path: Path | None = Field(
        default=None, description="CSV or Parquet file of this site, or an images study's "
        "folder with labels.csv"
    )
    holdout_fraction: float = Field(
        default=0.2, gt=0, lt=1,
        description="share of patients held out for evaluation; each patient's side comes "
        "from a keyed hash of its id under the site's secret split key (STATE/site-split.key)",
    )

    @model_validator(mode="before")
    @classmethod
    def _study_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "split_seed" in data:
            raise ValueError(
                "split_seed: the held-out split is no longer seeded; each patient's side "
                "comes from a keyed hash under the site's secret key (STATE/site-split.key, "
                "made on first start: one re-split of an existing site); remove split_seed"
            )
        return _refuse_study_fields(data, (
            "features", "label_column", "patient_column", "nan_policy", "synthetic",
            "synthetic_cohort_seed", "synthetic_patients",
        ))


STUDY_DECIDES: Final = {
    "batch_size": "[training] batch_size",
    "optimizer": "[training] local_optimizer",
}
"""Site training settings the study decides: refused with the study field that does."""


def parse_memory_size(value: object) -> int:
    """Bytes of a size such as 512MiB, 4GiB, 2GB or a plain number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a size (e.g. 512MiB, 4GiB)")
    if isinstance(value, int):
        size = value
    else:
        units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
                 "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
        cleaned = value.strip().lower().replace(" ", "")
        number, factor = cleaned, 1
        for suffix, scale in units.items():
            if cleaned.endswith(suffix):
                number, factor = cleaned[: -len(suffix)], scale
                break
        try:
            size = int(float(number) * factor)
        except ValueError:
            raise ValueError(f"{value!r} is not a size (e.g. 512MiB, 4GiB)") from None
    if size < 1:
        raise ValueError(f"must be positive, got {value!r}")
    return size


class LocalTrainingSection(_Section):
    trainer: Literal["dpsgd", "nonprivate"] = "dpsgd"
    max_physical_batch_size: int | None = Field(
        default=None, ge=1,
        description="records per forward/backward pass; unset: the most that `memory_budget` "
        "holds for the study's model and DP path (at most 1024)",
    )
    memory_budget: int | None = Field(
        default=None,
        description="memory one training step may use, e.g. \"4GiB\" (CPU RAM, or GPU memory "
        "when training on a GPU); unset: a quarter of the RAM or half the GPU's memory",
    )
    grad_sample_mode: Literal["auto", "ghost", "hooks"] = "auto"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    seed: int | None = Field(
        default=None,
        description="TESTS ONLY: fixed seed for Poisson sampling and DP noise; default draws "
        "a fresh seed from the OS CSPRNG (predictable noise would void the DP guarantee)",
    )

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _memory_size(cls, value: object) -> int | None:
        return None if value is None else parse_memory_size(value)

    @model_validator(mode="before")
    @classmethod
    def _study_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            decided = {name: field for name, field in STUDY_DECIDES.items() if name in data}
            if decided:
                raise ValueError("; ".join(
                    f"training.{name}: every site trains by the study's {field} (study.toml, "
                    "sent by the coordinator at enrolment); remove it from this site's settings"
                    for name, field in decided.items()
                ))
        return _refuse_study_fields(data, ("model",))


DEFAULT_MAX_EVALUATIONS: Final = 100
"""A site's default `policy.max_evaluations`: room for the default study (10 training
rounds + 1 final evaluation round) several times over on one ledger; every evaluation is
still charged to the site's epsilon budget."""

DEFAULT_MAX_INTERMEDIARIES: Final = 8
"""A site's default `policy.max_intermediaries`: the cap of `intermediaries = "auto"`
(`common.privacy.hospital.MAX_AUTO_INTERMEDIARIES`; a test keeps the two equal)."""


class SitePolicySection(_Section):
    """What this site accepts from a coordinator (checked on every round announcement)."""

    min_threshold: int = Field(default=2, ge=2)
    max_colluding_sites: int = Field(default=1, ge=0)
    # One floor for both uses: rounds (and Unmask) covering fewer sites than
    # max(min_round_sites, max_colluding_sites + 2) are refused, and
    # the distributed DP noise is planned for it minus colluding sites.
    min_round_sites: int = Field(
        default=3,
        ge=2,
        description="refuse secure rounds (and Unmask) covering fewer sites than "
        "max(min_round_sites, max_colluding_sites + 2); distributed noise is planned "
        "for this many sites minus colluders",
    )
    members: dict[str, str] | None = Field(
        default=None,
        description="optional pinning: site id -> hex SHA-256 of its certificate public key "
        "(`medfed pki members`); a roster entry not listed aborts the round",
    )
    allow_open_membership: bool = Field(
        default=False,
        description="join a study that lists no [[members]] while this site pins no "
        "policy.members (then any site certificate the CA signs may be in a round, and a "
        "CA holder can run sybil sites). False (the default, and every shipped config) "
        "refuses such a study at enrolment; true joins it with a warning. A study's "
        "members are always enforced",
    )
    max_vector_length: int = Field(default=1 << 28, ge=1)
    allow_plain_aggregation: bool = Field(
        default=False, description="accept rounds without secure aggregation (benchmarks)"
    )
    allowed_model_factories: tuple[str, ...] = Field(
        default=(),
        description="custom model factories ('package.module:factory') this site will "
        "import and run when a study names one; importing runs that package's code",
    )
    max_intermediaries: int = Field(
        default=DEFAULT_MAX_INTERMEDIARIES, ge=1, le=10_000,
        description="hospital-level studies: the most intermediaries v this site splits "
        "into (a fixed v, or the cap of \"auto\"); the hospital-level epsilon becomes "
        "v-fold group privacy, so 1 keeps it as declared. Checked at enrolment and on "
        "every round",
    )
    # The site plans its own noise: under a study for the study's rounds; without one for
    # this many, raised (never lowered) by an announcement. No round costs more than the cap.
    planned_rounds: int = Field(default=10, ge=1, le=1_000_000)
    max_epsilon_per_round: float | None = Field(default=None, gt=0, le=100)
    max_evaluations: int = Field(
        default=DEFAULT_MAX_EVALUATIONS, ge=0, le=100_000,
        description="DP evaluations (score histograms, each a ledger entry charged to the "
        "budget) this site's ledger may record, ever. A study asking more (its "
        "privacy.evaluation.max_evaluations: one per training round plus the final "
        "evaluation round) is refused at enrolment",
    )

    @field_validator("members")
    @classmethod
    def _check_members(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("an empty member list would refuse every round; omit it instead")
        site = re.compile(SITE_ID_PATTERN)
        fingerprint = re.compile(r"^[0-9a-f]{64}$")
        for site_id, digest in value.items():
            if not site.match(site_id):
                raise ValueError(f"invalid site id {site_id!r}")
            if not fingerprint.match(digest):
                raise ValueError(
                    f"{site_id}: expected the hex SHA-256 of its certificate public key"
                )
        return value


class ReconnectSection(_Section):
    initial_backoff_seconds: float = Field(default=0.5, gt=0)
    max_backoff_seconds: float = Field(default=30.0, gt=0)
    # A TLS handshake that keeps failing (another CA, an expired certificate) does not
    # heal by retrying: give up after this many consecutive failures.
    max_tls_failures: int = Field(default=5, ge=1)


class SiteSettings(_Settings):
    """Settings of `medfed site run`."""

    model_config = SettingsConfigDict(
        env_prefix="MEDFED_SITE_", extra="forbid", frozen=True, env_nested_delimiter="__"
    )

    pki: Path | None = Field(default=None, description="folder with ca.crt and sites/SITE.crt/.key")
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    site: str = Field(pattern=SITE_ID_PATTERN)
    coordinator: str
    metrics_listen: str = "127.0.0.1:9465"
    state: Path
    privacy: PrivacySection = PrivacySection()
    data: SiteDataSection = SiteDataSection()
    training: LocalTrainingSection = LocalTrainingSection()
    policy: SitePolicySection = SitePolicySection()
    reconnect: ReconnectSection = ReconnectSection()
    study_file: Path | None = Field(
        default=None,
        description="study.toml this site agreed to: `site run` starts only when it is "
        "the study approved under the state folder (`medfed site approve`); the site "
        "joins that study and no other",
    )
    study_sha256: str | None = Field(
        default=None,
        description="SHA-256 of the study this hospital's privacy officer approved, as "
        "`medfed site approve` prints it: `site approve --config` pins only a study file "
        "with this hash, and `site run` starts only when it is the approved study",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = Field(
        default="json", description="json: one object per line (log shippers); text: for people"
    )
    exit_after_rounds: int | None = Field(default=None, ge=1)
    once: bool = Field(
        default=False,
        description="exit 0 once the study's final model is stored; otherwise stay up for "
        "the next study",
    )

    _listen = field_validator("coordinator", "metrics_listen")(_check_listen)

    @field_validator("study_sha256", mode="before")
    @classmethod
    def _study_sha256(cls, value: object) -> object:
        # Empty is unset: a compose file passes `${MEDFED_STUDY_SHA256:-}` through.
        if value is None or value == "":
            return None
        if not isinstance(value, str) or re.fullmatch(r"[0-9a-f]{64}", value) is None:
            raise ValueError("expected the SHA-256 of the study this hospital approved, 64 "
                             f"lower-case hex digits as `medfed site approve` prints it; got "
                             f"{value!r}")
        return value

    @model_validator(mode="after")
    def _tls_files(self) -> SiteSettings:
        explicit = (self.tls_ca, self.tls_cert, self.tls_key)
        if self.pki is None and not all(explicit):
            raise ValueError("set pki, or all of tls_ca, tls_cert and tls_key")
        return self

    def tls_paths(self) -> tuple[Path, Path, Path]:
        """(ca, cert, key): explicit files win over the PKI folder layout."""
        base = self.pki
        ca = self.tls_ca or (base / "ca.crt" if base else None)
        cert = self.tls_cert or (base / "sites" / f"{self.site}.crt" if base else None)
        key = self.tls_key or (base / "sites" / f"{self.site}.key" if base else None)
        if ca is None or cert is None or key is None:
            raise ConfigError("pki", "no TLS files configured")
        return ca, cert, key


SettingsT = TypeVar("SettingsT", bound=_Settings)


def _drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            nested = _drop_none(value)
            if nested:
                out[key] = nested
        elif value is not None:
            out[key] = value
    return out


_TEST_INSTRUMENTATION = (
    "test instrumentation, no longer a setting of medfed: remove it from this config "
    "(no configuration makes a service write updates or sums to disk or pause; tests "
    "and benchmarks pass it as a flag of `python -m bench.instrumented`)"
)
REMOVED_SETTINGS = {
    "debug_write_aggregates": _TEST_INSTRUMENTATION,
    "debug_write_updates": _TEST_INSTRUMENTATION,
    "debug_pause_after": _TEST_INSTRUMENTATION,
    "debug_pause_seconds": _TEST_INSTRUMENTATION,
    # `[model] dim` (a flat model without a study) and `[model] init_file`.
    "model": NO_STUDY_MODEL + "; the flat model of transport tests and benchmarks is "
    "test instrumentation (`python -m bench.instrumented coordinator serve --model-dim N`)",
}
"""Settings an older config may still name, and why each is refused."""


def load_settings(
    cls: type[SettingsT], *, config_file: Path | None = None, overrides: Mapping[str, Any]
) -> SettingsT:
    """Build settings from defaults, TOML, environment and flags; errors name the field."""
    if config_file is not None and not config_file.is_file():
        raise ConfigError("config", f"config file {config_file} does not exist")
    if config_file is not None:
        # Parsed here first, by the one parser that answers hostile nesting with an
        # error (common.core.parsing), before pydantic-settings reads it with tomllib.
        try:
            parse_toml(config_file.read_bytes())
        except ValidationError as exc:
            raise ConfigError("config", f"{config_file} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError("config", f"cannot read {config_file}: {exc.strerror}") from None
    token = _TOML_FILE.set(config_file)
    try:
        return cls(**_drop_none(overrides))
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            if err["type"] == "extra_forbidden" and field in REMOVED_SETTINGS:
                problems.append((field, REMOVED_SETTINGS[field]))
                continue
            # Our validators raise ValueError; pydantic prefixes their text with noise.
            problems.append((field, err["msg"].removeprefix("Value error, ")))
        first_field, first_message = problems[0]
        rest = "".join(f"; {f}: {m}" for f, m in problems[1:])
        raise ConfigError(first_field, first_message + rest) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{config_file} is not valid TOML: {exc}") from None
    except (ValueError, OSError) as exc:
        where = f"{config_file}: " if config_file is not None else ""
        raise ConfigError("config", f"{where}{exc}") from None
    finally:
        _TOML_FILE.reset(token)
