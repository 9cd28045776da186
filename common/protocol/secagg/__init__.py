"""SecAgg+ secure aggregation (Bonawitz et al. 2017; Bell et al. 2020) as pure state
machines over typed messages: no I/O, no clock, randomness passed in.

`SecAggClient` runs at each site, `SecAggServer` at the coordinator; the networked
layers translate protobuf <-> the dataclasses of `messages`.
"""

from common.protocol.secagg.client import PeerStatus, SecAggClient
from common.protocol.secagg.graph import neighbourhoods
from common.protocol.secagg.identity import IdentityVerifier
from common.protocol.secagg.messages import ShareKind
from common.protocol.secagg.params import (
    ANNOUNCEMENT_DIGEST_BYTES,
    DEFAULT_MAX_COLLUDING_SITES,
    DEFAULT_MIN_ROUND_SITES,
    NO_ANNOUNCEMENT_DIGEST,
    SecAggParams,
    ThreatModel,
    choose_parameters,
    round_floor,
    validate_against_threat_model,
)
from common.protocol.secagg.phases import TRANSITIONS, Phase
from common.protocol.secagg.server import SecAggServer, SiteProgress
from common.protocol.secagg.session import session_id

__all__ = [
    "ANNOUNCEMENT_DIGEST_BYTES",
    "DEFAULT_MAX_COLLUDING_SITES",
    "DEFAULT_MIN_ROUND_SITES",
    "NO_ANNOUNCEMENT_DIGEST",
    "TRANSITIONS",
    "IdentityVerifier",
    "PeerStatus",
    "Phase",
    "SecAggClient",
    "SecAggParams",
    "SecAggServer",
    "ShareKind",
    "SiteProgress",
    "ThreatModel",
    "choose_parameters",
    "neighbourhoods",
    "round_floor",
    "session_id",
    "validate_against_threat_model",
]
