"""Batched reads through every transport path, against their raw baselines.

Run: ``python -m bench.transport [--json] [--repeats N]``.

One StorageUnit, in its own process as in a deployment, holds three
R3-shaped shards; each shard is read, as one batched read, through:

- ``rdma``: :meth:`NixlChannel.read` into a buffer from
  :meth:`NixlTransport.destination` (the process-wide registered pool, the
  way the Reader stages: no copy after the READ);
- ``rdma+copy``: the same read into a plain numpy array (one extra memcpy);
- ``rdma ahead``: reads of the shard as a stream issues them (the
  :class:`LeasedAhead` pass): :data:`AHEAD_READS` reads back to back, each
  read's lease requested on a helper thread while the read before it
  READs (:meth:`NixlChannel.lease_ahead`, then
  :meth:`NixlChannel.read_leased`); timed per read, the first lease's
  round trip included;
- ``rdma steady``: the same pass timed from its first lease's answer: the
  pace of a stream long enough that its first round trip does not count;
- ``rdma handed``: every lease of the pass taken before it, then handed to
  the reads by the helper thread as ``rdma ahead`` hands them, the reads
  timed: the hand-off, with no lease exchanged beside the READs;
- ``rdma leased``: every lease of the pass taken before it, the reads
  alone timed: the READ path. Between them, what ``rdma ahead`` pays
  beyond the READ path is split three ways: its first lease's round trip
  (ahead against steady), the next lease's exchange beside each READ
  (steady against handed) and the hand-off (handed against leased);
- ``nixl``: the baseline for rdma, raw NIXL as its best users write it: no
  lease, no gputq; one page-aligned destination registered once and
  reused; adjacent regions merged into one descriptor; the local and
  remote descriptor lists prepared once (``prep_xfer_dlist``) and each
  read one ``make_prepped_xfer`` of their indices;
- ``nixl built``: the same READ with descriptor lists built for each read
  (``initialize_xfer``), what a reader that does not prepare pays;
- ``nixl repost``: one transfer handle made once and posted again for
  every read, possible only when the regions repeat exactly: the floor;
- ``tcp``: :meth:`TcpChannel.read` into a page-aligned numpy array;
- ``socket``: the baseline for tcp, :class:`bench.common.SocketBaseline`
  (its server in a child process like the unit's, page-aligned buffers
  touched once and reused, sending under a deadline as a unit does).

Ratios: ``rdma / nixl``, each ``rdma ahead`` way's ``/ nixl``,
``rdma / repost`` and ``tcp / socket`` per shape;
the JSON line has their minima over shapes. A second table times, on the
largest shape, the plainer baselines these replaced (NIXL into numpy's own
buffer placement, 16 bytes past a page start; a socket with numpy's
buffers; a socket whose server sends with a blocking ``sendall``), so what
each choice is worth is measured, not argued. A third table times writes
through the rdma channel's two write paths (tcp WRITE frame, NIXL push),
the measurement behind ``gputq.transport.nixl_push.PUSH_MIN_BYTES``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import multiprocessing
import os
import statistics
import time

import numpy as np

from bench.common import (
    SelfTimed,
    SocketBaseline,
    add_json_flag,
    emit_json,
    gbps,
    page_aligned,
    print_header,
    print_table,
    progress_range,
    wall_time,
)
from gputq.transport.handler import ServerLimits
from gputq.transport.nixl import NixlTransport, import_nixl
from gputq.transport.tcp import TcpTransport
from gputq.unit.storage_unit import StorageUnit

__all__ = ["SHAPES", "AHEAD_READS", "AHEAD_WAYS", "LeasedAhead", "SelfTimed", "merge_regions", "main"]

#: (name, keys, bytes per key): R3 shards as a trainer reads them.
SHAPES = (
    ("64x256KiB", 64, 256 << 10),
    ("1024x16KiB", 1024, 16 << 10),
    ("1x256MiB", 1, 256 << 20),
)
#: Reads of one ``rdma ahead`` pass.
AHEAD_READS = 8
#: Each way a :class:`LeasedAhead` pass takes its leases and is timed, and the path its row names.
_AHEAD_PATHS = {"beside": "rdma ahead", "steady": "rdma steady", "handed": "rdma handed", "leased": "rdma leased"}
AHEAD_WAYS = tuple(_AHEAD_PATHS)
TOKEN = "bench"
MAX_FRAME = 1 << 30
LIMITS = ServerLimits(max_frame_bytes=MAX_FRAME)


def merge_regions(regions: np.ndarray) -> np.ndarray:
    """Join each region to the one before it where they touch: one descriptor per contiguous run.

    The reader's destination is packed back to back, so a run contiguous in
    the arena is contiguous in the destination too; gputq's channel merges
    the same way, and the baseline must not pay for descriptors it does not.
    """
    regions = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
    if len(regions) < 2:
        return regions
    starts = np.ones(len(regions), dtype=bool)
    starts[1:] = regions[1:, 0] != regions[:-1, 0] + regions[:-1, 1]
    first = np.flatnonzero(starts)
    lengths = np.add.reduceat(regions[:, 1], first)
    return np.stack([regions[first, 0], lengths], axis=1)


class RawNixl:
    """The baseline: NIXL READs of known regions into one registered buffer, with no lease and no gputq.

    Parameters
    ----------
    connect_info
        The unit's ``nixl_connect`` reply (its agent's metadata, the arena's address).
    max_bytes
        The destination's size: registered once, reused by every read.
    aligned
        ``False`` places the destination where numpy puts a large array
        (16 bytes past a page start) instead of on a page boundary.
    """

    def __init__(self, connect_info: dict, max_bytes: int, *, aligned: bool = True):
        nixl_agent, nixl_agent_config, sync = import_nixl()
        self.agent = nixl_agent(f"bench-raw-{os.getpid()}-{int(aligned)}", nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=sync.NIXL_THREAD_SYNC_RW))
        self.dest = page_aligned(max_bytes, 0, aligned=aligned)
        self._reg = self.agent.register_memory(
            np.array([[self.dest.ctypes.data, max_bytes, 0]], dtype=np.uint64), "DRAM")
        self.remote = self.agent.add_remote_agent(connect_info["agent_metadata"])
        self.base = int(connect_info["arena_base"])
        self._prepared: list = []

    def _descs(self, regions: np.ndarray):
        regions = merge_regions(regions)
        lengths = regions[:, 1].astype(np.uint64)
        local = np.stack([self.dest.ctypes.data + np.cumsum(lengths) - lengths, lengths,
                          np.zeros_like(lengths)], axis=1).astype(np.uint64)
        remote = np.stack([self.base + regions[:, 0].astype(np.uint64), lengths,
                           np.zeros_like(lengths)], axis=1).astype(np.uint64)
        return local, remote

    def prepare(self, regions: np.ndarray):
        """Prepared local and remote descriptor lists for ``regions`` (offset, length), and their indices."""
        local, remote = self._descs(regions)
        prepared = (self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"),
                    self.agent.prep_xfer_dlist(self.remote, remote, "DRAM"),
                    np.arange(len(local), dtype=np.int32))
        self._prepared.append(prepared)
        return prepared

    def handle(self, prepared):
        """One READ handle of :meth:`prepare`'s lists, to post again and again (:meth:`repost`)."""
        local, remote, indices = prepared
        return self.agent.make_prepped_xfer("READ", local, indices, remote, indices)

    def read(self, regions: np.ndarray) -> None:
        """READ ``regions`` with descriptor lists built for this read."""
        local, remote = self._descs(regions)
        self._post(self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                              self.agent.get_xfer_descs(remote, "DRAM"), self.remote)).release()

    def read_prepared(self, prepared) -> None:
        """READ from descriptor lists made by :meth:`prepare`: one new handle of their indices."""
        self._post(self.handle(prepared)).release()

    def repost(self, handle) -> None:
        """READ by posting ``handle`` (from :meth:`handle`) again; it stays the caller's."""
        self._post(handle)

    def _post(self, handle):
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            handle.release()
            raise RuntimeError(f"raw NIXL READ failed: {state}")
        return handle

    def close(self) -> None:
        for local, remote, _ in self._prepared:
            self.agent.release_dlist_handle(local)
            self.agent.release_dlist_handle(remote)
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self._reg)


