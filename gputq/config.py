"""Configuration: one dataclass, filled from YAML, ``GPUTQ_*`` variables and flags.

Precedence, lowest to highest: the dataclass defaults, the YAML file given by
``--transfer-queue-config`` (or ``GPUTQ_CONFIG``), ``GPUTQ_<FIELD>`` environment
variables, then command-line flags. An RL framework adds the flags to its
own parser with :func:`add_transfer_queue_arguments`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import ConfigError

__all__ = [
    "GputqConfig",
    "add_transfer_queue_arguments",
    "TRANSPORTS",
    "EXPERT_DTYPES",
    "OFFLOADABLE_FIELDS",
]

TRANSPORTS = ("auto", "shm", "rdma", "tcp")
EXPERT_DTYPES = ("uint8", "uint16", "int32")
OFFLOADABLE_FIELDS = ("logprobs", "routed_experts")
_MIB = 1 << 20


@dataclass(frozen=True)
class GputqConfig:
    """Everything gputq needs to know; every field has a safe default.

    Attributes
    ----------
    enabled:
        Offload the large fields at all (``--enable-transfer-queue``).
    transfer_params:
        Fields to offload; ``routed_experts`` also needs
        ``use_rollout_routing_replay``.
    use_rollout_routing_replay:
        R3 is on: engines return routed experts and the trainer replays them.
    routed_experts_dtype:
        Stored dtype of expert IDs (uint8 up to 256 experts, uint16 up to
        65,536); always restored as int32.
    transport:
        ``auto`` (shm for units on this host, rdma where NIXL can use RDMA,
        else tcp), ``shm``, ``rdma`` or ``tcp``.
    num_units:
        StorageUnits of the embedded deployment; on a cluster one per node.
    unit_capacity_bytes:
        Arena size of each StorageUnit; bounds the memory held (rule 6).
    put_timeout_s:
        How long a write waits for arena space before ``CapacityError``.
    read_timeout_s:
        Deadline of one batched read, lease to completion.
    control_timeout_s:
        Deadline of one control call (release, stats, membership).
    max_frame_bytes:
        Largest payload of one wire frame; larger requests are refused.
    writer_inflight_bytes:
        Bytes a writer may have queued but not yet sent before ``put`` blocks.
    writer_threads:
        Background sender threads of one writer.
    host:
        Address StorageUnits bind; ``None`` picks the node's IP under Ray and
        127.0.0.1 otherwise.
    token:
        Shared secret of the transport handshake; generated per deployment
        when unset.
    shm_dir:
        Folder of the arenas' shared-memory files (``/dev/shm`` when unset).
    send_timeout_s:
        A unit's deadline for sending one reply; a client that stops reading
        loses its connection.
    max_connections:
        Connections one unit accepts at once (authenticated or not); above
        it, new connections are closed at once.
    handshake_timeout_s:
        Time a client has from connecting to completing the token handshake.
    heartbeat_interval_s:
        How often the controller probes every unit, and clients probe the
        units they marked lost; a killed unit is marked lost within this.
    probe_timeout_s:
        How long a probe waits for a unit's answer; a hung unit is marked
        lost within ``heartbeat_interval_s + probe_timeout_s``.
    """

    enabled: bool = False
    transfer_params: tuple[str, ...] = OFFLOADABLE_FIELDS
    use_rollout_routing_replay: bool = False
    routed_experts_dtype: str = "int32"
    transport: str = "auto"
    num_units: int = 2
    unit_capacity_bytes: int = 256 * _MIB
    put_timeout_s: float = 30.0
    read_timeout_s: float = 120.0
    control_timeout_s: float = 30.0
    max_frame_bytes: int = 4096 * _MIB
    writer_inflight_bytes: int = 256 * _MIB
    writer_threads: int = 2
    host: str | None = None
    token: str | None = None
    shm_dir: str | None = None
    send_timeout_s: float = 60.0
    max_connections: int = 256
    handshake_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    probe_timeout_s: float = 2.0

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.routed_experts_dtype not in EXPERT_DTYPES:
            raise ConfigError(
                f"routed_experts_dtype must be one of {EXPERT_DTYPES}, got {self.routed_experts_dtype!r}")
        unknown = set(self.transfer_params) - set(OFFLOADABLE_FIELDS)
        if unknown:
            raise ConfigError(f"unknown transfer_params {sorted(unknown)}; known: {OFFLOADABLE_FIELDS}")
        for name in ("num_units", "unit_capacity_bytes", "max_frame_bytes", "writer_inflight_bytes",
                     "writer_threads", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("put_timeout_s", "read_timeout_s", "control_timeout_s", "send_timeout_s",
                     "handshake_timeout_s", "heartbeat_interval_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def offloaded_fields(self) -> tuple[str, ...]:
        """Fields actually offloaded: routed_experts only with R3 on."""
        if not self.enabled:
            return ()
        return tuple(f for f in self.transfer_params
                     if f != "routed_experts" or self.use_rollout_routing_replay)

    def with_token(self) -> "GputqConfig":
        """This config with a fresh random token if none is set."""
        return self if self.token else self.replace(token=secrets.token_hex(16))

    def replace(self, **changes) -> "GputqConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "mapping") -> "GputqConfig":
        """Build from plain values, coercing strings (YAML, environment) to field types."""
        return cls().merge(values, source=source)

    def merge(self, values: Mapping[str, Any], *, source: str) -> "GputqConfig":
        known = {f.name: f for f in fields(self)}
        changes = {}
        for name, raw in values.items():
            if name not in known:
                raise ConfigError(f"{source}: unknown setting {name!r}; known: {sorted(known)}")
            if raw is None:
                continue
            changes[name] = _coerce(name, known[name].default, raw, source)
        return self.replace(**changes)

    @classmethod
    def load(cls, *, yaml_path: str | None = None, env: Mapping[str, str] | None = None,
             args: argparse.Namespace | None = None) -> "GputqConfig":
        """Defaults < YAML < ``GPUTQ_*`` environment < flags."""
        env = os.environ if env is None else env
        config = cls()
        yaml_path = yaml_path or (getattr(args, "transfer_queue_config", None) if args else None) \
            or env.get("GPUTQ_CONFIG")
        if yaml_path:
            config = config.merge(_read_yaml(yaml_path), source=yaml_path)
        prefix = "GPUTQ_"
        from_env = {k[len(prefix):].lower(): v for k, v in env.items()
                    if k.startswith(prefix) and k != "GPUTQ_CONFIG"}
        config = config.merge({k: v for k, v in from_env.items() if k in _FIELD_NAMES},
                              source="environment")
        if args is not None:
            config = config.merge(_from_args(args), source="flags")
        return config


_FIELD_NAMES = frozenset(f.name for f in fields(GputqConfig))


def _coerce(name: str, default: Any, raw: Any, source: str) -> Any:
    try:
        if isinstance(default, bool):
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off", ""):
                    return False
                raise ValueError(raw)
            return bool(raw)
        if isinstance(default, tuple):
            items = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
            return tuple(str(i) for i in items)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name}={raw!r} is not a valid {type(default).__name__}") from None


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read transfer-queue config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


_FLAG_TO_FIELD = {
    "enable_transfer_queue": "enabled",
    "transfer_params": "transfer_params",
    "routed_experts_dtype": "routed_experts_dtype",
    "use_rollout_routing_replay": "use_rollout_routing_replay",
    "transport": "transport",
}


def _from_args(args: argparse.Namespace) -> dict:
    values = {}
    for flag, name in _FLAG_TO_FIELD.items():
        value = getattr(args, flag, None)
        # store_true flags left at False must not override YAML or environment.
        if value is None or value is False:
            continue
        values[name] = value
    return values


def add_transfer_queue_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add gputq's flags to an RL framework's parser; returns the parser."""
    group = parser.add_argument_group("gputq (transfer queue)")
    group.add_argument("--enable-transfer-queue", action="store_true", default=False,
                       help="offload large per-token fields to StorageUnits")
    group.add_argument("--transfer-queue-config", metavar="PATH", default=None,
                       help="YAML file of gputq settings (flags and GPUTQ_* variables override it)")
    group.add_argument("--transfer-params", nargs="+", choices=OFFLOADABLE_FIELDS, default=None,
                       help="fields to offload (default: logprobs routed_experts)")
    group.add_argument("--routed-experts-dtype", choices=EXPERT_DTYPES, default=None,
                       help="stored dtype of expert IDs (default int32; restored as int32)")
    group.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                       help="R3 on: required to offload routed_experts")
    group.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="byte transport: auto (default), shm (same host), rdma (NIXL) or tcp")
    return parser
