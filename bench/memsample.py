"""Memory of a job's processes over time: PSS per process, arenas whole, the object store once.

:class:`MemorySampler` reads ``/proc/<pid>/smaps`` of every component
process on a background thread (:func:`process_memory`) and the object
store's used bytes (:class:`ObjectStoreGauge`); :func:`summarise` turns
the samples into per-component peaks and the peak of a group's sum (the
master node's total in ``bench.memory``).

How bytes are counted:

- a process's PSS, except two kinds of shared mapping: the object store's
  (counted once, as the store's used bytes) and a unit's arena (counted
  whole, as resident bytes, in its unit: the arena is allocated and
  touched up front, so a unit costs its capacity from the start);
- ``data`` figures are above each process's own idle baseline (sampled
  before the work starts), so an interpreter's fixed ~60 MB does not
  swamp a payload of a few hundred MB; ``raw`` figures include it.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Sequence

__all__ = ["MemorySampler", "ObjectStoreGauge", "process_memory", "summarise"]


def process_memory(pid: int) -> tuple[int, int]:
    """(PSS bytes outside shared stores, resident bytes of gputq arenas) of one process.

    Reads ``/proc/<pid>/smaps``: the per-mapping form of ``smaps_rollup``,
    so the object store's mapping can be set aside (it is counted once,
    as the store's used bytes) and an arena counted whole.
    """
    pss = arena = 0
    kind = None
    with open(f"/proc/{pid}/smaps", "rb") as fh:
        for line in fh:
            if line[:4] == b"Pss:":
                if kind is None:
                    pss += int(line.split()[1]) << 10
            elif line[:4] == b"Rss:":
                if kind == "arena":
                    arena += int(line.split()[1]) << 10
            elif b"-" in line[:20] and not line[:1].isupper():  # a mapping's header line
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else b""
                name = os.path.basename(path.split(b" ")[0])
                if name.startswith(b"gputq-") and name.endswith(b".arena"):
                    kind = "arena"
                elif b"plasma" in path:
                    kind = "store"
                else:
                    kind = None
    return pss, arena


class ObjectStoreGauge:
    """Bytes in use in the object store of this driver's Ray node (the node's raylet, asked over grpc).

    Bound to this driver's node by address: on a cluster the other nodes'
    stores are theirs, and other Ray sessions may run on the same machine.
    """

    def __init__(self):
        import importlib.util

        import ray

        if importlib.util.find_spec("grpc") is None:  # the raylet's stats call needs it; a minimal Ray lacks it
            from gputq.errors import MissingDependencyError

            raise MissingDependencyError("bench.memory reads the object store's used bytes through "
                                         "Ray's grpc client: pip install 'gputq[bench]'")
        here = ray.get_runtime_context().get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == here)
        self._raylet = (node["NodeManagerAddress"], node["NodeManagerPort"])

    def __call__(self) -> int:
        from ray._private.internal_api import node_stats

        return int(node_stats(*self._raylet, include_memory_info=False).store_stats.object_store_bytes_used)


class MemorySampler:
    """Samples component memory on a background thread until :meth:`stop`.

    ``pids`` maps component name to process id. Each sample is
    ``(t, {component: bytes})``; units report PSS plus their arena.
    """

    def __init__(self, pids: dict[str, int], interval: float, store: bool = True):
        self.pids = dict(pids)
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.marks: list[tuple[float, str]] = []
        self._store = ObjectStoreGauge() if store else None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="bench-memory-sampler", daemon=True)

    def start(self) -> "MemorySampler":
        self._thread.start()
        return self

    def now(self) -> float:
        """Seconds since the sampler was made (the timeline's clock)."""
        return time.perf_counter() - self._t0

    def mark(self, label: str) -> None:
        """Note a phase boundary (drawn on the timeline)."""
        self.marks.append((self.now(), label))

    def sample(self) -> dict[str, int]:
        row = {}
        for name, pid in self.pids.items():
            try:
                pss, arena = process_memory(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            row[name] = pss + arena
            if arena:
                row[f"{name}:arena"] = arena
        if self._store is not None:
            row["object_store"] = self._store()
        return row

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                row = self.sample()
                self.samples.append((self.now(), row))
                self._stop.wait(self.interval)
        except BaseException as exc:  # reported by stop(): a silent sampler would fake a flat line
            self._error = exc

    def stop(self) -> None:
        """Stop sampling; raises what made the sampler fail, if anything did."""
        self._stop.set()
        self._thread.join(10)
        if self._error is not None:
            raise RuntimeError(f"memory sampler failed: {self._error!r}") from self._error


def summarise(sampler: MemorySampler, components: list[str], baseline_until: float, group: Sequence[str]) -> dict:
    """Per-component raw and data peaks, and the peak over time of ``group``'s per-sample sum.

    Returns ``components`` (name: raw, data and baseline bytes),
    ``master_raw`` and ``master_data`` (the group's peaks), the ``timeline``
    of data bytes and the sampler's ``marks``.
    """
    idle = [row for t, row in sampler.samples if t <= baseline_until] or sampler.samples[:1]
    baseline = {}
    for name in components:
        values = [row.get(name, 0) - row.get(f"{name}:arena", 0) for row in idle if name in row]
        baseline[name] = int(statistics.median(values)) if values else 0

    def data(row, name):
        # A unit's arena is its data from the start; the rest counts above the idle baseline.
        return max(0, row.get(name, 0) - row.get(f"{name}:arena", 0) - baseline[name]) + \
            row.get(f"{name}:arena", 0)

    peaks = {name: {"raw": max((row.get(name, 0) for _, row in sampler.samples), default=0),
                    "data": max((data(row, name) for _, row in sampler.samples), default=0),
                    "baseline": baseline[name]} for name in components}
    master = [name for name in group if name in components]
    totals = [(sum(row.get(n, 0) for n in master), sum(data(row, n) for n in master))
              for _, row in sampler.samples]
    timeline = [(round(t, 3), {n: data(row, n) for n in components}) for t, row in sampler.samples]
    return {"components": peaks, "master_raw": max(t[0] for t in totals),
            "master_data": max(t[1] for t in totals), "timeline": timeline,
            "marks": [(round(t, 3), m) for t, m in sampler.marks]}
