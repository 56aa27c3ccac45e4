"""gputq: a tensor-native data plane for large per-token RL rollout fields.

Rollout side: :class:`Writer` puts each step's fields into StorageUnits and
returns :class:`FieldRef` references; segments are :class:`Layout` s of
references. Trainer side: :class:`Reader` fetches a shard and restores
``rollout_log_probs`` / ``rollout_routed_experts``. :class:`Deployment`
starts the controller and units on Ray.

Only numpy is needed to import this package; Ray, NIXL, CuPy and torch
load when used.
"""

from .clients import UnitClients
from .config import GputqConfig, add_transfer_queue_arguments
from .controller import Controller
from .deploy import Deployment, UnitService
from .errors import (
    AuthenticationError,
    CapacityError,
    ClosedError,
    ConfigError,
    DuplicateKeyError,
    FieldValueError,
    GputqError,
    GputqTimeoutError,
    InvalidInputError,
    LayoutError,
    MissingDependencyError,
    PartialFailureError,
    PeerLostError,
    ProtocolError,
    RequestTooLargeError,
    StaleReadError,
    TransferError,
    UnknownKeyError,
)
from .fields import FieldRegistry, FieldSpec, canonicalize, logprobs_spec, routed_experts_spec
from .placement import rendezvous_unit
from .reader import FetchStats, Reader
from .refs import FieldRef, Fragment, Layout
from .storage_unit import StorageUnit
from .trajectory import (
    Segment,
    Session,
    StepRecord,
    inline_fields,
    lineage_segments,
    timeline_segments,
)
from .writer import CommitRegion, Writer

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CapacityError",
    "ClosedError",
    "CommitRegion",
    "ConfigError",
    "Controller",
    "Deployment",
    "DuplicateKeyError",
    "FetchStats",
    "FieldRef",
    "FieldRegistry",
    "FieldSpec",
    "FieldValueError",
    "Fragment",
    "GputqConfig",
    "GputqError",
    "GputqTimeoutError",
    "InvalidInputError",
    "Layout",
    "LayoutError",
    "MissingDependencyError",
    "PartialFailureError",
    "PeerLostError",
    "ProtocolError",
    "Reader",
    "RequestTooLargeError",
    "Segment",
    "Session",
    "StaleReadError",
    "StepRecord",
    "StorageUnit",
    "TransferError",
    "UnitClients",
    "UnitService",
    "UnknownKeyError",
    "Writer",
    "add_transfer_queue_arguments",
    "canonicalize",
    "inline_fields",
    "lineage_segments",
    "logprobs_spec",
    "rendezvous_unit",
    "routed_experts_spec",
    "timeline_segments",
]
