"""bench.peers: its shards and ratios, and the benchmark end to end at tiny sizes, Mooncake Store included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.hosts import TEARDOWN_GRACE_S, run_torn_down
from bench.mooncake import MooncakeMaster, mooncake_import_error
from bench.peers import compact_dtype, main, make_shard, run_worker, speedups

_NO_MOONCAKE = mooncake_import_error()
needs_mooncake = pytest.mark.skipif(_NO_MOONCAKE is not None, reason=f"Mooncake Store does not load: {_NO_MOONCAKE}")


def _gone(pid: int) -> bool:
    """No such process, not even a zombie nobody reaped."""
    return not os.path.exists(f"/proc/{pid}")


def test_make_shard_covers_the_size_in_int32_samples_below_the_expert_count():
    shard = make_shard(1.0, layers=4, topk=2, rows=1024, experts=16)
    assert all(a.dtype == np.int32 and a.shape == (1024, 4, 2) for a in shard)
    assert sum(a.nbytes for a in shard) >= 1 << 20 and len(shard) == 32
    assert max(int(a.max()) for a in shard) == 15 and min(int(a.min()) for a in shard) == 0


def test_compact_dtype_is_the_smallest_that_holds_every_id():
    assert [compact_dtype(n) for n in (2, 128, 256, 257, 65536, 65537)] == \
        ["uint8", "uint8", "uint8", "uint16", "uint16", "int32"]


def test_speedups_take_gputq_auto_and_the_smallest_ratio_at_16_mib_and_up():
    rows = [{"system": s, "shard_MiB": m, "get_GBps": g, "put_GBps": p} for s, m, g, p in [
        ("gputq-auto", 4, 1.0, 1.0), ("gputq-auto", 16, 4.0, 2.0), ("gputq-auto", 64, 6.0, 2.0),
        ("gputq-auto-uint8", 16, 5.0, 3.0), ("gputq-auto-uint8", 64, 8.0, 4.0),
        ("gputq-tcp", 16, 2.0, 1.0), ("gputq-tcp", 64, 9.0, 1.0),
        ("ray", 4, 9.0, 1.0), ("ray", 16, 2.0, 1.0), ("ray", 64, 2.0, 1.0),
        ("mooncake", 16, 2.0, 1.0), ("mooncake", 64, 4.0, 2.0)]]
    out = speedups(rows, ["gputq-auto", "gputq-auto-uint8", "gputq-tcp", "ray", "mooncake"])
    # The headline is auto's, not the best transport's (tcp's 4.5x at 64 MiB does not count).
    assert out["get_speedup_vs_ray"] == 2.0
    assert out["get_speedup_vs_ray_by_transport"] == {"gputq-tcp": 1.0}
    assert out["get_speedup_vs_mooncake"] == 1.5
    assert out["put_speedup_vs_mooncake"] == 2.0  # the compact row's put
    assert out["put_speedup_vs_mooncake_int32"] == 1.0
    assert out["get_speedup_vs_mooncake_compact"] == 2.0
    assert "get_speedup_vs_socket" not in out and "get_speedup_vs_transferqueue" not in out
    assert speedups(rows, ["gputq-auto", "ray"], goal_min_mib=4)["get_speedup_vs_ray"] == pytest.approx(0.111)


def test_summarise_prints_the_median_and_range_over_runs(tmp_path, capsys):
    logs = []
    for n, (get, ratio) in enumerate([(1.0, 0.5), (3.0, 0.7), (2.0, 0.9)]):
        result = {"systems": ["gputq-auto"], "get_speedup_vs_mooncake": ratio,
                  "rows": [{"system": "gputq-auto", "via": "shm", "stored": "int32", "shard_MiB": 16.5,
                            "put_GBps": 1.0, "get_GBps": get, "get_ms": 10.0, "restore_ms": 2.0 * (n + 1)}]}
        logs.append(tmp_path / f"run{n}.log")
        logs[-1].write_text(f"command: ...\n{json.dumps(result)}\n")
    main(["--summarise", *map(str, logs)])
    out = capsys.readouterr().out
    assert "median (range) over 3 runs" in out
    assert "2 (1-3)" in out and "0.4 (0.2-0.6)" in out  # get GB/s; the restore's share of the get
    assert "get_speedup_vs_mooncake: 0.7 (0.5-0.9)  (runs: 0.5, 0.7, 0.9)" in out


@pytest.mark.timeout(60)
def test_socket_worker_reports_one_row_per_size():
    class Args:
        sizes, repeats, layers, topk, rows, experts, mooncake_batch_keys = "0.25,0.5", 2, 4, 2, 256, 128, 0

    result = run_worker("socket", Args)
    assert [r["shard_MiB"] for r in result["rows"]] == [0.25, 0.5]
    assert all(r["get_GBps"] > 0 and r["put_GBps"] > 0 and r["via"] == "tcp" for r in result["rows"])


@needs_mooncake
@pytest.mark.timeout(60)
def test_mooncake_master_is_stopped_by_its_pid_when_the_body_fails():
    with pytest.raises(KeyError):
        with MooncakeMaster() as master:
            pid = master.proc.pid
            assert not _gone(pid)
            raise KeyError("the body fails")
    assert _gone(pid)


def _peers(*args, timeout=120) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--sizes", "0.5", "--repeats", "1", "--layers",
                           "4", "--topk", "2", "--rows", "256", "--goal-min-mib", "0", "--plots", "", "--json",
                           *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_mooncake
@pytest.mark.ray
@pytest.mark.timeout(150)
def test_peers_bench_against_mooncake_reports_its_ratios_and_leaves_no_store_behind():
    out = _peers("--systems", "gputq-auto,mooncake")
    assert not out["errors"]
    rows = {r["system"]: r for r in out["rows"]}
    assert set(rows) == {"gputq-auto", "mooncake"}
    assert rows["gputq-auto"]["via"] == "shm"  # what auto picks for a reader on the unit's host
    assert rows["gputq-auto"]["stored"] == rows["mooncake"]["stored"] == "int32"
    assert all(r["shard_MiB"] == 0.5 and r["samples"] == 64 and r["get_GBps"] > 0 for r in rows.values())
    assert 0 <= rows["gputq-auto"]["restore_ms"] <= rows["gputq-auto"]["get_ms"]
    assert all(r["get_faults_per_MiB"] >= 0 for r in rows.values())
    for key, op in {"get_speedup_vs_mooncake": "get", "put_speedup_vs_mooncake_int32": "put"}.items():
        expected = rows["gputq-auto"][f"{op}_GBps"] / rows["mooncake"][f"{op}_GBps"]
        assert out[key] == pytest.approx(expected, rel=0.01, abs=0.002)
    assert "put_speedup_vs_mooncake" not in out  # that one needs the compact row, not run here
    pids = out["pids"]["mooncake"]
    assert set(pids) == {"mooncake_master", "mooncake_holder"}
    assert all(_gone(pid) for pid in pids.values())


def _no_hosts() -> str | None:
    from bench.hosts import unavailable

    return unavailable() or _NO_MOONCAKE


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(220 + TEARDOWN_GRACE_S + 20)
def test_peers_across_two_hosts_reads_the_other_hosts_bytes_and_leaves_nothing_behind():
    reason = _no_hosts()
    if reason is not None:
        pytest.skip(f"two hosts with Mooncake Store cannot run here: {reason}")
    proc = run_torn_down([sys.executable, "-m", "bench.peers_hosts", "--sizes", "0.5", "--repeats", "1", "--layers",
                          "4", "--topk", "2", "--rows", "256", "--json"], 220, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["system"]: r for r in out["rows"]}
    assert set(rows) == {"gputq-auto", "gputq-auto-uint8", "mooncake"} and out["holder_host"] != out["reader_host"]
    assert rows["gputq-auto"]["via"] == "tcp"  # auto's pick for a unit on another host without InfiniBand
    assert rows["gputq-auto"]["stored"] == "int32" and rows["gputq-auto-uint8"]["stored"] == "uint8"
    assert 0 < rows["gputq-auto"]["restore_ms"] < rows["gputq-auto"]["get_ms"] and "restore_ms" not in rows["mooncake"]
    compact = rows["gputq-auto-uint8"]["get_GBps"] / rows["mooncake"]["get_GBps"]
    assert out["get_speedup_vs_mooncake_compact"] == pytest.approx(compact, rel=0.01, abs=0.002)
    assert all(r["samples"] == 64 and r["get_GBps"] > 0 and r["put_GBps"] > 0 for r in rows.values())
    expected = rows["gputq-auto"]["get_GBps"] / rows["mooncake"]["get_GBps"]
    assert out["get_speedup_vs_mooncake"] == pytest.approx(expected, rel=0.01, abs=0.002)
    assert not any(out["leftovers"].values())
