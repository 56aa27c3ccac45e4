"""``Writer.put`` on the caller's thread against one numpy pass over the same step.

``python -m bench.put [--tokens 1024,8192,65536] [--puts 1000] [--json] [--log]``

``put`` runs on the rollout proxy's critical path once per model call. For
steps of each token count this measures, in one run:

- the **pass**: the baseline, one chunked pass in plain numpy as a careful
  user writes it (:func:`one_pass`): per 2 MiB chunk of the int32 expert
  IDs, narrow into a reused output buffer and check the chunk's range
  (``min``/``max``) while it is in cache; for float32 logprobs, copy and
  check for NaN per chunk (a copy, as the step must outlive the caller's
  buffer). Timed on a quiet writer after each flush, three times: the
  first run meets the input where a put does, out of cache after the sends
  (``first_pass_ms``); the goal's baseline is the median of all three;
- **put**: ``Writer.put`` of that step at p50, p99 and p99.9, with a flush
  after every ``--flush-every`` puts (the sends of earlier puts run while
  later ones are timed) and each flushed round released, so the arena has
  space. The in-flight bound is set to hold a round, so no put waits for
  sends: that is the documented backpressure, measured by the throughput
  table instead;
- **throughput**: steps per second, bytes landed included, with 1 and 4
  threads putting into one writer;
- **layout**: what the stored layout costs the pass: R3 is stored
  layer-major (so a pipeline stage's layers are one run each), and
  ``canonicalize`` is timed both ways on the same step, interleaved.

Expert steps are ``[T, 48, 8]`` int32 IDs below 128 stored as uint8,
uint16, int32 or packed (7 bits an ID: 7 bytes a row and layer; its pass
is uint8's, the narrowest whole-byte format those IDs fit); logprob steps
are ``[T]`` float32. The units run in child
processes (``--units``, tcp over loopback), as in a deployment. Ratios are
put p50 over the pass p50 of the same row, and p99 over p50 of put; the
``--json`` line has the worst of each over the expert steps
(``put_p50_vs_pass``, ``put_p99_vs_p50``) and, apart, over the logprob
steps, whose pass of a few microseconds is below the fixed cost of a put.

Where a put's time goes, and its tail: the checked pass itself (memory
bound; chunked so each chunk is read from memory once); a fixed cost of
tens of microseconds (placement, references, the hand-off to a sender),
which dominates only for tiny fields such as the logprobs of a short step;
and waiting. Waits come from (a) the in-flight bound, by design (excluded
here, see above); (b) allocation, which the writer removes by reusing sent
buffers (a fresh 12 MiB buffer faults in 3,000 pages); (c) the cores: on a
small host the sends of earlier steps (the kernel's socket copies) and the
units' receives compete with the put for CPU, which is why the senders run
at a lower priority (``--sender-nice 0`` shows the difference); (d) the
GIL, which the pass gives up and takes back around each chunk and which a
sender holds for a few microseconds between its system calls. What is left
is the host's: other processes' load and memory bandwidth. The ``tail_*``
columns split the slowest 1% of puts' time (Linux): on a core, waiting for
one, and blocked. ``--caller-core N`` (Linux) runs the timed puts and
passes with the caller's thread alone on core N, the units and the writer's
senders on the other cores: what a put costs where nothing else of gputq
takes its core, as where the units are other hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from bench.common import add_json_flag, emit_json, print_header, print_table, remote_units
from gputq.client import sends as sends_module
from gputq.client.clients import UnitClients
from gputq.client.writer import Writer
from gputq.config import GputqConfig
from gputq.data.canonical import canonicalize
from gputq.data.fields import routed_experts_spec, row_nbytes

__all__ = ["main", "step_fields", "one_pass"]

LAYERS, TOPK = 48, 8
KINDS = ("uint8", "uint16", "int32", "packed", "logprobs")
#: The experts the IDs are drawn below: packed steps store them at 7 bits.
EXPERTS = 128
_MIB = 1 << 20
#: Most untimed rounds a latency row runs before timing (see latency_row).
WARM_ROUNDS = 8
#: Baseline passes timed before each round of puts: the first meets the step's input as a put does, after the
#: last round's sends went through the caches; the later ones find it in cache (the goal's baseline is their
#: median, the stronger one).
PASSES_A_ROUND = 3
#: Source bytes the baseline pass checks and narrows at a time: within a core's L2 or its share of L3.
CHUNK_BYTES = 2 << 20


def step_fields(kind: str, tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A step's fields as the engine hands them over (int32 IDs, float32 logprobs)."""
    if kind == "logprobs":
        return {"logprobs": -rng.random(tokens, dtype=np.float32)}
    return {"routed_experts": rng.integers(0, EXPERTS, (tokens, LAYERS, TOPK), dtype=np.int32)}


