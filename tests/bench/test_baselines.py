"""The benchmarks' baselines: page-aligned warm buffers, the same copy threads, one chunked put pass, raw NIXL."""

from __future__ import annotations

import contextlib
import json
import re

import numpy as np
import pytest

from bench import fetch, put
from bench.common import SocketBaseline, SocketWidened, baseline_bytes, page_aligned, same_host_copy_threads
from bench.gpu_summary import summary_rows
from gputq.transport.arena_copies import COPY_THREADS
from gputq.transport.policy import nixl_import_error


def test_page_aligned_buffers_start_on_a_page_and_are_touched():
    buffer = page_aligned(3 << 20, 7)
    assert buffer.ctypes.data % 4096 == 0 and buffer.nbytes == 3 << 20 and np.all(buffer == 7)
    plain = page_aligned(1 << 20, 0, aligned=False)
    assert plain.ctypes.data % 4096 == 16 and plain.nbytes == 1 << 20  # where numpy puts a large array


def test_memcpy_baseline_threads_are_the_reads_and_their_lease_helpers_plus_the_copy_pool():
    assert same_host_copy_threads() == COPY_THREADS + 1
    assert same_host_copy_threads(3) == COPY_THREADS - 1 + 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"aligned": False}, {"send_deadline": False}])
def test_socket_baseline_variants_move_the_bytes(options):
    with SocketBaseline(1 << 20, **options) as sock:
        assert sock.read(1 << 20) > 0 and sock.write(1 << 20) > 0


@pytest.mark.timeout(60)
def test_socket_baseline_reads_its_buffer_from_an_offset_into_a_given_buffer():
    held = baseline_bytes(1 << 20)
    with SocketBaseline(1 << 20) as sock:
        into = np.zeros(4096, np.uint8)
        sock.read(4096, into, offset=5000)
        assert np.array_equal(into, held[5000:9096])
        sock.read(4096, into)
        assert np.array_equal(into, held[:4096])
        with pytest.raises(ValueError, match="offset"):
            sock.read(4096, into, offset=(1 << 20) - 4095)


@pytest.mark.timeout(60)
def test_the_tcp_ceiling_widens_every_read_from_its_own_offset_as_it_lands():
    from bench.common import CEILING_LANDING_BYTES

    chunk = 3 * CEILING_LANDING_BYTES + 48  # a read of three landings and a partial one
    size = 4 * chunk
    held = baseline_bytes(size)
    with SocketBaseline(size) as sock:
        ceiling = SocketWidened(sock, chunk, np.dtype(np.uint16))
        ceiling.read(3 * chunk + 1000)  # four reads, the last a partial one of 1000 bytes
        first, second = ceiling._outputs  # reads 0 and 2, then 1 and 3 (500 IDs)
    ids = lambda c, nbytes=chunk: held[c * chunk:c * chunk + nbytes].view("<u2").astype(np.int32)
    assert np.array_equal(first, ids(2))
    assert np.array_equal(second[:500], ids(3, 1000)) and np.array_equal(second[500:], ids(1)[500:])


def test_the_socket_baseline_hands_a_chunked_read_over_landing_by_landing():
    held = baseline_bytes(1 << 20)
    landing = np.zeros(4096, np.uint8)
    got = []
    with SocketBaseline(1 << 20) as sock:
        sock.read_chunks(10_000, lambda at, view: got.append((at, view.copy())), landing, offset=123)
        with pytest.raises(ValueError, match="offset"):
            sock.read_chunks(4096, lambda at, view: None, landing, offset=(1 << 20) - 4095)
    assert [at for at, _ in got] == [0, 4096, 8192]
    assert np.array_equal(np.concatenate([view for _, view in got]), held[123:10_123])


@pytest.mark.parametrize("kind", ["uint8", "uint16", "int32"])
def test_put_baseline_narrows_every_chunk_into_one_reused_buffer(kind):
    experts = np.random.default_rng(0).integers(0, 128, (1000, 4, 2), dtype=np.int32)
    run = put.one_pass(kind, {"routed_experts": experts}, chunk_bytes=4096)  # 128 rows a chunk: 8 chunks
    first = run()
    assert first.dtype == np.dtype(kind) and np.array_equal(first, experts)
    assert run() is first  # the output is reused, not allocated per pass


