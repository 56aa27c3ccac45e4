"""Configuration: one dataclass, filled from YAML, ``GPUTQ_*`` variables and flags.

Precedence, lowest to highest: the dataclass defaults, the YAML file given by
``--transfer-queue-config`` (or ``GPUTQ_CONFIG``), ``GPUTQ_<FIELD>`` environment
variables, then command-line flags. An RL framework adds the flags to its
own parser with :func:`add_transfer_queue_arguments` and turns the parsed
namespace into a config with ``GputqConfig.load(args=args)``.

Values are checked strictly: a float is not an int, ``"maybe"`` is not a
boolean, and every error names the file, variable or flag it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import secrets
import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping

from gputq.data.fields import LOGPROBS, ROUTED_EXPERTS, ROUTED_EXPERTS_FORMATS, FieldRegistry
from gputq.data.packing import MAX_BITS
from gputq.errors import ConfigError, InvalidInputError
from gputq.transport.handler import MAX_TIMEOUT_S, ServerLimits
from gputq.transport.policy import TRANSPORT_NAMES

__all__ = [
    "GputqConfig",
    "ConfigWarning",
    "add_transfer_queue_arguments",
    "TRANSPORTS",
    "EXPERT_DTYPES",
    "OFFLOADABLE_FIELDS",
    "MIN_TOKEN_CHARS",
    "ENV_PREFIX",
    "OTHER_ENV_VARS",
]

TRANSPORTS = TRANSPORT_NAMES
EXPERT_DTYPES = ROUTED_EXPERTS_FORMATS
OFFLOADABLE_FIELDS = (LOGPROBS, ROUTED_EXPERTS)
#: Shortest token a user may supply: 16 characters (generated ones have 32).
MIN_TOKEN_CHARS = 16
ENV_PREFIX = "GPUTQ_"
#: ``GPUTQ_*`` variables that are not settings but are read elsewhere (no warning for them).
OTHER_ENV_VARS = ("GPUTQ_CONFIG", "GPUTQ_RDMA_WRITE_PATH", "GPUTQ_KERNEL_TEST_GIB", "GPUTQ_HOST_CODEC",
                  "GPUTQ_CACHE_DIR")
_REDACTED = "***"
#: Settings whose values no error message shows (nor repr or to_dict, which redact the token).
_SECRET_FIELDS = ("token",)
_MIB = 1 << 20
# The settings that make up a unit server's ServerLimits, whose defaults are theirs.
_LIMITS = ServerLimits()
_SERVER_LIMIT_FIELDS = tuple(f.name for f in fields(ServerLimits))


class ConfigWarning(UserWarning):
    """A setting that is probably a mistake but not an error (an unknown ``GPUTQ_*`` variable)."""


def _error(setting: str, message: str) -> ConfigError:
    error = ConfigError(message)
    error.setting = setting  # lets load() say which file, variable or flag set it
    return error


@dataclass(frozen=True)
class GputqConfig:
    """Everything gputq needs to know; every field has a safe default.

    Attributes
    ----------
    enabled:
        Offload the large fields at all (``--enable-transfer-queue``). Off,
        every field stays inline and the trainer gets the same tensors.
    transfer_params:
        Fields to offload (``--transfer-params``); ``None`` means every
        offloadable field that is on: ``logprobs``, plus ``routed_experts``
        with R3. Naming ``routed_experts`` without
        ``use_rollout_routing_replay`` is an error.
    use_rollout_routing_replay:
        R3 is on: engines return routed experts and the trainer replays them.
    routed_experts_dtype:
        Stored format of expert IDs: ``uint8`` (up to 256 experts),
        ``uint16`` (up to 65,536), ``int32``, ``packed`` (``ceil(log2 E)``
        bits per ID, see :mod:`gputq.data.packing`) or ``auto`` (the
        narrowest exact one for ``num_experts``); always restored as int32.
        The only place it is given: :meth:`field_registry` derives the
        field specs from it.
    num_experts:
        Routed experts E of the model (``--num-experts``, Megatron's own flag
        where the parser has it); ``packed`` and ``auto`` need it, and an
        ID at or above it is refused. 0: not given.
    transport:
        ``auto`` (shm for units on this host, rdma where NIXL can use RDMA,
        else tcp), ``shm``, ``rdma`` or ``tcp``.
    num_units:
        StorageUnits of the embedded deployment; on a cluster one per node.
    unit_capacity_bytes:
        Arena size of each StorageUnit; bounds the memory held.
    put_timeout_s:
        How long a write waits for arena space before ``CapacityError``.
    reservation_timeout_s:
        How long a unit keeps the region reserved for a write waiting for
        its bytes and its commit; then the write is aborted and the space
        freed, so a stalled or dead writer cannot pin it. A unit receives a
        tcp write's payload under a deadline shorter than this, and a NIXL
        push is bounded the same way on the client, so no byte lands after
        the region could have gone to another key. Keep it above twice the
        transfer time of the largest write.
    write_aging_s:
        How long the first writer waiting for space may be passed by
        smaller writes that fit; from then on the space freed goes to it
        first. 0 disables passing.
    read_timeout_s:
        Deadline of one batched read, lease to completion.
    control_timeout_s:
        Deadline of one control call (release, stats, membership).
    max_frame_bytes:
        Largest payload of one wire frame, in bytes; larger requests are
        refused. A unit server limit (:attr:`server_limits`), also used by clients.
    writer_inflight_bytes:
        Bytes a writer may have queued but not yet sent before ``put`` blocks.
    writer_threads:
        Background sender threads of one writer.
    restore_threads:
        Threads that widen one streamed micro-batch into host memory, each
        a share of its rows: the thread restoring it and
        ``restore_threads - 1`` of the process's fan-out threads (a share at
        least 4 MiB restored; a smaller micro-batch is widened whole). 1
        widens on one thread. A GPU restore runs one kernel whatever this is.
    host:
        Address StorageUnits bind; ``None`` picks the node's IP under Ray and
        127.0.0.1 otherwise.
    token:
        Shared secret of the transport handshake, at least 16 characters;
        generated per deployment when unset. Never shown by ``repr`` or
        :meth:`to_dict`.
    shm_dir:
        Folder of the arenas' shared-memory files (``/dev/shm`` when unset).
    send_timeout_s:
        A unit's deadline for sending one reply, in seconds; a client that
        stops reading loses its connection. A unit server limit.
    max_connections:
        Connections one unit holds at once (authenticated or not); at it,
        the oldest unauthenticated one makes way, else the newcomer is
        refused as busy and retries. A unit server limit.
    handshake_timeout_s:
        Seconds a client has from connecting to completing the token
        handshake. A unit server limit.
    heartbeat_interval_s:
        How often the controller probes every unit, and clients probe the
        units they marked lost; a killed unit is marked lost within this.
    probe_timeout_s:
        How long a probe waits for a unit's answer; a hung unit is marked
        lost within ``heartbeat_interval_s + probe_timeout_s``.
    metrics_port:
        First port of the Prometheus endpoints (the controller takes it, each
        unit the next free one above); 0 (default) serves no metrics.
    zero_copy_max_bytes:
        Largest shard, in compact bytes, that a same-host (shm) restore reads
        where it lies in the units' arena mappings: the GPU kernel over PCIe,
        or the numpy widen on the host, with no staging copy. A larger shard
        is copied out of the arenas in spans first, then restored. ``inf``
        (default) reads every shard in place; 0 always copies.
    """

    enabled: bool = False
    transfer_params: tuple[str, ...] | None = None
    use_rollout_routing_replay: bool = False
    routed_experts_dtype: str = "int32"
    num_experts: int = 0
    transport: str = "auto"
    num_units: int = 2
    unit_capacity_bytes: int = 256 * _MIB
    put_timeout_s: float = 30.0
    reservation_timeout_s: float = 60.0
    write_aging_s: float = 1.0
    read_timeout_s: float = 120.0
    control_timeout_s: float = 30.0
    max_frame_bytes: int = _LIMITS.max_frame_bytes
    writer_inflight_bytes: int = 256 * _MIB
    writer_threads: int = 2
    restore_threads: int = 2
    host: str | None = None
    token: str | None = None
    shm_dir: str | None = None
    send_timeout_s: float = _LIMITS.send_timeout_s
    max_connections: int = _LIMITS.max_connections
    handshake_timeout_s: float = _LIMITS.handshake_timeout_s
    heartbeat_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    metrics_port: int = 0
    # Both paths move the compact bytes over PCIe once. The copy runs on the DMA engines but
    # writes the bytes once more on the device; the kernel reads them in place over PCIe.
    # Which is faster on a GPU awaits a measurement: no GPU log has one yet (the runs in
    # docs/gpu/ predate the same-host path); `bench/gpu_check.sh` times both at 64 and
    # 256 MiB. In place stays the default until it says otherwise. On the host, reading in
    # place saves the staging memcpy at every size (docs/PERFORMANCE.md, the shard fetch).
    zero_copy_max_bytes: float = math.inf

    def __post_init__(self):
        for f in fields(self):
            value = _typed(f.name, _KINDS[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if self.transport not in TRANSPORTS:
            raise _error("transport", f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.routed_experts_dtype not in EXPERT_DTYPES:
            raise _error("routed_experts_dtype", f"routed_experts_dtype must be one of {EXPERT_DTYPES}, "
                                                 f"got {self.routed_experts_dtype!r}")
        self._check_num_experts()
        if self.transfer_params is not None:
            unknown = sorted(set(self.transfer_params) - set(OFFLOADABLE_FIELDS))
            if unknown:
                raise _error("transfer_params", f"unknown transfer_params {unknown}; known: {OFFLOADABLE_FIELDS}")
            if self.enabled and ROUTED_EXPERTS in self.transfer_params and not self.use_rollout_routing_replay:
                raise _error("transfer_params", "offloading routed_experts needs R3: pass "
                                                "--use-rollout-routing-replay (use_rollout_routing_replay=True) "
                                                "or drop routed_experts from --transfer-params")
        for name in ("num_units", "unit_capacity_bytes", "writer_inflight_bytes", "writer_threads",
                     "restore_threads"):
            if getattr(self, name) < 1:
                raise _error(name, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("put_timeout_s", "reservation_timeout_s", "read_timeout_s", "control_timeout_s",
                     "heartbeat_interval_s", "probe_timeout_s"):
            value = getattr(self, name)
            # inf would pass here and fail every call at run time, in a clock's arithmetic.
            if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
                raise _error(name, f"{name} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                                   f"got {value}")
        for name in _SERVER_LIMIT_FIELDS:  # one at a time, so the error names the setting's source
            try:
                ServerLimits(**{name: getattr(self, name)})
            except InvalidInputError as exc:
                raise _error(name, str(exc)) from None
        if not self.zero_copy_max_bytes >= 0:  # NaN included
            raise _error("zero_copy_max_bytes", f"zero_copy_max_bytes must be >= 0 (or inf), "
                                                f"got {self.zero_copy_max_bytes}")
        if not self.write_aging_s >= 0:
            raise _error("write_aging_s", f"write_aging_s must be >= 0, got {self.write_aging_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise _error("metrics_port", f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.token is not None and len(self.token) < MIN_TOKEN_CHARS:
            raise _error("token", f"token must have at least {MIN_TOKEN_CHARS} characters, "
                                  f"got {len(self.token)} (leave it unset to generate one per deployment)")

    @property
    def server_limits(self) -> ServerLimits:
        """The limits a unit's server takes: ``max_frame_bytes``, ``send_timeout_s``,
        ``max_connections`` and ``handshake_timeout_s`` of this config."""
        return ServerLimits(**{name: getattr(self, name) for name in _SERVER_LIMIT_FIELDS})

    @property
    def offloaded_fields(self) -> tuple[str, ...]:
        """Fields actually offloaded; the others stay inline in the samples."""
        if not self.enabled:
            return ()
        if self.transfer_params is None:
            return OFFLOADABLE_FIELDS if self.use_rollout_routing_replay else (LOGPROBS,)
        return tuple(self.transfer_params)

    def _check_num_experts(self) -> None:
        if self.num_experts < 0:
            raise _error("num_experts", f"num_experts must be >= 0, got {self.num_experts}")
        if self.routed_experts_dtype in ("packed", "auto") and not self.num_experts:
            raise _error("routed_experts_dtype", f"routed_experts_dtype {self.routed_experts_dtype!r} needs "
                                                 f"num_experts (--num-experts, GPUTQ_NUM_EXPERTS)")
        whole = {"uint8": 1 << 8, "uint16": 1 << 16}.get(self.routed_experts_dtype, 0)
        if whole and self.num_experts > whole:
            raise _error("num_experts", f"routed_experts_dtype {self.routed_experts_dtype!r} holds IDs below "
                                        f"{whole}: {self.num_experts} experts need a wider one (or auto)")
        if self.routed_experts_dtype == "packed" and self.num_experts > 1 << MAX_BITS:
            raise _error("num_experts", f"packed IDs hold at most {MAX_BITS} bits: {self.num_experts} experts "
                                        f"need int32 (or auto)")

    def field_registry(self, num_layers: int, topk: int) -> FieldRegistry:
        """The built-in field specs, with this config's ``routed_experts_dtype`` and ``num_experts``."""
        return FieldRegistry.builtin(num_layers, topk, self.routed_experts_dtype, self.num_experts)

    def with_token(self) -> "GputqConfig":
        """This config with a fresh random token if none is set."""
        return self if self.token else self.replace(token=secrets.token_hex(16))

    def replace(self, **changes) -> "GputqConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self, *, include_secrets: bool = False) -> dict[str, Any]:
        """Every setting by name; the token is ``"***"`` unless ``include_secrets``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["token"] is not None and not include_secrets:
            out["token"] = _REDACTED
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={value!r}" for name, value in self.to_dict().items())
        return f"GputqConfig({body})"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "mapping") -> "GputqConfig":
        """Build from plain values, coercing strings (YAML, environment) to field types."""
        return cls().merge(values, source=source)

    def merge(self, values: Mapping[str, Any], *, source: str) -> "GputqConfig":
        """This config with ``values`` applied; errors name ``source``."""
        return _build(self.to_dict(include_secrets=True),
                      {name: (raw, source) for name, raw in values.items()})

    @classmethod
    def load(cls, *, yaml_path: str | None = None, env: Mapping[str, str] | None = None,
             args: argparse.Namespace | None = None) -> "GputqConfig":
        """Defaults < YAML < ``GPUTQ_*`` environment < flags.

        The layers are combined first and checked once, so settings that
        depend on each other (``transfer_params`` and R3) may come from
        different layers. An unknown ``GPUTQ_*`` variable warns
        (:class:`ConfigWarning`) with the closest valid name.
        """
        env = os.environ if env is None else env
        layered: dict[str, tuple[Any, str]] = {}
        yaml_path = yaml_path or (getattr(args, "transfer_queue_config", None) if args else None) \
            or env.get(ENV_PREFIX + "CONFIG")
        if yaml_path:
            layered.update({name: (raw, f"{yaml_path}: {name}") for name, raw in _read_yaml(yaml_path).items()})
        layered.update(_from_env(env))
        if args is not None:
            layered.update({name: (raw, f"flag {flag}") for name, (raw, flag) in _from_args(args).items()})
        return _build(cls().to_dict(include_secrets=True), layered)


# Value kinds by annotation, so YAML/environment strings coerce to exactly one type. Fields
# added later need no entry here as long as they use one of these annotations.
_KIND_OF_ANNOTATION = {"bool": bool, "int": int, "float": float, "str": str, "str | None": "optional str",
                       "tuple[str, ...] | None": "fields"}
_KINDS = {f.name: _KIND_OF_ANNOTATION[str(f.type)] for f in fields(GputqConfig)}
_FIELD_NAMES = tuple(_KINDS)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _typed(name: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind``, accepting only what converts without loss.

    A refusal shows the value (a secret's type only: see :func:`_shown`).
    """
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise _error(name, f"{name} must be true or false, got {_shown(name, value)}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _error(name, f"{name} must be an integer, got {_shown(name, value)}")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _error(name, f"{name} must be a number, got {_shown(name, value)}")
    if kind == "fields":
        if value is None:
            return None
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise _error(name, f"{name} must be a list of field names, got {_shown(name, value)}")
    if kind == "optional str" and value is None:
        return None
    if isinstance(value, str):
        return value
    raise _error(name, f"{name} must be a string, got {_shown(name, value)}")


def _shown(name: str, value: Any) -> str:
    """``value`` for an error message: its repr, or for a secret only its type.

    A mistyped secret (an unquoted numeric token in YAML, which YAML reads as
    an int) is still the secret: it must never reach a log or a terminal.
    """
    return f"a value of type {type(value).__name__}" if name in _SECRET_FIELDS else repr(value)


def _coerce(name: str, raw: Any) -> Any:
    """A YAML value or an environment string converted to ``name``'s kind (strictly)."""
    kind = _KINDS[name]
    if not isinstance(raw, str):
        return raw  # YAML gave a typed value; _typed checks it
    text = raw.strip()
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        return raw
    if kind is int:
        try:
            return int(text, 10)
        except ValueError:
            return raw
    if kind is float:
        try:
            return float(text)
        except ValueError:
            return raw
    if kind == "fields":
        return tuple(text.replace(",", " ").split())
    return raw


def _build(base: dict[str, Any], layered: Mapping[str, tuple[Any, str]]) -> GputqConfig:
    values = dict(base)
    sources: dict[str, str] = {}
    for name, (raw, source) in layered.items():
        if name not in _KINDS:
            close = difflib.get_close_matches(name, _FIELD_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {list(_FIELD_NAMES)}"
            raise ConfigError(f"{source}: unknown setting {name!r}{hint}")
        if raw is None:
            continue
        values[name] = _coerce(name, raw)
        sources[name] = source
    try:
        return GputqConfig(**values)
    except ConfigError as exc:
        setting = getattr(exc, "setting", None)
        if setting in sources:
            raise ConfigError(f"{sources[setting]}: {exc}") from None
        raise


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out = {}
    known = {ENV_PREFIX + name.upper(): name for name in _FIELD_NAMES}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in OTHER_ENV_VARS:
            continue
        name = known.get(var)
        if name is None:
            close = difflib.get_close_matches(var, [*known, *OTHER_ENV_VARS], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.warn(f"environment variable {var} is not a gputq setting{hint}", ConfigWarning,
                          stacklevel=3)
            continue
        out[name] = (raw, f"environment variable {var}={raw!r}" if name != "token" else f"environment variable {var}")
    return out


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read transfer-queue config {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          f"a transfer-queue config is a YAML file") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


# Flag dest -> (config field, flag as typed).
_FLAG_TO_FIELD = {
    "enable_transfer_queue": ("enabled", "--enable-transfer-queue"),
    "transfer_params": ("transfer_params", "--transfer-params"),
    "routed_experts_dtype": ("routed_experts_dtype", "--routed-experts-dtype"),
    "num_experts": ("num_experts", "--num-experts"),
    "use_rollout_routing_replay": ("use_rollout_routing_replay", "--use-rollout-routing-replay"),
    "transport": ("transport", "--transport"),
}


def _from_args(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    values = {}
    for dest, (name, flag) in _FLAG_TO_FIELD.items():
        value = getattr(args, dest, None)
        # store_true flags left at False must not override YAML or environment.
        if value is None or value is False:
            continue
        values[name] = (tuple(value) if isinstance(value, list) else value, flag)
    return values


def add_transfer_queue_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add gputq's flags to an RL framework's parser; returns the parser.

    Then ``GputqConfig.load(args=parser.parse_args())`` is the config.
    """
    group = parser.add_argument_group("gputq (transfer queue)")
    group.add_argument("--enable-transfer-queue", action="store_true", default=False,
                       help="offload large per-token fields to StorageUnits (off: all fields stay inline)")
    group.add_argument("--transfer-queue-config", metavar="PATH", default=None,
                       help="YAML file of gputq settings (GPUTQ_* variables and flags override it)")
    group.add_argument("--transfer-params", nargs="+", choices=OFFLOADABLE_FIELDS, default=None,
                       help="fields to offload (default: logprobs, plus routed_experts with R3)")
    group.add_argument("--routed-experts-dtype", choices=EXPERT_DTYPES, default=None,
                       help="stored format of expert IDs (default int32; packed and auto need --num-experts; "
                            "restored as int32)")
    try:
        group.add_argument("--num-experts", type=int, default=None,
                           help="routed experts of the model (for --routed-experts-dtype packed or auto)")
    except argparse.ArgumentError:
        pass  # Megatron's parser (slime's) has it already: gputq reads the model's own value
    group.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                       help="R3 on: required to offload routed_experts")
    group.add_argument("--transport", choices=TRANSPORTS, default=None,
                       help="byte transport: auto (default), shm (same host), rdma (NIXL) or tcp")
    return parser
