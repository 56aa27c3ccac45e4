"""The soak's two Ray actors, the rollout (on the master) and a trainer rank (on another host), and what
every process of the soak says of its own resources.

Each call builds its channels from the membership it is handed and closes
them before it returns, as a process that outlives many rollouts must: what
a call leaves behind shows up as drift in :func:`usage`. Both roles pace
their work like the real thing (a model call takes time to generate, a
micro-batch to train on), so that a fault lands in the middle of a put or a
stream, not between them.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from bench.common import digest

__all__ = ["RolloutRole", "TrainerRole", "usage", "proc_usage", "error_report", "expected_pad"]


def usage() -> dict:
    """This process's resident memory, open descriptors and threads (from /proc)."""
    return proc_usage(os.getpid())


def proc_usage(pid: int) -> dict:
    """``pid``'s resident bytes, open descriptors and threads, read from /proc."""
    rss = threads = 0
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) << 10
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def error_report(exc: BaseException) -> dict:
    """What a caller records of a failure: its class, whether it is one of gputq's typed errors, when."""
    from gputq.errors import GputqError

    return {"type": type(exc).__name__, "typed": isinstance(exc, GputqError), "message": str(exc)[:300],
            "at": time.monotonic()}


class _Paced:
    """A :class:`~gputq.integrations.sglang.RolloutIngest` whose model calls take ``pace_s`` each to generate."""

    def __init__(self, ingest, pace_s: float):
        self._ingest, self._pace_s = ingest, pace_s

    def session(self, session_id: str, prompt_ids=None):
        return self._ingest.session(session_id, prompt_ids)

    def add(self, session, prompt_ids, response, *, start_len: int = 0):
        time.sleep(self._pace_s)
        return self._ingest.add(session, prompt_ids, response, start_len=start_len)


class RolloutRole:
    """The rollout manager's writer: SGLang-shaped responses through the ingest path into the units."""

    def __init__(self, config, shape: dict):
        self._config, self._shape = config, shape

    def pid(self) -> int:
        return os.getpid()

    def usage(self) -> dict:
        return usage()

    def rollout(self, membership: dict, partition: str, seed: int, lost: dict) -> dict:
        """Generate and store one rollout; its samples (no payload) and each sample's expected digest.

        ``lost`` (unit -> reason) are the units the controller knows lost:
        the writer places nothing there. A failure is returned, not raised:
        ``{"error": ...}`` with what had been stored left to the partition's release.
        """
        from gputq.client.clients import UnitClients
        from gputq.client.writer import Writer
        from gputq.data.trajectory import inline_fields, lineage_segments
        from gputq.integrations.sglang import RolloutIngest
        from gputq.tools.synthetic import SyntheticConfig, ingest_synthetic

        s = self._shape
        synth = SyntheticConfig(sessions=s["sessions"], steps_per_session=s["steps"], layers=s["layers"],
                                topk=s["topk"], num_experts=s["experts"], prompt_tokens=s["tokens"] // 2,
                                tokens_per_step=s["tokens"], tool_tokens=s["tokens"] // 8, rewrite_prob=0.2,
                                seed=seed)
        with UnitClients(membership, self._config) as clients:
            for unit, reason in lost.items():
                clients.mark_lost(unit, reason)
            try:
                with Writer(clients, self._config) as writer:
                    ingest = RolloutIngest(self._config, num_layers=s["layers"], topk=s["topk"],
                                           partition=partition, writer=writer, keep_inline=True)
                    sessions = ingest_synthetic(synth, _Paced(ingest, s["pace_s"]))
                    segments = [seg for session in sessions for seg in lineage_segments(session)]
                    writer.flush()
                    writer.finalize([seg.layouts for seg in segments], partition)
                    stored = writer.bytes_written
            except Exception as exc:  # noqa: BLE001 - reported to the job, which checks that it is typed
                return {"error": error_report(exc)}
        return {"samples": [seg.to_sample() for seg in segments],
                "digests": [digest(inline_fields(seg)) for seg in segments], "stored_bytes": stored}


def expected_pad(layers: int, topk: int, experts: int) -> np.ndarray:
    """slime's pad row after each sample's R3 rows: ``arange(L * K) % E``, one ``[K]`` row per layer."""
    return (np.arange(layers * topk, dtype=np.int32) % experts).reshape(layers, topk)


class TrainerRole:
    """One data-parallel rank: streams its shard micro-batch by micro-batch and digests every sample."""

    def __init__(self, config, shape: dict):
        self._config, self._shape = config, shape
        self._sabotage = threading.Event()

    def pid(self) -> int:
        return os.getpid()

    def usage(self) -> dict:
        return usage()

    def sabotage(self) -> None:
        """Flip one bit of the next sample this rank digests: the soak's byte check must catch it."""
        self._sabotage.set()

    def train(self, membership: dict, samples: list, micro_batches: list, lost: dict) -> dict:
        """Stream ``samples`` in ``micro_batches``; per sample consumed, the digest of what it restored.

        A failure ends the stream and is returned with what was consumed before it.
        """
        from gputq.client.clients import UnitClients
        from gputq.client.reader import Reader
        from gputq.data.slices import ParallelSlice
        from gputq.data.trajectory import Segment

        s = self._shape
        shard = [Segment.from_sample(sample) for sample in samples]
        lengths = [len(seg.tokens) for seg in shard]
        rank = ParallelSlice(num_experts=s["experts"])
        out: dict = {"digests": {}, "bytes": 0, "error": None}
        with UnitClients(membership, self._config) as clients:
            for unit, reason in lost.items():
                clients.mark_lost(unit, reason)
            try:
                with Reader(clients, self._config) as reader, \
                        reader.stream([seg.layouts for seg in shard], micro_batches, rank, prefetch=2,
                                      total_lengths=lengths) as stream:
                    for mb in stream:
                        self._consume(mb, lengths, out)
                        time.sleep(s["compute_s"])  # forward and backward
            except Exception as exc:  # noqa: BLE001 - reported to the job, which checks that it is typed
                out["error"] = error_report(exc)
        return out

    def _consume(self, mb, lengths: list, out: dict) -> None:
        """Cut a micro-batch back into its samples (R3 rows, then slime's pad row) and digest each."""
        s = self._shape
        layers = np.stack(mb.routed_experts)  # [L, tokens, K]
        pad = expected_pad(s["layers"], s["topk"], s["experts"])
        row = 0
        for j, i in enumerate(mb.samples):
            rows = lengths[i] - 1
            fields = {"rollout_routed_experts": np.ascontiguousarray(layers[:, row:row + rows].transpose(1, 0, 2)),
                      "rollout_log_probs": np.asarray(mb.log_probs[j])}
            if self._sabotage.is_set():
                self._sabotage.clear()
                fields["rollout_routed_experts"].reshape(-1)[0] ^= 1
            padded = np.array_equal(layers[:, row + rows], pad)
            out["digests"][i] = digest(fields) if padded else "pad rows differ from slime's"
            out["bytes"] += sum(a.nbytes for a in fields.values())
            row += rows + 1
