"""Trainer-side reader: pull one data-parallel shard and restore its fields.

:meth:`Reader.fetch` restores a whole shard (:mod:`gputq.client.shard_fetch`);
:meth:`Reader.stream` streams it micro-batch by micro-batch, each rank
reading only its slice (:mod:`gputq.client.stream`); :meth:`Reader.release`
drops what was consumed. The restored fields are exactly what the
non-offloaded path gives: ``rollout_log_probs`` float32 and
``rollout_routed_experts`` int32.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import uuid
from collections import Counter
from typing import Mapping, Sequence

from gputq.client.clients import UnitClients
from gputq.client.host_outputs import HostOutputs
from gputq.client.lifecycle import release
from gputq.client.reachability import refuse_lost
from gputq.client.read_context import ReadContext
from gputq.client.shard_fetch import FetchStats, ShardFetch
from gputq.client.stream import MicroBatchStream
from gputq.client.plan import plan_stream
from gputq.config import GputqConfig
from gputq.data.refs import Layout, checked_shard, uses_by_unit
from gputq.data.slices import ParallelSlice
from gputq.errors import ClosedError, InvalidInputError, PartialFailureError
from gputq.transport.base import Closeable

__all__ = ["Reader"]

log = logging.getLogger(__name__)


class Reader(Closeable):
    """Fetches shards for one trainer rank.

    Parameters
    ----------
    clients:
        Channels to the units (one per unit, reused across fetches).
    config:
        Supplies the read timeout.
    device:
        ``"cpu"`` restores into numpy arrays; ``"cuda"`` (or ``"cuda:N"``)
        stages in GPU memory and returns CUDA torch tensors.
    reader_id:
        This reader's identity in release ids (e.g. ``"rank-3"``); a
        random one per Reader when None. Two readers releasing the same
        shard must have different ids; a reader restarted to retry its
        releases keeps its id.
    """

    def __init__(self, clients: UnitClients, config: GputqConfig, device: str = "cpu", *,
                 reader_id: str | None = None):
        self._ctx = ReadContext(clients, config, device)
        if reader_id is None:
            reader_id = uuid.uuid4().hex
        if not isinstance(reader_id, str) or not reader_id:
            self._ctx.close()
            raise InvalidInputError(f"reader_id must be a non-empty str, got {reader_id!r}")
        self.reader_id = reader_id
        self._lock = threading.Lock()
        self._outputs = HostOutputs()
        self._shard = ShardFetch(self._ctx, self._outputs)
        self._closed = False
        self.last_stats = FetchStats()

    @property
    def device(self) -> str:
        """Where restored fields live: ``"cpu"`` or ``"cuda[:N]"``."""
        return self._ctx.device

    # -- fetching --------------------------------------------------------
    def fetch(self, shard: Sequence[Mapping[str, Layout]]) -> list[dict]:
        """Restore every field of every sample of ``shard``.

        ``shard`` holds, per sample, a mapping of field name to its
        :class:`Layout`. Returns, per sample, slime's field names mapped to
        arrays (numpy on CPU, torch on CUDA) of shape ``[rows, *row_shape]``.
        Host arrays are the caller's for as long as it keeps any of them (or
        a view, or a torch tensor of one); once all of a field's are gone, a
        later fetch restores into that memory again.
        """
        shard = checked_shard(shard)
        with self._lock:  # one fetch at a time: they share the staging buffers
            if self._closed:
                raise ClosedError("Reader is closed")
            results, self.last_stats = self._shard(shard)
            return results

    def stream(self, shard: Sequence[Mapping[str, Layout]], micro_batches: Sequence[Sequence[int]],
               rank: ParallelSlice | None = None, *, prefetch: int = 2, release: str | None = None,
               total_lengths: Sequence[int] | None = None, token_ranges=None,
               fields: Sequence[str] | None = None, hold: bool = False) -> MicroBatchStream:
        """Stream ``shard`` to this rank one micro-batch at a time: only its slice, prefetched.

        Parameters
        ----------
        shard:
            Per sample, field name to :class:`Layout` (as for :meth:`fetch`).
        micro_batches:
            The trainer's split: lists of shard positions that together hold
            every sample exactly once.
        rank:
            This rank's layers and CP/TP position (default: everything).
        prefetch:
            Micro-batches fetched ahead of the one being consumed (>= 1).
        release:
            A partition: drop each micro-batch's references once the consumer moves
            past it (as :meth:`release`, in the background; ``close()`` waits; a lost
            unit's go with ``release_partition``, named in ``unreleased``); ``None``: keep.
        total_lengths:
            Each sample's ``len(tokens)``; checked against R3's rows
            (``T - 1``), and needed to cut logprobs for CP without R3.
        token_ranges:
            Per sample, R3 row ranges to read instead of the CP rule.
        fields:
            The fields to read (default: all the samples have); a pipeline
            stage before the last, say, replays R3 but computes no loss.
        hold:
            Keep every yielded micro-batch, even past the stream's end,
            until its ``release()`` (a pipeline schedule's forwards before
            their backwards); by default each goes (invalid) at the next.

        Returns
        -------
        MicroBatchStream
            An iterator of :class:`~gputq.client.stream.MicroBatch`; close it (or ``with``) to stop prefetching early.

        Raises
        ------
        InvalidInputError
            Before anything is read: micro-batches that do not partition the
            shard, a prefetch depth below 1, layers outside the stored ones,
            a token range outside its sample, R3 rows that are not
            ``len(tokens) - 1``; each names the sample or micro-batch.
        UnitLostError
            Before anything is read: a unit of some samples is known lost.
        ClosedError
            The Reader is closed (from the stream: closed since, or an earlier micro-batch failed).
        """
        if self._closed:
            raise ClosedError("Reader is closed")
        _check_stream_options(prefetch, release, fields, hold)
        shard, rank = checked_shard(shard), ParallelSlice() if rank is None else rank
        plans = plan_stream(shard, micro_batches, rank, total_lengths=total_lengths, token_ranges=token_ranges,
                            fields=fields, max_bytes=self._ctx.config.max_frame_bytes)
        refuse_lost(shard, self._ctx.clients.lost)
        dropping = None if release is None else functools.partial(self._release_micro_batches, release)
        return MicroBatchStream(self._ctx, plans, prefetch, rank, hold=hold, release=dropping)

    def release(self, shard: Sequence[Mapping[str, Layout]], partition: str, *,
                release_id: str | None = None) -> dict:
        """Drop the references the samples of ``shard`` hold: they are consumed.

        One reference per sample and key, the count
        :meth:`Writer.finalize` gave them, so ranks sharing steps release
        independently and a step is freed when its last segment is done.
        Keys already gone (the rollout released meanwhile) are skipped.

        Exactly once: each unit applies a given ``release_id`` once, so a
        retried or repeated release of the same shard frees nothing more
        (other ranks' references survive). The default id is this reader's
        ``reader_id`` and a digest of the shard's uses (unit, key, count)
        and ``partition``; pass one to tie a release to something else,
        e.g. a training step.

        Every unit of the shard is asked, in parallel; a lost unit does not
        keep the others from freeing their keys, and a retry with the same
        ``release_id`` once it is back frees its keys and nothing more
        elsewhere. Returns and raises as
        :func:`~gputq.client.lifecycle.release` does: ``{"freed": keys
        freed, "unreachable": {}}``, or ``PartialFailureError`` with that as
        ``.result`` after every reachable unit released its keys.
        """
        uses = uses_by_unit(checked_shard(shard))
        if release_id is None:
            release_id = self._default_release_id(uses, partition)
        elif not isinstance(release_id, str) or not release_id:
            raise InvalidInputError(f"release_id must be a non-empty str, got {release_id!r}")
        return self._release_uses(uses, partition, release_id)

    def _release_uses(self, uses: Mapping[str, list[str]], partition: str, release_id: str) -> dict:
        return release(uses, partition, self._ctx.clients, missing_ok=True, release_id=release_id,
                       timeout=self._ctx.config.control_timeout_s,
                       what=f"release of a shard of partition {partition!r}")

    def _release_micro_batches(self, partition: str, layouts: list, indices: list) -> dict:
        """Drop streamed micro-batches' references, together (their indices in the id: two micro-batches
        with the same uses are two releases); returns the units it did not release, with the reason.

        The micro-batch's bytes are read, so a unit it missed is no reason to end the step: the
        rollout's ``release_partition`` drops those references, on a lost unit's return too. It runs
        on the stream's release thread, where an error would reach no one: each is logged and returned.
        """
        uses = uses_by_unit(layouts)
        try:
            self._release_uses(uses, partition, self._default_release_id(uses, partition)
                               + "/mb" + ",".join(map(str, indices)))
        except PartialFailureError as exc:
            missed = exc.result["unreachable"]
        except Exception as exc:  # noqa: BLE001 - the units were not asked, or answered an error: none released
            log.warning("micro-batches %s: their release failed", indices, exc_info=True)
            missed = dict.fromkeys(uses, f"{type(exc).__name__}: {exc}")
        else:
            return {}
        log.warning("micro-batches %s: their release did not reach %s; the rollout's release_partition drops "
                    "those references", indices, ", ".join(sorted(missed)))
        return missed

    def _default_release_id(self, uses: Mapping[str, list[str]], partition: str) -> str:
        """The default release id of a shard: ``reader_id`` and a digest of its ``uses`` per unit."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(partition).encode())
        for unit in sorted(uses):
            for key, count in sorted(Counter(uses[unit]).items()):
                digest.update(repr((unit, key, count)).encode())
        return f"{self.reader_id}/{digest.hexdigest()}"

    def close(self) -> None:
        """Close its streams, wait for a fetch in flight, stop the read threads. Idempotent; the clients stay open.

        A consumer that then asks one of its streams for a micro-batch not yet
        consumed gets ``ClosedError`` (not the end of the stream): the pass
        was cut short.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._ctx.close()
                self._outputs.close()


def _check_stream_options(prefetch, release, fields, hold) -> None:
    """Refuse a stream option of the wrong type or range (``InvalidInputError``)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise InvalidInputError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if release is not None and (not isinstance(release, str) or not release):
        raise InvalidInputError(f"release must be a partition name or None, got {release!r}")
    if fields is not None and (isinstance(fields, str) or not all(isinstance(f, str) for f in fields)):
        raise InvalidInputError(f"fields must be a list of field names, got {fields!r}")
    if not isinstance(hold, bool):
        raise InvalidInputError(f"hold must be a bool, got {hold!r}")


