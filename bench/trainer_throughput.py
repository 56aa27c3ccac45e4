"""The throughput figures of :mod:`bench.trainer`: a rank's stream against its transport's baseline and ceiling.

Each pass of the rank's stream (no compute) is timed beside the strongest
honest baseline of its transport and a ceiling with no gputq in it, over
the same bytes (the module docstring of :mod:`bench.trainer` defines each
figure): a plain socket from a child process and the socket widened as it
lands (tcp, rdma), a memcpy and a widen on two threads (shm, and the widen
on one thread as the stream's restore widens, and the stream's restores
alone); over tcp also the stream's reads alone. The cores each side keeps
busy, and its CPU per MiB, say what a miss is spent on.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bench.common import SelfTimed, SocketBaseline, SocketWidened, gbps, threaded_memcpy, wall_time
from bench.cores import kept_busy, us_per_mib
from bench.trainer_rank import MIB, bytes_read, micro_batches, rank_fields, rank_slice, stream_pass, unit_count
from gputq.client.fetch import lease_in_place
from gputq.client.landing import land_replies
from gputq.client.plan import plan_stream
from gputq.client.read_context import ReadContext
from gputq.client.shape import SlimeShaper

__all__ = ["STAGE_THREADS", "throughput", "throughput_summary", "second_half"]


def _rank_plans(shard, args, config) -> list:
    """Rank dp0/pp0/cp0's micro-batches, planned and placed as its stream's are."""
    return [plan.finish() for plan in plan_stream(shard, micro_batches(len(shard), args.mb_samples),
                                                  rank_slice(args, 0, 0), fields=rank_fields(args, 0),
                                                  max_bytes=config.max_frame_bytes)]


def _reused_outputs(plans: list, count: int) -> list[dict]:
    """``count`` output buffers per field, each as large as the plans' largest micro-batch restores (touched
    once here, as a stream's reused buffers are before a pass)."""
    largest = {}
    for plan in plans:
        for name, fp in plan.fields.items():
            largest[name] = (max(largest.get(name, (0,))[0], fp.out_elements), fp.restored)
    return [{name: np.ones(n, dtype) for name, (n, dtype) in largest.items()} for _ in range(count)]


def _reads_alone(clients, config, shard, args, stack: contextlib.ExitStack):
    """A pass of rank dp0/pp0/cp0's span reads over tcp with nothing of the stream around them (see
    :mod:`bench.trainer`); its pipelines close with ``stack``."""
    plans = _rank_plans(shard, args, config)
    pipes = {}
    for unit in sorted({unit for plan in plans for unit in plan.units}):
        pipes[unit] = clients.channel(unit).pipeline()
        stack.callback(pipes[unit].close)
    outputs = _reused_outputs(plans, args.prefetch + 1)
    timeout = config.read_timeout_s

    def send(plan) -> None:
        for request in plan.requests:
            request.send(pipes[request.unit], timeout)

    def one_pass() -> None:
        send(plans[0])
        for i, plan in enumerate(plans):
            if i + 1 < len(plans):
                send(plans[i + 1])
            land_replies(plan, outputs[i % len(outputs)], pipes.__getitem__, timeout)
    return one_pass


class _RestoresAlone:
    """Timed passes of rank dp0/pp0/cp0's in-place restores over shm with nothing of the stream around them
    (see :mod:`bench.trainer`); each call returns the :class:`~bench.common.SelfTimed` seconds of its
    restores alone.

    Every micro-batch is planned, and its regions leased in the mapped
    arenas, before the clock starts; the clock then times the stream's own
    widen and shaping of each, one after another on this thread, into
    ``prefetch + 1`` reused outputs. The leases end after the clock stops,
    each confirmed as a stream's are (an expired one raises): the restores
    read what the leases vouch for. ``last`` is the last micro-batch of the
    last pass as shaped: ``(layers, per-layer arrays, fields)``.
    """

    def __init__(self, clients, config, shard, args, nbytes: int, stack: contextlib.ExitStack):
        self._context = ReadContext(clients, config)
        stack.callback(self._context.close)
        self._plans = _rank_plans(shard, args, config)
        named = sum(plan.slice_bytes for plan in self._plans)
        if named != nbytes:  # the stream's bytes, or the figure means nothing
            raise RuntimeError(f"the restores alone name {named} bytes, the stream {nbytes}")
        self._outputs = _reused_outputs(self._plans, args.prefetch + 1)
        self._shaper = SlimeShaper(self._context, rank_slice(args, 0, 0))
        self.last: tuple | None = None

    def __call__(self) -> SelfTimed:
        with contextlib.ExitStack() as leases:
            sources = []
            for plan in self._plans:
                source, held = lease_in_place(self._context, plan)
                leases.enter_context(held)
                sources.append(source)
            started = time.perf_counter()
            for i, (plan, source) in enumerate(zip(self._plans, sources)):
                outputs = self._shaper.widen(plan, source, self._outputs[i % len(self._outputs)])
                self.last = self._shaper.shape(plan, outputs)
            return SelfTimed(time.perf_counter() - started)