def one_pass(kind: str, fields: dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES,
             experts: int = EXPERTS) -> Callable[[], object]:
    """The baseline: one chunked pass in plain numpy, as a careful user writes check-and-compact.

    Chunk by chunk of ``chunk_bytes`` of the source (so a chunk is still in
    cache when it is checked): narrow it into its rows of an output buffer
    allocated once and reused, as a writer's pooled buffers are, then check
    its IDs (``min``/``max``) below ``experts``, which put is configured
    with, or, for logprobs, its NaNs. Row order, the layout a user would store;
    what gputq's layer-major layout costs is timed apart (``layout_row``). The
    callable raises ``ValueError`` for an ID outside the model's experts, as
    put does.
    """
    name = "logprobs" if kind == "logprobs" else "routed_experts"
    source = fields[name]
    stored = np.dtype({"logprobs": np.float32, "packed": np.uint8}.get(kind, kind))
    out = np.empty(source.shape, stored)
    out.fill(0)  # touched once: the writer's buffers are warm too
    step = max(1, chunk_bytes // max(1, source[:1].nbytes))
    low, high = 0, experts - 1
    check_range = stored.kind in "iu"

    def run() -> np.ndarray:
        for start in range(0, len(source), step):
            src, dst = source[start:start + step], out[start:start + step]
            np.copyto(dst, src, casting="unsafe")
            if check_range and (src.min() < low or src.max() > high):
                raise ValueError(f"an ID in rows {start}..{start + len(src)} is not below {experts}")
            if stored.kind == "f" and np.isnan(dst.sum()):
                raise ValueError(f"a NaN in rows {start}..{start + len(src)}")
        return out

    return run


def _stored_as(config: GputqConfig, kind: str) -> GputqConfig:
    """``config`` storing expert IDs as ``kind`` (logprob steps leave them int32)."""
    return config.replace(routed_experts_dtype="int32" if kind == "logprobs" else kind, num_experts=EXPERTS)


def _release(clients: UnitClients, partition: str) -> None:
    for unit in clients.units:
        clients.channel(unit).call("release_partition", timeout=60, partition=partition)


class _SchedStat:
    """This thread's time on a core and waiting for one (Linux ``schedstat``), to explain slow puts.

    Of a put's wall time, what was neither on a core nor waiting for one was
    blocked: on the GIL, a lock or the in-flight bound.
    """

    def __init__(self):
        try:
            self._file = open("/proc/thread-self/schedstat", "rb", buffering=0)
        except OSError:
            self._file = None

    def read(self) -> tuple[int, int]:
        """(ns on a core, ns runnable but waiting for a core) so far; zeros where unknown."""
        if self._file is None:
            return 0, 0
        self._file.seek(0)
        on_cpu, waiting, _ = self._file.read().split()
        return int(on_cpu), int(waiting)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _tail_split(samples: list[tuple[float, int, int]]) -> dict:
    """Where the slowest 1% of puts spent their time: on a core, waiting for one, blocked."""
    slow = sorted(samples, key=lambda s: s[0])[int(0.99 * len(samples)):]
    wall = sum(s[0] for s in slow) * 1e9
    cpu, queued = sum(s[1] for s in slow), sum(s[2] for s in slow)
    if not wall or not (cpu or queued):
        return {}
    # The kernel accounts a running thread's time at ticks and switches, so for puts of a few
    # microseconds cpu + queued can pass the wall time: shares are of the larger of the two.
    total = max(wall, cpu + queued)
    return {"tail_cpu%": 100 * cpu / total, "tail_runq%": 100 * queued / total,
            "tail_blocked%": 100 * (total - cpu - queued) / total}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def on_cores(cores):
    """The block with the calling thread on ``cores`` only (``None``: as it is); processes and threads it
    starts meanwhile keep them."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def caller_and_other_cores(core: int | None) -> tuple:
    """``({core}, the other cores this process may use)``, or ``(None, None)`` for no ``core``.

    Raises ``ValueError`` for a core this process may not use or one that leaves no other.
    """
    if core is None:
        return None, None
    allowed = os.sched_getaffinity(0)
    if core not in allowed or len(allowed) < 2:
        raise ValueError(f"--caller-core {core}: this process may use cores {sorted(allowed)}, and needs "
                         f"another one besides")
    return {core}, allowed - {core}


def latency_row(clients, config, kind: str, tokens: int, puts: int, flush_every: int, rng,
                raw: dict, cores=(None, None)) -> dict:
    """Time ``puts`` puts of one step shape and the baseline pass between rounds.

    ``cores``: the caller's thread's cores for the timed rounds, and for the
    untimed ones before, in which the writer starts its senders (they keep them).
    """
    caller_cores, sender_cores = cores
    fields = step_fields(kind, tokens, rng)
    baseline = one_pass(kind, fields)
    step_bytes = sum(a.nbytes for a in fields.values())
    inflight = max(config.writer_inflight_bytes, (flush_every + 1) * step_bytes)
    cfg = _stored_as(config, kind).replace(writer_inflight_bytes=inflight)
    put_s, pass_s, sched = [], [], []
    stat = _SchedStat()
    with contextlib.closing(stat), Writer(clients, cfg) as writer:
        # Whole rounds before timing, until a round adds no buffer to the writer's pool (at most
        # WARM_ROUNDS): connections, the arena's first touch, and the pool, which grows to what the
        # sends in flight at once need, each new buffer faulted in page by page on the caller's
        # thread. A proxy pays those faults in its first seconds, not on every step; timed, they
        # would be the p99 of a short run. The row reports how many rounds that took.
        warm_rounds, kept = 0, -1
        with on_cores(sender_cores):
            while warm_rounds < WARM_ROUNDS and writer.buffers_kept != kept:
                kept = writer.buffers_kept
                for i in range(flush_every):
                    writer.put(f"warm-{warm_rounds}/{i}", f"warm-{warm_rounds}", fields)
                writer.flush()
                _release(clients, f"warm-{warm_rounds}")
                warm_rounds += 1
        with on_cores(caller_cores):
            rounds = -(-puts // flush_every)
            for r in range(rounds):
                for _ in range(PASSES_A_ROUND):
                    started = time.perf_counter()
                    baseline()
                    pass_s.append(time.perf_counter() - started)
                partition = f"{kind}-{tokens}-{r}"
                for i in range(min(flush_every, puts - r * flush_every)):
                    cpu0, queued0 = stat.read()
                    started = time.perf_counter()
                    writer.put(f"{partition}/{i}", partition, fields)
                    put_s.append(time.perf_counter() - started)
                    cpu1, queued1 = stat.read()
                    sched.append((put_s[-1], cpu1 - cpu0, queued1 - queued0))
                writer.flush()
                _release(clients, partition)
        buffers = writer.buffers_kept
    raw[f"{kind} {tokens}"] = {"put_us": [round(s * 1e6, 1) for s in put_s],
                               "pass_us": [round(s * 1e6, 1) for s in pass_s]}
    p50, base = statistics.median(put_s), statistics.median(pass_s)
    first = statistics.median(pass_s[::PASSES_A_ROUND])
    return {"kind": kind, "tokens": tokens, "step_MiB": round(step_bytes / _MIB, 2), "puts": len(put_s),
            "pass_ms": base * 1e3, "put_p50_ms": p50 * 1e3, "put_p99_ms": _pct(put_s, 0.99) * 1e3,
            "put_p99.9_ms": _pct(put_s, 0.999) * 1e3, "p50/pass": p50 / base,
            "first_pass_ms": first * 1e3, "p50/first_pass": p50 / first,
            "p99/p50": _pct(put_s, 0.99) / p50, **_tail_split(sched), "warm_rounds": warm_rounds,
            "buffers": buffers}


def layout_row(kind: str, tokens: int, rng, repeats: int = 9) -> dict:
    """What the stored layout costs put's pass: the step canonicalised row after row and layer-major.

    R3 is stored layer-major (a pipeline stage's layers are then one run
    each); this times ``canonicalize`` both ways into the same buffer,
    interleaved, on the caller's thread, as ``put`` runs it.
    """
    fields = step_fields(kind, tokens, rng)
    experts = fields["routed_experts"]
    spec = routed_experts_spec(LAYERS, TOPK, kind, EXPERTS)
    buffer = np.empty(experts.shape[0] * row_nbytes(spec), np.uint8)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats + 1):
        for layer_major in (False, True):
            started = time.perf_counter()
            canonicalize("k", spec, experts, out=buffer, layer_major=layer_major)
            times[layer_major].append(time.perf_counter() - started)
    rows, layers = (statistics.median(times[k][1:]) for k in (False, True))  # the first of each warms up
    return {"kind": kind, "tokens": tokens, "rows_ms": round(rows * 1e3, 3), "layer_major_ms": round(layers * 1e3, 3),
            "layer_major/rows": round(layers / rows, 3)}


def throughput_row(clients, config, kind: str, tokens: int, threads: int, steps: int, rng) -> dict:
    """Steps per second with ``threads`` threads putting into one writer, until all bytes landed."""
    fields = step_fields(kind, tokens, rng)
    step_bytes = sum(a.nbytes for a in fields.values())
    cfg = _stored_as(config, kind)
    per_thread = -(-steps // threads)
    errors: list[BaseException] = []
    with Writer(clients, cfg) as writer:
        writer.put("warm/0", "warm", fields)
        writer.flush()
        _release(clients, "warm")
        start = threading.Barrier(threads + 1)

        def putter(t: int) -> None:
            try:
                start.wait()
                for i in range(per_thread):
                    writer.put(f"tp/{t}/{i}", f"tp-{threads}", fields)
            except BaseException as exc:  # reported below
                errors.append(exc)

        workers = [threading.Thread(target=putter, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        start.wait()
        began = time.perf_counter()
        for worker in workers:
            worker.join()
        writer.flush()
        elapsed = time.perf_counter() - began
        _release(clients, f"tp-{threads}")
    if errors:
        raise errors[0]
    total = per_thread * threads
    return {"kind": kind, "tokens": tokens, "threads": threads, "steps": total,
            "steps_per_s": total / elapsed, "GB/s": total * step_bytes / elapsed / 1e9}


class _Tee:
    """Copy stdout to a log file as well."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._log.write(text)
        return self._stream.write(text)

    def flush(self):
        self._log.flush()
        self._stream.flush()


def run(args) -> dict:
    tokens_list = [int(t) for t in args.tokens.split(",")]
    kinds = args.kinds.split(",")
    rng = np.random.default_rng(0)
    biggest = max(t * LAYERS * TOPK * 4 for t in tokens_list)
    # Room for two rounds of the largest int32 step (a round lands while the last one is released)
    # and for a whole throughput run, which releases only at its end; the placement spreads keys
    # unevenly, hence the margin.
    throughput_bytes = args.throughput_steps * args.throughput_tokens * LAYERS * TOPK * 4
    capacity = int(max(2 * args.flush_every * biggest, 1.5 * throughput_bytes) / args.units) + 64 * _MIB
    config = GputqConfig(transport="tcp", num_units=args.units, unit_capacity_bytes=capacity,
                         host="127.0.0.1", writer_threads=args.sender_threads)
    rows, tput, raw = [], [], {}
    todo = [(k, t) for t in tokens_list for k in kinds]
    cores = caller_and_other_cores(args.caller_core)
    with contextlib.ExitStack() as stack:
        with on_cores(cores[1]):  # the units' processes keep the cores they start on
            config, clients = stack.enter_context(remote_units(config))
        for n, (kind, tokens) in enumerate(todo, 1):
            puts = args.puts if tokens < 32768 else max(args.flush_every * 5, args.puts // 10)
            print(f"  [{n}/{len(todo)}] {kind} x {tokens} tokens: {puts} puts ...", file=sys.stderr, flush=True)
            rows.append(latency_row(clients, config, kind, tokens, puts, args.flush_every, rng, raw, cores))
        for threads in (1, 4):
            print(f"  [throughput] {threads} thread(s) ...", file=sys.stderr, flush=True)
            tput.append(throughput_row(clients, config, args.throughput_kind, args.throughput_tokens, threads,
                                       args.throughput_steps, rng))
    layouts = [layout_row(k, t, rng) for k, t in todo if k != "logprobs"]
    steps = [r for r in rows if r["kind"] != "logprobs"] or rows
    small = [r for r in rows if r["kind"] == "logprobs"]
    summary = {"put_p50_vs_pass": max(r["p50/pass"] for r in steps),
               "put_p99_vs_p50": max(r["p99/p50"] for r in steps)}
    if small:
        summary |= {"logprobs_p50_vs_pass": max(r["p50/pass"] for r in small),
                    "logprobs_p99_vs_p50": max(r["p99/p50"] for r in small),
                    "logprobs_put_p50_us": max(r["put_p50_ms"] for r in small) * 1e3}
    if layouts:
        summary["layer_major_vs_rows"] = max(r["layer_major/rows"] for r in layouts)
    return {"rows": rows, "throughput": tput, "layouts": layouts, "raw": raw, "summary": summary}


def _parser() -> argparse.ArgumentParser:
    parser = add_json_flag(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--tokens", default="1024,8192,65536", help="step sizes in tokens")
    parser.add_argument("--kinds", default=",".join(KINDS), help="stored expert dtypes and/or logprobs")
    parser.add_argument("--puts", type=int, default=1000, help="timed puts per row (a tenth at 32K+ tokens)")
    parser.add_argument("--flush-every", type=int, default=10, help="puts per round between flushes")
    parser.add_argument("--units", type=int, default=2, help="StorageUnits, each in a child process")
    parser.add_argument("--sender-threads", type=int, default=2, help="the writer's background senders")
    parser.add_argument("--sender-nice", type=int, default=sends_module.SENDER_NICE,
                        help="how much lower the senders' CPU priority is (0: the caller's)")
    parser.add_argument("--caller-core", type=int, default=None, metavar="N",
                        help="time puts with the caller's thread alone on core N, units and senders on the others")
    parser.add_argument("--throughput-steps", type=int, default=200, help="steps per throughput run")
    parser.add_argument("--throughput-tokens", type=int, default=8192)
    parser.add_argument("--throughput-kind", default="uint16", choices=KINDS)
    parser.add_argument("--log", nargs="?", const="", default=None, metavar="PATH",
                        help="also save the output and every raw latency (default docs/logs/put-<UTC time>.log)")
    return parser


def _report(result: dict) -> None:
    """The tables and the goals' figures, as they print."""
    print_table(result["rows"], ["kind", "tokens", "step_MiB", "puts", "pass_ms", "put_p50_ms",
                                 "put_p99_ms", "put_p99.9_ms", "p50/pass", "p99/p50", "first_pass_ms",
                                 "p50/first_pass", "tail_cpu%", "tail_runq%", "tail_blocked%", "warm_rounds",
                                 "buffers"])
    print("  first_pass: the pass's median where it runs first after a round's sends, as a put runs: its "
          "input no longer in cache (pass_ms, the goal's baseline, is the median of all passes)")
    print("  tail_*: of the slowest 1% of puts' time, the share on a core, waiting for a core "
          "(other threads and processes had it), and blocked (GIL, locks, in-flight bound)")
    print("  warm_rounds: untimed rounds until one added no buffer to the writer's pool; "
          "buffers: the pool's size after the timed rounds")
    print()
    print_table(result["throughput"], ["kind", "tokens", "threads", "steps", "steps_per_s", "GB/s"])
    summary = result["summary"]
    if result["layouts"]:
        print()
        print_table(result["layouts"], list(result["layouts"][0]))
        print(f"  layer-major storage vs row after row, put's own pass (worst step): "
              f"{summary['layer_major_vs_rows']:.2f}x")
    print(f"  put_p50_vs_pass (worst expert step): {summary['put_p50_vs_pass']:.2f}  (goal <= 1.5)")
    print(f"  put_p99_vs_p50 (worst expert step): {summary['put_p99_vs_p50']:.2f}  (goal <= 3)")
    if "logprobs_put_p50_us" in summary:
        print(f"  logprobs-only steps: p50/pass {summary['logprobs_p50_vs_pass']:.2f}, p99/p50 "
              f"{summary['logprobs_p99_vs_p50']:.2f}, put p50 {summary['logprobs_put_p50_us']:.0f} us "
              f"(their pass takes microseconds: the fixed cost of a put dominates)")


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        caller_and_other_cores(args.caller_core)
    except ValueError as exc:
        parser.error(str(exc))
    sends_module.SENDER_NICE = args.sender_nice
    log = None
    if args.log is not None:
        path = args.log or os.path.join("docs", "logs", f"put-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.log")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        log = open(path, "w", encoding="utf-8")
        sys.stdout = _Tee(sys.stdout, log)
    try:
        print_header("gputq put: the caller's cost of one step", cpus=os.cpu_count(),
                     units=f"{args.units} in child processes, tcp", flush_every=args.flush_every,
                     sender_threads=args.sender_threads, sender_nice=args.sender_nice,
                     caller_core="shared" if args.caller_core is None else args.caller_core,
                     load=" ".join(f"{x:.2f}" for x in os.getloadavg()))
        started = time.perf_counter()
        result = run(args)
        _report(result)
        print(f"  elapsed: {time.perf_counter() - started:.1f} s")
        if log is not None:
            for name, values in result["raw"].items():
                print(f"raw {name} put_us: {' '.join(map(str, values['put_us']))}", file=log)
                print(f"raw {name} pass_us: {' '.join(map(str, values['pass_us']))}", file=log)
        if args.json:
            emit_json({"bench": "put", "rows": result["rows"], "throughput": result["throughput"],
                       **result["summary"]})
    finally:
        if log is not None:
            sys.stdout = sys.stdout._stream
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
