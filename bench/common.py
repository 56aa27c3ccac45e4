"""Helpers shared by the benchmarks: timing, units, output, and a plain-socket baseline.

Every benchmark prints a header and a table for people and, with
``--json``, ends with exactly one JSON line for machines
(:func:`emit_json`). Ratios are measured against a baseline in the same
run; :class:`SocketBaseline` (its server in a child process) is the
reference for the tcp transport. The benchmarks that replay a synthetic
rollout take its shape from one set of flags (:func:`add_rollout_flags`,
:func:`synthetic_config`) and compare restores by :func:`digest`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import platform
import socket
import statistics
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from gputq.transport.handler import ServerLimits
from gputq.transport.tcp import SOCKET_BUFFER_BYTES

__all__ = [
    "SelfTimed",
    "wall_time",
    "median_time",
    "gbps",
    "threaded_memcpy",
    "same_host_copy_threads",
    "page_aligned",
    "print_header",
    "trainer_runtime",
    "print_table",
    "emit_json",
    "add_json_flag",
    "SocketBaseline",
    "SocketWidened",
    "CEILING_LANDING_BYTES",
    "baseline_bytes",
    "Progress",
    "progress_range",
    "remote_units",
    "digest",
    "add_rollout_flags",
    "synthetic_config",
]


class SelfTimed(float):
    """Seconds a timed callable measured itself (its call also did what is not timed)."""


def wall_time(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn()``, or the :class:`SelfTimed` seconds it returns."""
    start = time.perf_counter()
    timed = fn()
    elapsed = time.perf_counter() - start
    return timed if isinstance(timed, SelfTimed) else elapsed


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    for _ in range(warmup):
        fn()
    return statistics.median(wall_time(fn) for _ in range(repeats))