@dataclass
class _References:
    """What a throughput pass is compared with: its baseline and ceiling passes (named), the processes that
    serve the baseline, and the extra passes timed beside them (``reads``, ``restores``, ``one_thread_widen``)."""

    baseline: str
    baseline_pass: Callable
    baseline_pids: tuple
    ceiling: str
    ceiling_pass: Callable
    extra: dict


def _references(clients, config, shard, args, transport: str, nbytes: int, per_mb: int,
                stack: contextlib.ExitStack) -> _References:
    """The baseline, the ceiling and the extra passes of ``transport`` over the slice's ``nbytes``."""
    ids = np.dtype(args.dtype if args.dtype in ("uint8", "uint16", "int32") else "uint8")  # packed: a uint8 widen
    if transport == "shm":
        src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
        compact = src[:nbytes // ids.itemsize * ids.itemsize].view(ids)
        widened = np.ones(nbytes // ids.itemsize, np.int32)
        # on one thread, as the stream's restore widens
        extra = {"one_thread_widen": functools.partial(threaded_memcpy, widened, compact, 1)}
        if args.dtype != "packed":  # packed IDs are staged, not restored in place
            extra["restores"] = _RestoresAlone(clients, config, shard, args, nbytes, stack)
        return _References("memcpy x2 threads", functools.partial(threaded_memcpy, dst, src, 2), (),
                           "widen x2 threads", functools.partial(threaded_memcpy, widened, compact, 2), extra)
    # As large as the slice, each micro-batch's read from its own offset: distinct bytes, as the stream's.
    socket = stack.enter_context(SocketBaseline(nbytes))
    widening = SocketWidened(socket, per_mb, ids)
    socket.read(nbytes)
    widening.read(nbytes)

    def baseline_pass():
        for off in range(0, nbytes, per_mb):
            socket.read(min(per_mb, nbytes - off), offset=off)

    extra = {}
    if transport == "tcp":
        extra["reads"] = _reads_alone(clients, config, shard, args, stack)
        before = bytes_read(clients)
        extra["reads"]()
        if bytes_read(clients) - before != nbytes:  # the stream's reads, or the figure means nothing
            raise RuntimeError(f"the reads alone moved {bytes_read(clients) - before} bytes, the stream {nbytes}")
    return _References("plain socket", baseline_pass, (socket.server_pid,), "socket, widened as it lands",
                       functools.partial(widening.read, nbytes), extra)


#: The receiving process's threads of a stream by stage (their names, as the reader's pools name them): a
#: figure each, ``stream_<stage>_us_per_MiB``.
STAGE_THREADS = {"consumer": "MainThread", "fetch_thread": "gputq-prefetch", "restore_thread": "gputq-restore"}


def _cpu_figures(refs: _References, loop_pass, units: list, nbytes: int) -> tuple[dict, float, float]:
    """Per side, the CPU per MiB of the receiving and the sending processes and the cores' worth of their
    threads kept waiting; and the cores the baseline and the stream kept busy."""
    base_use, loop_use = kept_busy(refs.baseline_pass, refs.baseline_pids), kept_busy(loop_pass, units)
    # Where the receiving process is the one kept busy, its CPU per byte bounds the throughput.
    figures = {"stream_receiver_us_per_MiB": us_per_mib(loop_use.own, loop_use.pass_s, nbytes),
               "stream_units_us_per_MiB": us_per_mib(loop_use.others, loop_use.pass_s, nbytes),
               "baseline_receiver_us_per_MiB": us_per_mib(base_use.own, base_use.pass_s, nbytes)}
    if loop_use.own_threads is not None:  # a pipeline goes at its busiest stage's pace at best
        figures.update({f"stream_{stage}_us_per_MiB": us_per_mib(loop_use.own_threads.get(name, 0.0),
                                                                 loop_use.pass_s, nbytes)
                        for stage, name in STAGE_THREADS.items()})
    if refs.baseline_pids:
        figures["baseline_sender_us_per_MiB"] = us_per_mib(base_use.others, base_use.pass_s, nbytes)
    for side, work in (("ceiling", refs.ceiling_pass), ("reads", refs.extra.get("reads"))):
        if work is not None:
            top_side = kept_busy(work, ())
            figures[f"{side}_receiver_us_per_MiB"] = us_per_mib(top_side.own, top_side.pass_s, nbytes)
    waiting = {"stream_receiver": loop_use.own_waiting, "stream_units": loop_use.others_waiting,
               "baseline_receiver": base_use.own_waiting}
    if refs.baseline_pids:
        waiting["baseline_sender"] = base_use.others_waiting
    figures.update({f"{side}_waiting_cores": round(v, 2) for side, v in waiting.items() if v is not None})
    return figures, base_use.own + base_use.others, loop_use.own + loop_use.others


def _extra_figures(nbytes: int, base: list, top: list, loops: list, extra: dict) -> dict:
    """The extra passes' figures: the reads alone against the baseline and the stream, the one-thread widen and
    the restores alone against the ceiling, and the stream against its restores alone (medians of the pairs
    timed side by side)."""
    figures = {}
    if "one_thread_widen" in extra:
        one = extra["one_thread_widen"]
        figures["one_thread_widen_GBps"] = round(gbps(nbytes, statistics.median(one)), 2)
        figures["one_thread_widen_vs_ceiling"] = round(statistics.median(c / o for c, o in zip(top, one)), 3)
    if "reads" in extra:
        alone = extra["reads"]
        figures["reads_GBps"] = round(gbps(nbytes, statistics.median(alone)), 2)
        figures["reads_vs_baseline"] = round(statistics.median(b / a for b, a in zip(base, alone)), 3)
        figures["stream_vs_reads"] = round(statistics.median(a / t for a, t in zip(alone, loops)), 3)
    if "restores" in extra:
        alone = extra["restores"]
        figures["restores_GBps"] = round(gbps(nbytes, statistics.median(alone)), 2)
        figures["restores_vs_ceiling"] = round(statistics.median(c / a for c, a in zip(top, alone)), 3)
        figures["stream_vs_restores"] = round(statistics.median(a / t for a, t in zip(alone, loops)), 3)
    return figures


def throughput(reader, clients, config, shard, args, transport: str, repeats: int) -> dict:
    """The rank's streamed loop without compute, paired with its transport's baseline over the same bytes.

    Each also reports the cores it kept busy (this process and the units'
    or the socket server's): where both sides use every core,
    a ratio below 1 is CPU the stream spends beyond the baseline's.
    """
    nbytes = stream_pass(reader, shard, args, 0, 0).planned  # warm: connections, buffers
    count = len(micro_batches(len(shard), args.mb_samples))
    before = unit_count(clients, "reads")  # a read request, or a one-sided reader's lease
    stream_pass(reader, shard, args, 0, 0)
    requests = (unit_count(clients, "reads") - before) / count
    one_pass = functools.partial(stream_pass, reader, shard, args, 0, 0)
    units = [child.pid for child in multiprocessing.active_children()]  # the bench's only children so far
    with contextlib.ExitStack() as stack:
        refs = _references(clients, config, shard, args, transport, nbytes, -(-nbytes // count), stack)
        loops, halves, base, top, extra = [], [], [], [], {name: [] for name in refs.extra}
        for _ in range(repeats):
            base.append(wall_time(refs.baseline_pass))
            top.append(wall_time(refs.ceiling_pass))
            for name, work in refs.extra.items():
                extra[name].append(wall_time(work))
            timed = one_pass()
            loops.append(timed.seconds)
            halves.append(second_half(timed.steps, top[-1]))
        cpu, base_cores, loop_cores = _cpu_figures(refs, one_pass, units, nbytes)
    base_s, loop_s = statistics.median(base), statistics.median(loops)
    return {"slice_MiB": round(nbytes / MIB, 1), "baseline": refs.baseline,
            "baseline_GBps": round(gbps(nbytes, base_s), 2), "baseline_cores": round(base_cores, 2),
            "stream_GBps": round(gbps(nbytes, loop_s), 2), "stream_cores": round(loop_cores, 2),
            "ratio": round(statistics.median(b / t for b, t in zip(base, loops)), 3),
            "unit_requests_per_micro_batch": round(requests, 2),
            "cpu_per_byte_vs_baseline": round(loop_cores * loop_s / (base_cores * base_s), 2), **cpu,
            "ceiling": refs.ceiling, "ceiling_GBps": round(gbps(nbytes, statistics.median(top)), 2),
            "ceiling_vs_baseline": round(statistics.median(b / c for b, c in zip(base, top)), 3),
            "stream_vs_ceiling": round(statistics.median(c / t for c, t in zip(top, loops)), 3),
            "second_half_vs_ceiling": round(statistics.median(halves), 3),
            **_extra_figures(nbytes, base, top, loops, extra), "loop_s": loop_s}


def second_half(steps: list, ceiling_s: float) -> float:
    """A pass's later micro-batches against the ceiling's pace over the same share of the bytes: the consumer's
    waits for the second half of the micro-batches (all of one size here), once the stream's opening and its
    first fetches are behind it."""
    later = steps[len(steps) // 2:]
    return ceiling_s * len(later) / len(steps) / sum(waited for waited, _ in later)


def throughput_summary(speed: list) -> dict:
    """The goals' figures over the slices of 16 MiB or more: each the least of its rows."""
    big = [r for r in speed if r["slice_MiB"] >= 16]

    def least(name: str):
        return min(r[name] for r in big) if big else None

    summary = {"throughput_ratio": least("ratio"), "ceiling_vs_baseline": least("ceiling_vs_baseline"),
               "stream_vs_ceiling": least("stream_vs_ceiling")}
    summary.update({name: least(name) for name in ("second_half_vs_ceiling", "one_thread_widen_vs_ceiling",
                                                    "restores_vs_ceiling", "stream_vs_restores",
                                                    "reads_vs_baseline", "stream_vs_reads") if big and name in big[0]})
    return summary
