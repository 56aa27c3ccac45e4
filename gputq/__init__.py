"""gputq: a tensor-native data plane for large per-token RL rollout fields.

Rollout side: :class:`Writer` puts each step's fields into StorageUnits and
returns :class:`FieldRef` references; segments are :class:`Layout` s of
references. Trainer side: :class:`Reader` fetches a shard and restores
``rollout_log_probs`` / ``rollout_routed_experts``. :class:`Deployment`
starts the controller and units on Ray.

Only numpy is needed to import this package; Ray, NIXL, CuPy and torch
load when used.

Names load lazily, on first use: ``import gputq.transport`` (a unit's
process, a benchmark) loads only the exception tree besides, and
``from gputq import Reader`` only the client side. Every error is here too,
as :mod:`gputq.errors` lists them.
"""

from __future__ import annotations

import importlib

from gputq import errors as _errors

__version__ = "0.1.0"

# module -> the public names it defines; each module is imported when one of its names is first used.
_EXPORTS = {
    "gputq.client.clients": ("UnitClients",),
    "gputq.client.placement": ("rendezvous_unit",),
    "gputq.client.reachability": ("unreachable_samples",),
    "gputq.client.reader": ("Reader",),
    "gputq.client.shard_fetch": ("FetchStats",),
    "gputq.client.replay": ("LayerRef",),
    "gputq.client.stream": ("MicroBatch", "MicroBatchStream"),
    "gputq.client.writer": ("CommitRegion", "Writer"),
    "gputq.cluster.controller": ("Controller",),
    "gputq.cluster.deploy": ("Deployment", "UnitService"),
    "gputq.config": ("GputqConfig", "add_transfer_queue_arguments"),
    "gputq.data.canonical": ("canonicalize",),
    "gputq.data.fields": ("FieldRegistry", "FieldSpec", "logprobs_spec", "routed_experts_spec"),
    "gputq.data.packing": ("bits_for", "pack_rows", "unpack_rows"),
    "gputq.data.refs": ("FieldRef", "Fragment", "Layout"),
    "gputq.data.slices": ("ParallelSlice",),
    "gputq.data.trajectory": ("Segment", "Session", "StepRecord", "inline_fields", "lineage_segments",
                              "timeline_segments"),
    "gputq.unit.storage_unit": ("StorageUnit",),
    "gputq.errors": tuple(_errors.__all__),  # the whole tree, as its one list names it
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'gputq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