def test_put_baseline_refuses_ids_outside_the_experts_put_is_configured_with():
    experts = np.zeros((1000, 4, 2), dtype=np.int32)
    for kind, bad in (("uint8", put.EXPERTS), ("uint16", -1), ("int32", 1 << 20)):
        experts[900, 1, 1] = bad
        with pytest.raises(ValueError, match=f"rows 896..1000 is not below {put.EXPERTS}"):
            put.one_pass(kind, {"routed_experts": experts}, chunk_bytes=4096)()
    logprobs = -np.ones(5000, np.float32)
    assert np.array_equal(put.one_pass("logprobs", {"logprobs": logprobs}, chunk_bytes=4096)(), logprobs)
    logprobs[4999] = np.nan
    with pytest.raises(ValueError, match="a NaN in rows 4096..5000"):
        put.one_pass("logprobs", {"logprobs": logprobs}, chunk_bytes=4096)()


def _times(total: float, socket: float, memcpy: float, repeats: int = 3, ceiling: float = 0.5) -> dict:
    return {"fetch": [total / 2] * repeats, "total": [total] * repeats, "socket": [socket] * repeats,
            "memcpy": [memcpy] * repeats, "memcpy1": [2 * memcpy] * repeats, "ceiling": [ceiling] * repeats}


def test_fetch_goals_are_judged_per_transport_on_shards_of_16_mib_and_more():
    nbytes = 64 << 20
    tcp = fetch._row("copy", "tcp", 8, nbytes, _times(1.0, 0.95, 0.1), 2, False, "uint16", 2 * nbytes)
    assert tcp["ratio_vs_socket"] == 0.95 and tcp["goal"] == "met (0.95 vs 0.9x socket)"
    shm = fetch._row("in place", "shm", 8, nbytes, _times(1.0, 0.5, 0.5), 2, True, "uint16", 2 * nbytes)
    assert shm["total_vs_memcpy"] == 0.5 and shm["total_vs_memcpy1"] == 1.0 and shm["fetch_GBps"] is None
    assert shm["goal"] == "missed (0.50 vs 0.8x memcpy)" and shm["threads"] == 2
    small = fetch._row("copy", "tcp", 1, 1 << 20, _times(1.0, 0.1, 0.1), 2, False, "uint16", 2 << 20)
    assert small["goal"] == "n/a (< 16 MiB)"
    summary = fetch._summary([tcp, shm, small])
    assert summary["goal_met"] == {"copy": True, "in place": False} and summary["goal_met_all"] is False
    assert summary["ratio_vs_socket"] == 0.5 and summary["total_vs_memcpy"] == 0.1  # the smallest of the big rows
    # The ceiling against each row's goal baseline: the socket's 0.95 s over tcp, the memcpy's 0.5 s over shm.
    assert (tcp["ceiling_vs_goal_base"], shm["ceiling_vs_goal_base"]) == (1.9, 1.0)
    assert tcp["total_vs_ceiling"] == shm["total_vs_ceiling"] == 0.5 and summary["ceiling_vs_goal_base"] == 1.0
    # restored bytes a second: twice the compact bytes over the call-to-return time; one format: 1.0 of itself
    assert tcp["out_GBps"] == round(2 * nbytes / 1.0 / 1e9, 2) and tcp["out_vs_first"] == shm["out_vs_first"] == 1.0


