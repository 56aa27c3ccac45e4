"""Helpers shared by the benchmarks: timing, units, output, and a plain-socket baseline.

Every benchmark prints a header and a table for people and, with
``--json``, ends with exactly one JSON line for machines
(:func:`emit_json`). Ratios are measured against a baseline in the same
run; :class:`SocketBaseline` is the reference for the tcp transport.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from transport.tcp import SOCKET_BUFFER_BYTES

__all__ = [
    "median_time",
    "gbps",
    "print_header",
    "print_table",
    "emit_json",
    "add_json_flag",
    "SocketBaseline",
    "Progress",
]


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs after ``warmup`` runs."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (10**9 bytes per second); ``inf`` for a zero duration."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


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


class SocketBaseline:
    """Plain loopback socket reference: ``sendall`` from a buffer, ``recv_into`` a buffer.

    A server thread answers each 8-byte request (a length) by sending that
    many bytes of a preallocated buffer; :meth:`read` receives them into a
    preallocated buffer and returns the seconds taken. Socket options match
    the tcp transport's (TCP_NODELAY, same buffer sizes), so a ratio against
    it measures the transport's own overhead.

    Parameters
    ----------
    max_bytes
        Largest read; both buffers are this size.
    socket_buffer_bytes
        SO_SNDBUF/SO_RCVBUF; ``None`` keeps the transport's default.
    """

    _REQUEST = struct.Struct("!Q")

    def __init__(self, max_bytes: int, socket_buffer_bytes: int | None = None):
        self.max_bytes = int(max_bytes)
        self._bufsize = socket_buffer_bytes or SOCKET_BUFFER_BYTES
        self._source = bytearray(self.max_bytes)
        self._dest = bytearray(self.max_bytes)
        self._listener: socket.socket | None = None
        self._client: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def _tune(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._bufsize)

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        self._tune(conn)
        source = memoryview(self._source)
        request = bytearray(self._REQUEST.size)
        with conn:
            while True:
                try:
                    _recv_exact(conn, memoryview(request))
                except (ConnectionError, OSError):
                    return
                (n,) = self._REQUEST.unpack(request)
                conn.sendall(source[:n])

    def __enter__(self) -> "SocketBaseline":
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, name="bench-socket-baseline", daemon=True)
        self._thread.start()
        self._client = socket.create_connection(self._listener.getsockname())
        self._tune(self._client)
        return self

    def read(self, nbytes: int) -> float:
        """Fetch ``nbytes`` from the server thread; return the seconds taken."""
        if not 0 <= nbytes <= self.max_bytes:
            raise ValueError(f"nbytes must be in [0, {self.max_bytes}]")
        dest = memoryview(self._dest)
        start = time.perf_counter()
        self._client.sendall(self._REQUEST.pack(nbytes))
        _recv_exact(self._client, dest[:nbytes])
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the server thread and close both sockets. Idempotent."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __exit__(self, *exc) -> None:
        self.close()


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