class LeasedAhead:
    """Reads of one shard back to back as a stream issues them: each next read's lease requested on one
    helper thread while this read's bytes move, so a read after the first pays no round trip before its READ.

    Calling it runs one pass of ``reads`` reads into ``dest``, in one of :data:`AHEAD_WAYS` (``way``):

    - ``"beside"``: as above, the whole pass timed by the caller (the first lease's round trip included);
    - ``"steady"``: the same pass, timed from the first lease's answer: the pace of a stream long enough
      that its first lease does not count;
    - ``"handed"``: every lease of the pass taken first, then handed to the reads by the helper thread one
      at a time as ``"beside"`` hands them, the reads timed: the hand-off with no lease exchanged beside
      the READs;
    - ``"leased"``: every lease of the pass taken first, the reads alone timed: the READ path.

    The last three return their :class:`SelfTimed` seconds. :meth:`close` stops the helper.
    """

    def __init__(self, channel, keys: list, dest, reads: int = AHEAD_READS, *, way: str = "beside"):
        if way not in AHEAD_WAYS:
            raise ValueError(f"way must be one of {AHEAD_WAYS}, got {way!r}")
        self._channel, self._keys, self._dest, self.reads, self._way = channel, keys, dest, reads, way
        self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-lease")

    def __call__(self) -> SelfTimed | None:
        if self._way in ("handed", "leased"):
            leases = iter([self._channel.lease_ahead(self._keys) for _ in range(self.reads)])
            take = functools.partial(next, leases)
        else:
            take = functools.partial(self._channel.lease_ahead, self._keys)
        start = time.perf_counter()
        if self._way == "leased":
            for _ in range(self.reads):
                self._channel.read_leased(take(), self._dest)
            return SelfTimed(time.perf_counter() - start)
        lease = self._helper.submit(take)
        for i in range(self.reads):
            held = lease.result()
            if i == 0 and self._way == "steady":
                start = time.perf_counter()
            if i + 1 < self.reads:
                lease = self._helper.submit(take)
            self._channel.read_leased(held, self._dest)
        return None if self._way == "beside" else SelfTimed(time.perf_counter() - start)

    def close(self) -> None:
        self._helper.shutdown()