@pytest.mark.rdma
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_transport_bench_at_tiny_sizes_reports_every_baseline(capsys, tmp_path):
    if nixl_import_error() is not None:
        pytest.skip(f"bench.transport needs NIXL: {nixl_import_error()}")
    from bench import transport

    assert transport.main(["--repeats", "1", "--scale", "256", "--json"]) == 0
    printed = capsys.readouterr().out
    out = json.loads(printed.strip().splitlines()[-1])
    # bench/gpu_check.sh keeps this output as transport.log: its table has a line per shape
    (tmp_path / "transport.log").write_text(printed)
    lines = [(check, result) for check, result in summary_rows(tmp_path) if check.startswith("rdma vs raw NIXL")]
    assert [check for check, _ in lines] == ["rdma vs raw NIXL 64x256KiB (0.0625 MiB)",
                                             "rdma vs raw NIXL 1024x16KiB (0.0625 MiB)",
                                             "rdma vs raw NIXL 1x256MiB (1 MiB)"]
    for _, result in lines:
        assert re.fullmatch(r"one read [\d.]+x, reads leased ahead [\d.]+x, once the first lease is answered "
                            r"[\d.]+x \([\d.]+ GB/s\); tcp [\d.]+x socket", result), result
    assert [r["shape"] for r in out["rows"]] == [name for name, _, _ in transport.SHAPES]
    assert [r["MiB"] for r in out["rows"]] == [0.0625, 0.0625, 1.0]
    for row in out["rows"]:
        assert all(row[f"{path} GB/s"] > 0
                   for path in ("rdma", "rdma ahead", "nixl", "nixl built", "nixl repost", "tcp", "socket"))
        assert row["rdma/nixl"] == pytest.approx(row["rdma GB/s"] / row["nixl GB/s"])
        assert row["rdma ahead/nixl"] == pytest.approx(row["rdma ahead GB/s"] / row["nixl GB/s"])
    assert [v["baseline"] for v in out["baseline_variants"]] == [
        "nixl", "nixl, numpy placement", "socket", "socket, numpy placement", "socket, blocking sendall"]
    assert [v["gputq"] for v in out["baseline_variants"]] == ["rdma", "rdma", "tcp", "tcp", "tcp"]
    assert out["rdma_vs_nixl_min_ratio"] == min(r["rdma/nixl"] for r in out["rows"])
    assert out["rdma_ahead_vs_nixl_min_ratio"] == min(r["rdma ahead/nixl"] for r in out["rows"])
    assert [w["write"] for w in out["writes"]] == ["1 KiB", "4 KiB", "16 KiB", "256 KiB"]


@pytest.mark.rdma
@pytest.mark.timeout(60)
def test_reads_leased_ahead_use_the_lease_taken_while_the_read_before_moved():
    """``rdma ahead``, each way: every read of a pass READs under a lease taken ahead of it (one lease each,
    none of its own), the bytes are the keys', and the ways the pass times itself return their own seconds."""
    if nixl_import_error() is not None:
        pytest.skip(f"bench.transport needs NIXL: {nixl_import_error()}")
    from bench.transport import AHEAD_WAYS, LeasedAhead, SelfTimed
    from gputq.transport.handler import ServerLimits
    from gputq.transport.nixl import NixlTransport
    from gputq.unit.storage_unit import StorageUnit

    rng = np.random.default_rng(3)
    payloads = {f"k{i}": rng.integers(0, 256, 20_000 + i, dtype=np.uint8) for i in range(3)}
    transport = NixlTransport()
    with StorageUnit("bench-ahead", 4 << 20) as unit, \
            transport.serve(unit, token="t", limits=ServerLimits(max_frame_bytes=1 << 22)) as server, \
            transport.connect(server.address, token="t", max_frame_bytes=1 << 22, timeout=10) as channel:
        for key, value in payloads.items():
            channel.write(key, value, {})
        expected = np.concatenate(list(payloads.values()))
        with transport.destination(expected.size) as staged, contextlib.ExitStack() as stack:
            reads, leased_ahead = unit.stats()["reads"], 0
            for way, count in zip(AHEAD_WAYS, (4, 3, 2, 3)):
                ahead = stack.enter_context(contextlib.closing(
                    LeasedAhead(channel, list(payloads), staged, reads=count, way=way)))
                staged[:] = 0
                timed = ahead()
                assert (timed is None) == (way == "beside") and (timed is None or isinstance(timed, SelfTimed))
                assert np.array_equal(staged[:expected.size], expected)
                leased_ahead += count
                assert unit.stats()["reads"] - reads == leased_ahead and channel.leased_ahead == leased_ahead, way
            with pytest.raises(ValueError, match="way"):
                LeasedAhead(channel, list(payloads), staged, way="sideways")


def test_interleaved_medians_take_a_path_s_own_timing_where_it_times_itself():
    from bench.transport import SelfTimed, interleaved_medians

    calls = []
    medians = interleaved_medians({"own": lambda: SelfTimed(42.0), "wall": lambda: calls.append(1) or [7]}, 3)
    assert medians["own"] == 42.0 and 0 <= medians["wall"] < 42.0 and len(calls) == 4  # a warm-up, then 3
