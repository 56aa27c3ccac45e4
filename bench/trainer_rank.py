"""One rank of :mod:`bench.trainer`: the synthetic rollout it reads, its slice of it, one pass of its stream.

Shared by the trainer benchmark's figures (:mod:`bench.trainer`) and its
throughput pass (:mod:`bench.trainer_throughput`). ``args`` is the
benchmark's parsed command line.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.data.refs import Layout
from gputq.data.slices import ParallelSlice

__all__ = ["EXPERTS", "MIB", "rollout", "rank_slice", "rank_fields", "micro_batches", "bytes_read", "unit_count",
           "Pass", "stream_pass", "run_python"]

MIB = 1 << 20
#: Experts of the synthetic model: IDs below it.
EXPERTS = 128


def rollout(writer: Writer, samples: int, tokens: int, layers: int, topk: int, name: str = "trainer") -> list[dict]:
    """``samples`` one-step segments, keys ``name/i``; IDs from a cheap pattern (random numbers would dominate
    the setup)."""
    base = (np.arange((tokens - 1) * layers * topk, dtype=np.int32) * 7).reshape(tokens - 1, layers, topk)
    log_probs = -np.linspace(0.01, 5.0, tokens // 2, dtype=np.float32)
    shard = []
    for i in range(samples):
        experts = (base + i) % EXPERTS
        refs = writer.put(f"{name}/{i}", "bench", {"routed_experts": experts, "logprobs": log_probs})
        shard.append({name: Layout.from_ref(ref) for name, ref in refs.items()})
    writer.flush()
    return shard


def rank_slice(args, pp: int, cp: int) -> ParallelSlice:
    """Rank pp/cp's slice: its stage's ``--layers / --pp`` layers, its zigzag CP chunks."""
    per_stage = args.layers // args.pp
    return ParallelSlice(layers=range(pp * per_stage, (pp + 1) * per_stage), cp_rank=cp, cp_size=args.cp,
                         num_experts=EXPERTS)


def rank_fields(args, pp: int) -> tuple[str, ...]:
    """The fields stage ``pp`` reads: logprobs only on the last (it computes the loss)."""
    return ("routed_experts", "logprobs") if pp == args.pp - 1 else ("routed_experts",)


def micro_batches(n: int, per: int) -> list[list[int]]:
    """``n`` samples in order, ``per`` a micro-batch."""
    return [list(range(i, min(n, i + per))) for i in range(0, n, per)]


def bytes_read(clients) -> int:
    """What the units served so far: their ``bytes_read``, summed."""
    return unit_count(clients, "bytes_read")


def unit_count(clients, counter: str) -> int:
    """The units' ``counter`` (a ``stats`` field), summed."""
    return sum(clients.channel(u).call("stats")[counter] for u in clients.units)


def run_python(seconds: float) -> None:
    """Run Python bytecode for ``seconds``: the GIL is held except where the interpreter switches threads (a
    training loop dispatching kernels, not one waiting for them)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Pass(NamedTuple):
    """One pass of a rank's stream, timed by :func:`stream_pass`."""

    #: The whole pass, opening the stream included.
    seconds: float
    #: Bytes the stream's reads name (its slice).
    planned: int
    #: Per micro-batch, ``(waited, computed)`` seconds: the loop getting it (the first one's wait includes
    #: opening the stream), and its compute stand-in.
    steps: list
    #: Seconds ``Reader.stream`` took to return: every micro-batch checked and sized, before the first read.
    opened: float


def stream_pass(reader: Reader, shard, args, pp: int, cp: int, compute_s: float = 0.0,
                compute=time.sleep, release: str | None = None) -> Pass:
    """One pass of a rank's stream, with ``compute(compute_s)`` standing for each micro-batch's compute where
    ``compute_s`` is not 0: the host idles (``time.sleep``, the default) or runs Python (:func:`run_python`);
    ``release`` as :meth:`Reader.stream <gputq.client.reader.Reader.stream>` takes it.
    """
    steps = []
    started = time.perf_counter()
    with reader.stream(shard, micro_batches(len(shard), args.mb_samples), rank_slice(args, pp, cp),
                       prefetch=args.prefetch, fields=rank_fields(args, pp), release=release) as stream:
        opened = time.perf_counter() - started
        planned = stream.slice_bytes
        asked = started
        for _ in stream:
            began = time.perf_counter()
            if compute_s:
                compute(compute_s)
            steps.append((began - asked, time.perf_counter() - began))
            asked = time.perf_counter()
    return Pass(time.perf_counter() - started, planned, steps, opened)