def threaded_memcpy(dst, src, threads: int) -> float:
    """Seconds to copy numpy ``src`` into ``dst`` split over ``threads`` threads (numpy drops the GIL).

    The helper threads exist before the clock starts, as a copy pool's do.
    """
    global _copy_pool
    if _copy_pool is None or _copy_pool._max_workers < threads - 1:
        _copy_pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="bench-memcpy")
    bounds = [(len(src) * i // threads, len(src) * (i + 1) // threads) for i in range(threads)]
    started = time.perf_counter()
    helpers = [_copy_pool.submit(np.copyto, dst[a:b], src[a:b]) for a, b in bounds[1:]]
    np.copyto(dst[bounds[0][0]:bounds[0][1]], src[bounds[0][0]:bounds[0][1]])
    for helper in helpers:
        helper.result()
    return time.perf_counter() - started


_copy_pool: ThreadPoolExecutor | None = None


def digest(fields: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over every array of ``fields`` (name, dtype, shape and bytes): equal digests, equal data."""
    h = hashlib.sha256()
    for name in sorted(fields):
        array = np.ascontiguousarray(fields[name])
        h.update(f"{name}{array.dtype.str}{array.shape}".encode())
        h.update(array.data)
    return h.hexdigest()


def add_rollout_flags(parser: argparse.ArgumentParser, *, sessions: int, steps: int, tokens: int) -> None:
    """Add the synthetic rollout's shape to ``parser``: sessions, steps, tokens, layers, top-k, experts, seed."""
    parser.add_argument("--sessions", type=int, default=sessions)
    parser.add_argument("--steps", type=int, default=steps, help="main-branch model calls per session")
    parser.add_argument("--tokens", type=int, default=tokens, help="mean output tokens per model call")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)


def synthetic_config(args: argparse.Namespace, sessions: int):
    """The :class:`~gputq.tools.synthetic.SyntheticConfig` of :func:`add_rollout_flags`' flags.

    Prompts are half a call's tokens, tool outputs an eighth; a fifth of the
    calls after the first start a fresh context (lineage segments cut there).
    """
    from gputq.tools.synthetic import SyntheticConfig

    return SyntheticConfig(sessions=sessions, steps_per_session=args.steps, layers=args.layers, topk=args.topk,
                           num_experts=args.experts, prompt_tokens=args.tokens // 2, tokens_per_step=args.tokens,
                           tool_tokens=args.tokens // 8, branch_prob=0.0, rewrite_prob=0.2, seed=args.seed)


def same_host_copy_threads(units: int = 1) -> int:
    """Threads that copy a whole-shard same-host read of ``units`` units at once: the memcpy baseline's.

    Each unit's read copies on the thread that issued it and is joined by
    that read's lease helper once the lease reply is in; the process-wide
    copy pool adds ``COPY_THREADS - 1`` threads (none on a 2-core box).
    """
    from gputq.transport.arena_copies import COPY_THREADS

    return COPY_THREADS - 1 + 2 * max(1, int(units))


def page_aligned(nbytes: int, fill: int = 1, *, aligned: bool = True) -> np.ndarray:
    """A uint8 array of ``nbytes`` starting on a page boundary, every page already touched (``fill``).

    numpy and ``bytearray`` put a large buffer 16 bytes past a page start,
    and a NIXL READ over cross-memory attach into such a buffer ran at a
    third of the speed on the dev box (``python -m bench.transport`` shows
    both). gputq's arenas and registered buffers are page-aligned, so a
    baseline's are too; ``aligned=False`` gives the plain numpy placement,
    for that comparison.
    """
    raw = np.empty(int(nbytes) + _PAGE, np.uint8)
    start = (-raw.ctypes.data) % _PAGE if aligned else (16 - raw.ctypes.data % _PAGE) % _PAGE
    buffer = raw[start:start + int(nbytes)]
    buffer.fill(fill)
    return buffer


_PAGE = 4096


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second); ``inf`` for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def trainer_runtime() -> str:
    """Load torch where it is installed, as a trainer process has it loaded; its version, or why not.

    gputq's host restores use torch's transposing copy once the process
    has torch (it never imports it itself), so a benchmark that stands for
    a trainer loads it first, outside every timer and memory baseline.
    """
    try:
        import torch
    except ImportError:
        return "not installed (numpy transposes)"
    return f"torch {torch.__version__} loaded"


def print_header(title: str, **facts) -> None:
    """Print a title line and ``key: value`` facts (the machine's, plus those given)."""
    print(f"== {title} ==")
    facts = {"python": platform.python_version(), "machine": platform.machine(), **facts}
    for key, value in facts.items():
        print(f"  {key}: {value}")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(rows: Iterable[Mapping], columns: Sequence[str]) -> None:
    """Print ``rows`` (mappings) as an aligned text table of ``columns``."""
    cells = [[_cell(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    print("  ".join(col.rjust(w) for col, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def emit_json(obj) -> None:
    """Print ``obj`` as one JSON line (a benchmark's last line with ``--json``)."""
    print(json.dumps(obj, sort_keys=True, default=str))
    sys.stdout.flush()


def add_json_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--json`` (emit one JSON object last) to ``parser`` and return it."""
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return parser


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("baseline peer closed")
        got += n


def baseline_bytes(nbytes: int) -> np.ndarray:
    """What the socket baseline's server holds from its start until a write lands: a byte pattern whose
    period (251, prime) is no power of two, so that bytes read from one offset differ from another's."""
    return np.resize(np.arange(251, dtype=np.uint8), int(nbytes))


_REQUEST = struct.Struct("!cQQ")  # op (b"R" read, b"W" write), length, offset into the server's buffer
#: The baseline server's send deadline: a unit's default.
SEND_TIMEOUT_S = ServerLimits().send_timeout_s


def _tune(sock: socket.socket, bufsize: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)


def _serve_socket(conn, max_bytes: int, bufsize: int, send_deadline: bool, aligned: bool) -> None:
    """The baseline server's process: one connection, reads answered from and writes landed in one buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname())
    client, _ = listener.accept()
    listener.close()
    _tune(client, bufsize)
    buffer = page_aligned(max_bytes, aligned=aligned)  # like a unit's arena: touched, reused
    buffer[:] = baseline_bytes(max_bytes)
    buffer = memoryview(buffer)
    request = bytearray(_REQUEST.size)
    with client:
        while True:
            try:
                _recv_exact(client, memoryview(request))
            except (ConnectionError, OSError):
                return
            op, n, offset = _REQUEST.unpack(request)
            # A unit sends under a deadline, so its socket is non-blocking while it sends (poll, then
            # send what fits); bench.transport times a blocking sendall beside it.
            client.settimeout(SEND_TIMEOUT_S if send_deadline else None)
            if op == b"R":
                client.sendall(buffer[offset:offset + n])
            else:
                _recv_exact(client, buffer[:n])
                client.sendall(b"k")
            client.settimeout(None)


class SocketBaseline:
    """Plain loopback socket reference: ``sendall`` from a buffer, ``recv_into`` a buffer.

    The server runs in a child process, as a StorageUnit's server does in a
    deployment, so both sides of a ratio pay for crossing processes. It
    answers a read of n bytes by sending n bytes of a preallocated buffer
    and lands a write of n bytes in it (then acknowledges with one byte).
    Socket options match the tcp transport's (TCP_NODELAY, same buffer
    sizes), its buffers are page-aligned, touched once and reused, as a
    unit's arena and a reader's staging are, and the server sends under a
    deadline as a unit does, so a ratio against it measures the
    transport's own overhead.

    Parameters
    ----------
    max_bytes
        Largest read or write; the buffers are this size.
    socket_buffer_bytes
        SO_SNDBUF/SO_RCVBUF; ``None`` keeps the transport's default.
    send_deadline, aligned
        ``False`` for a blocking ``sendall`` or numpy's own buffer
        placement: the plainer baseline, to measure what each costs.
    """

    def __init__(self, max_bytes: int, socket_buffer_bytes: int | None = None, *, send_deadline: bool = True,
                 aligned: bool = True):
        self.max_bytes = int(max_bytes)
        self._bufsize = socket_buffer_bytes or SOCKET_BUFFER_BYTES
        self._send_deadline, self._aligned = send_deadline, aligned
        self._source = page_aligned(self.max_bytes, aligned=aligned)
        self._dest = page_aligned(self.max_bytes, 0, aligned=aligned)
        self._client: socket.socket | None = None
        self._process = None

    def __enter__(self) -> "SocketBaseline":
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve_socket, name="bench-socket-baseline", daemon=True,
                                    args=(child, self.max_bytes, self._bufsize, self._send_deadline, self._aligned))
        self._process.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("the socket baseline's server did not start within 60 s")
            self._client = socket.create_connection(parent.recv())
        except BaseException:
            self.close()
            raise
        _tune(self._client, self._bufsize)
        return self

    @property
    def server_pid(self) -> int | None:
        """The server process's pid (None once closed)."""
        return None if self._process is None else self._process.pid

    def _check(self, nbytes: int, offset: int = 0) -> None:
        if not 0 <= nbytes <= self.max_bytes:
            raise ValueError(f"nbytes must be in [0, {self.max_bytes}]")
        if not 0 <= offset <= self.max_bytes - nbytes:
            raise ValueError(f"offset must be in [0, {self.max_bytes - nbytes}]")

    def read(self, nbytes: int, into=None, offset: int = 0) -> float:
        """Fetch ``nbytes`` of the server's buffer from ``offset`` into ``into`` (a byte buffer; default
        this baseline's own); return the seconds taken.

        Reads that stand for distinct bytes (a stream's micro-batches) walk
        the buffer with ``offset``: sent again and again from one offset, a
        few MiB stay in the caches, which no stored slice does.
        """
        self._check(nbytes, offset)
        dest = memoryview(self._dest if into is None else into).cast("B")
        start = time.perf_counter()
        self._client.sendall(_REQUEST.pack(b"R", nbytes, offset))
        _recv_exact(self._client, dest[:nbytes])
        return time.perf_counter() - start

    def read_chunks(self, nbytes: int, sink, landing: np.ndarray, offset: int = 0) -> None:
        """:meth:`read`, received ``landing.nbytes`` at a time into ``landing`` and handed to
        ``sink(offset in the read, chunk)`` as each lands."""
        self._check(nbytes, offset)
        view = memoryview(landing).cast("B")
        self._client.sendall(_REQUEST.pack(b"R", nbytes, offset))
        for at in range(0, nbytes, len(view)):
            n = min(len(view), nbytes - at)
            _recv_exact(self._client, view[:n])
            sink(at, landing[:n])

    def write(self, nbytes: int) -> float:
        """Send ``nbytes`` into the server's buffer and wait for its acknowledgement; return the seconds."""
        self._check(nbytes)
        ack = memoryview(bytearray(1))
        start = time.perf_counter()
        self._client.sendall(_REQUEST.pack(b"W", nbytes, 0))
        self._client.sendall(memoryview(self._source)[:nbytes])
        _recv_exact(self._client, ack)
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the connection and stop the server process. Idempotent."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
            self._process = None

    def __exit__(self, *exc) -> None:
        self.close()


#: The ceiling's landing size. It asks for each read only once the one before is widened (nothing is
#: sent ahead, as a plain socket client's reads are not), so each read's first bytes wait for a whole
#: landing before the widen starts: smaller than the stream's (which sends its next reads ahead), it
#: ran faster on the dev box, and a ceiling is the fastest of the plain parts.
CEILING_LANDING_BYTES = 64 << 10


class SocketWidened:
    """A ceiling for fetch+restore over tcp: the plain socket's reads widened to int32 as they land.

    Each read (a micro-batch's bytes, from its own offset of the server's
    buffer: distinct bytes, as a stored slice's are) is received
    :data:`CEILING_LANDING_BYTES` at a time into one small buffer, and each
    chunk widened from there into the read's output on the same thread,
    while the server's next bytes queue in the socket buffers: the plainest
    form of what a tcp host restore can do, with no gputq in it. Outputs
    alternate between two, touched once and reused.

    Parameters
    ----------
    socket
        The :class:`SocketBaseline` to read from (its ``max_bytes`` at least the bytes of a
        :meth:`read`).
    chunk
        Bytes per read (a micro-batch's).
    dtype
        The compact IDs' dtype.
    """

    def __init__(self, socket: SocketBaseline, chunk: int, dtype: np.dtype):
        self._socket, self._chunk, self._dtype = socket, chunk, dtype
        self._landing = page_aligned(CEILING_LANDING_BYTES)
        self._outputs = [np.ones(chunk // dtype.itemsize, np.int32) for _ in range(2)]

    def read(self, nbytes: int) -> None:
        """Read ``nbytes`` a chunk per request, each widened as it lands; return once all are widened."""
        item = self._dtype.itemsize
        for i, offset in enumerate(range(0, nbytes, self._chunk)):
            out = self._outputs[i % 2]

            def widen(at: int, landed: np.ndarray, out=out) -> None:
                np.copyto(out[at // item:(at + landed.nbytes) // item], landed.view(self._dtype))
            self._socket.read_chunks(min(self._chunk, nbytes - offset) // item * item, widen, self._landing, offset)


class Progress:
    """A plain-text progress bar on stderr: ``label [#####.....] 3/8 12.1 s detail``.

    Redraws in place on a terminal and prints one line per step otherwise
    (logs stay readable). stdout is left to the tables and the JSON line.
    """

    def __init__(self, label: str, total: int, width: int = 24, stream=None):
        self.label, self.total, self.width = label, max(1, int(total)), width
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = getattr(self._stream, "isatty", lambda: False)()
        self._started = time.perf_counter()
        self._draw("")

    def _draw(self, detail: str) -> None:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"{self.label} [{bar}] {self.done}/{self.total} "
                f"{time.perf_counter() - self._started:6.1f} s {detail}")
        self._stream.write(("\r" + line + "\x1b[K") if self._tty else line + "\n")
        self._stream.flush()

    def step(self, detail: str = "") -> None:
        """Mark one more unit of work done; ``detail`` says what is next or what just finished."""
        self.done = min(self.total, self.done + 1)
        self._draw(detail)

    def note(self, detail: str) -> None:
        """Redraw with a new ``detail`` without advancing."""
        self._draw(detail)

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_range(label: str, total: int):
    """``range(total)`` that draws a :class:`Progress` bar as it goes."""
    with Progress(label, total) as progress:
        for i in range(total):
            yield i
            progress.step()


def _serve_unit(conn, name: str, config) -> None:
    from gputq.cluster.deploy import UnitService

    service = UnitService(name, config)
    try:
        conn.send(service.address())
        with contextlib.suppress(EOFError):
            conn.recv()  # "stop", or the parent went away
    finally:
        service.close()


@contextlib.contextmanager
def remote_units(config) -> Iterator:
    """``config.num_units`` UnitServices, each in its own child process, and clients to them.

    Yields ``(config, clients)``: the config with its token set, and
    :class:`~gputq.client.clients.UnitClients` of the units, as a deployment's
    processes would reach them. Units stop when the block ends.
    """
    from gputq.client.clients import UnitClients

    config = config.with_token()
    ctx = multiprocessing.get_context("spawn")
    children = []
    try:
        for i in range(config.num_units):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_unit, args=(child, f"su-{i}", config), daemon=True)
            proc.start()
            children.append((proc, parent))
        membership = {}
        for i, (proc, parent) in enumerate(children):
            if not parent.poll(120):
                raise RuntimeError(f"unit su-{i} did not start within 120 s")
            try:
                membership[f"su-{i}"] = parent.recv()
            except EOFError:
                proc.join(5)
                raise RuntimeError(f"unit su-{i} exited (code {proc.exitcode}) before serving") from None
        with UnitClients(membership, config) as clients:
            yield config, clients
    finally:
        for proc, parent in children:
            with contextlib.suppress(OSError):
                parent.send("stop")
        for proc, _ in children:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