def interleaved_medians(paths: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, timed round-robin (rotating) after one warm-up each (a callable
    that returns :class:`SelfTimed` seconds timed itself: they are its time).

    Round-robin rather than one path after another: on a shared box a burst
    of background load then hits every path alike instead of one of them.
    """
    for fn in paths.values():
        fn()
    names = list(paths)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        # Rotate the order so no path always runs after the one that warmed
        # (or flushed) the caches for it.
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(wall_time(paths[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _fill(unit_channel, shapes) -> dict[str, list[str]]:
    rng = np.random.default_rng(0)
    keys = {}
    for name, count, size in shapes:
        keys[name] = [f"{name}/{i}" for i in range(count)]
        for key in keys[name]:
            unit_channel.write(key, rng.integers(0, 256, size=size, dtype=np.uint8), {})
    return keys


#: Payload sizes for the write comparison (tcp WRITE frame vs NIXL push).
WRITE_SIZES = (256 << 10, 1 << 20, 4 << 20, 64 << 20)


def write_rows(control, address: dict, repeats: int, sizes=WRITE_SIZES) -> list[dict]:
    """Time one write per path and size (each key deleted again), for the write-path choice."""
    channels = {path: NixlTransport(path).connect(address, token=TOKEN, max_frame_bytes=MAX_FRAME)
                for path in ("tcp", "push")}
    counter = iter(range(1 << 30))
    rows = []
    try:
        for i in progress_range("bench.transport writes", len(sizes)):
            size = sizes[i]
            payload = np.ones(size, dtype=np.uint8)

            def write(channel):
                key = f"write/{next(counter)}"
                channel.write(key, payload, {})
                control.call("delete", keys=[key])

            t = interleaved_medians({path: (lambda c=ch: write(c)) for path, ch in channels.items()}, repeats)
            rows.append({"write": f"{size / 1024:g} KiB", "tcp GB/s": gbps(size, t["tcp"]),
                         "push GB/s": gbps(size, t["push"]), "push/tcp": t["tcp"] / t["push"]})
    finally:
        for ch in channels.values():
            ch.close()
    return rows


def _serve_unit(conn, capacity: int) -> None:
    """The unit's process: a StorageUnit served over rdma until told to stop."""
    with StorageUnit("bench-su", capacity) as unit, \
            NixlTransport().serve(unit, token=TOKEN, limits=LIMITS) as server:
        conn.send(server.address)
        conn.recv()


def read_rows(address: dict, repeats: int, shapes=SHAPES) -> tuple[list[dict], list[dict]]:
    """Time every read path on every shape, then the plainer baselines on the largest; the unit is at ``address``."""
    total_max = max(count * size for _, count, size in shapes)
    rows = []
    transport = NixlTransport()
    rdma = transport.connect(address, token=TOKEN, max_frame_bytes=MAX_FRAME)
    tcp = TcpTransport().connect(address["control"], token=TOKEN, max_frame_bytes=MAX_FRAME)
    raw = RawNixl(tcp.call("nixl_connect"), total_max)  # NIXL metadata only after the token handshake
    handles = []
    try:
        with SocketBaseline(total_max) as sock:
            keys = _fill(tcp, shapes)
            dest = page_aligned(total_max, 0)
            for i in progress_range("bench.transport reads", len(shapes)):
                name, count, size = shapes[i]
                nbytes = count * size
                shard = keys[name]
                regions = _regions(tcp, shard)
                prepared = raw.prepare(regions)
                handles.append(raw.handle(prepared))
                with transport.destination(nbytes) as staged, contextlib.ExitStack() as passes:
                    ahead = {way: passes.enter_context(contextlib.closing(LeasedAhead(rdma, shard, staged, way=way)))
                             for way in AHEAD_WAYS}
                    t = interleaved_medians({
                        "rdma": lambda: rdma.read(shard, staged),
                        **{_AHEAD_PATHS[way]: ahead[way] for way in AHEAD_WAYS},
                        "rdma+copy": lambda: rdma.read(shard, dest),
                        "nixl": lambda: raw.read_prepared(prepared),
                        "nixl built": lambda: raw.read(regions),
                        "nixl repost": lambda: raw.repost(handles[-1]),
                        "tcp": lambda: tcp.read(shard, dest),
                        "socket": lambda: sock.read(nbytes),
                    }, repeats)
                    for way, timed in ahead.items():
                        t[_AHEAD_PATHS[way]] /= timed.reads  # per read
                    assert np.array_equal(staged[:nbytes], raw.dest[:nbytes])
                    assert np.array_equal(staged[:nbytes], dest[:nbytes])
                rows.append({
                    "shape": name, "MiB": nbytes / (1 << 20),
                    **{f"{path} GB/s": gbps(nbytes, t[path]) for path in t},
                    "rdma/nixl": t["nixl"] / t["rdma"],
                    **{f"{path}/nixl": t["nixl"] / t[path] for path in _AHEAD_PATHS.values()},
                    "rdma/repost": t["nixl repost"] / t["rdma"],
                    "tcp/socket": t["socket"] / t["tcp"],
                    "rdma ms": t["rdma"] * 1e3, "nixl ms": t["nixl"] * 1e3,
                })
            variants = _plainer_baselines(tcp, rdma, raw, sock, keys, dest, repeats, shapes)
        return rows, variants
    finally:
        for handle in handles:
            handle.release()
        raw.close()
        tcp.close()
        rdma.close()


def _regions(control, keys) -> np.ndarray:
    return np.array([[e["offset"], e["nbytes"]] for e in control.call("lookup", keys=keys)], dtype=np.int64)


def _plainer_baselines(tcp, rdma, raw: RawNixl, sock: SocketBaseline, keys: dict, dest: np.ndarray,
                       repeats: int, shapes) -> list[dict]:
    """The largest shape through each baseline and the plainer version of it, interleaved.

    What page-aligned buffers and a send deadline are worth, measured: the
    baselines here once used numpy's buffer placement and a blocking send.
    """
    name, count, size = max(shapes, key=lambda shape: shape[1] * shape[2])
    nbytes, shard = count * size, keys[name]
    regions = _regions(tcp, shard)
    plain_raw = RawNixl(tcp.call("nixl_connect"), nbytes, aligned=False)
    try:
        prepared, plain_prepared = raw.prepare(regions), plain_raw.prepare(regions)
        with SocketBaseline(nbytes, aligned=False) as plain_sock, \
                SocketBaseline(nbytes, send_deadline=False) as blocking_sock, \
                NixlTransport().destination(nbytes) as staged:
            t = interleaved_medians({
                "rdma": lambda: rdma.read(shard, staged),
                "nixl": lambda: raw.read_prepared(prepared),
                "nixl, numpy placement": lambda: plain_raw.read_prepared(plain_prepared),
                "tcp": lambda: tcp.read(shard, dest),
                "socket": lambda: sock.read(nbytes),
                "socket, numpy placement": lambda: plain_sock.read(nbytes),
                "socket, blocking sendall": lambda: blocking_sock.read(nbytes),
            }, repeats)
    finally:
        plain_raw.close()
    rows = []
    for path, seconds in t.items():
        if path in ("rdma", "tcp"):
            continue
        gputq = "rdma" if path.startswith("nixl") else "tcp"  # the path this is the baseline of
        rows.append({"shape": name, "baseline": path, "GB/s": gbps(nbytes, seconds), "gputq": gputq,
                     "gputq GB/s": gbps(nbytes, t[gputq]), "gputq/baseline": seconds / t[gputq]})
    return rows


def run(repeats: int, scale: int = 1) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Start the unit in its own process (as in a deployment), then time reads and writes.

    ``scale`` divides every key's and every write's bytes (a quick run; the shapes keep their names).
    """
    shapes = tuple((name, count, max(1, size // scale)) for name, count, size in SHAPES)
    write_sizes = tuple(max(1, size // scale) for size in WRITE_SIZES)
    capacity = sum(count * size for _, count, size in shapes) + (256 << 20) // scale
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    unit = ctx.Process(target=_serve_unit, args=(child, capacity), daemon=True)
    unit.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the StorageUnit process did not start within 60 s")
        address = parent.recv()
        rows, variants = read_rows(address, repeats, shapes)
        with TcpTransport().connect(address["control"], token=TOKEN, max_frame_bytes=MAX_FRAME) as control:
            writes = write_rows(control, address, repeats, write_sizes)
    finally:
        parent.send("stop")
        unit.join(30)
    summary = {
        "rdma_vs_nixl_min_ratio": min(r["rdma/nixl"] for r in rows),
        "rdma_ahead_vs_nixl_min_ratio": min(r["rdma ahead/nixl"] for r in rows),
        "rdma_vs_nixl_repost_min_ratio": min(r["rdma/repost"] for r in rows),
        "tcp_vs_socket_min_ratio": min(r["tcp/socket"] for r in rows),
        "rdma_vs_tcp_min_ratio": min(r["rdma GB/s"] / r["tcp GB/s"] for r in rows),
    }
    return rows, variants, writes, summary


def main(argv=None) -> int:
    parser = add_json_flag(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per path and shape (median)")
    parser.add_argument("--scale", type=int, default=1, help="divide every key's bytes by this (a quick run)")
    args = parser.parse_args(argv)
    ucx_tls = os.environ.get("UCX_TLS", "(unset: UCX chooses)")
    print_header("gputq transport: batched reads", cpus=os.cpu_count(), UCX_TLS=ucx_tls,
                 repeats=args.repeats, storage="StorageUnit in a child process, channels here",
                 shapes=", ".join(name for name, _, _ in SHAPES), scale=f"1/{args.scale} of the bytes per key",
                 devices="host memory only")
    started = time.perf_counter()
    rows, variants, writes, summary = run(args.repeats, args.scale)
    print_table(rows, ["shape", "MiB", "rdma GB/s", "rdma ahead GB/s", "rdma leased GB/s", "rdma+copy GB/s",
                       "nixl GB/s", "nixl built GB/s", "nixl repost GB/s", "tcp GB/s", "socket GB/s", "rdma/nixl",
                       "rdma ahead/nixl", "rdma steady/nixl", "rdma handed/nixl", "rdma leased/nixl", "rdma/repost",
                       "tcp/socket", "rdma ms", "nixl ms"])
    print()
    print("  the plainer baselines, on the largest shape (gputq/baseline > 1: the baseline loses):")
    print_table(variants, ["shape", "baseline", "GB/s", "gputq", "gputq GB/s", "gputq/baseline"])
    print()
    print_table(writes, ["write", "tcp GB/s", "push GB/s", "push/tcp"])
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}")
    print(f"  elapsed: {time.perf_counter() - started:.1f} s")
    if args.json:
        emit_json({"bench": "transport", "rows": rows, "baseline_variants": variants, "writes": writes, **summary,
                   "UCX_TLS": ucx_tls})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
