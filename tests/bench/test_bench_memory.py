"""bench.memory's counting, and the memory and peers benchmarks end to end at tiny sizes."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from bench.hosts import TEARDOWN_GRACE_S, run_torn_down, unavailable
from bench.memory import MASTER, Rollout, host_shares, main, rollout_plan
from bench.memsample import process_memory, summarise
from gputq.tools.synthetic import SyntheticConfig
from gputq.unit.arena import Arena


def test_process_memory_counts_an_arena_whole_and_apart():
    before_pss, before_arena = process_memory(os.getpid())
    assert before_pss > 0
    with Arena(8 << 20, "bench-test", pin=False) as arena:
        arena.array[:] = 1
        pss, arena_bytes = process_memory(os.getpid())
    assert arena_bytes - before_arena == 8 << 20
    assert abs(pss - before_pss) < 4 << 20  # the arena is not also in the PSS figure


class _Sampler:
    def __init__(self, samples, marks=()):
        self.samples, self.marks = samples, list(marks)


def test_summarise_takes_data_above_idle_and_the_peak_of_the_sum():
    samples = [
        (0.0, {"proxy": 100, "su-0": 1100, "su-0:arena": 1000, "object_store": 0}),
        (1.0, {"proxy": 150, "su-0": 1100, "su-0:arena": 1000, "object_store": 40}),
        (2.0, {"proxy": 110, "su-0": 1120, "su-0:arena": 1000, "object_store": 60}),
    ]
    out = summarise(_Sampler(samples), ["proxy", "su-0", "object_store"], baseline_until=0.5, group=MASTER)
    assert out["components"]["proxy"] == {"raw": 150, "data": 50, "baseline": 100}
    assert out["components"]["su-0"]["data"] == 1020  # arena whole + 20 above the idle rest
    # per sample: 50 + 1000 + 40 = 1090 at t=1, 10 + 1020 + 60 = 1090 at t=2
    assert out["master_data"] == 1090
    assert out["master_raw"] == max(100 + 1100 + 0, 150 + 1100 + 40, 110 + 1120 + 60)
    assert set(MASTER) >= {"proxy", "su-0", "object_store"}


def test_rollout_plan_places_every_step_and_scales_with_dtype():
    rollout = Rollout(sessions=3, synth=SyntheticConfig(sessions=1, steps_per_session=2, layers=4, topk=2,
                                                        prompt_tokens=64, tokens_per_step=64, seed=5))
    wide = rollout_plan(rollout, ["su-0", "su-1"], "int32")
    narrow = rollout_plan(rollout, ["su-0", "su-1"], "uint8")
    assert wide["r3_int32"] == narrow["r3_int32"] > 0
    assert set(wide["per_unit"]) == {"su-0", "su-1"}
    assert sum(wide["per_unit"].values()) >= wide["r3_int32"]
    assert sum(narrow["per_unit"].values()) < sum(wide["per_unit"].values())
    assert all(v % 256 == 0 for v in wide["per_unit"].values())
    # packed: 8 IDs below 64 at 6 bits, 6 bytes a row and layer against uint8's 8 (each step's blob 256-aligned)
    rollout = Rollout(sessions=2, synth=SyntheticConfig(sessions=1, steps_per_session=2, layers=4, topk=8,
                                                        num_experts=64, prompt_tokens=640, tokens_per_step=640, seed=5))
    packed, uint8 = (sum(rollout_plan(rollout, ["su-0"], d)["per_unit"].values()) for d in ("packed", "uint8"))
    assert 0.74 < packed / uint8 < 0.8


def test_host_shares_compare_the_masters_unit_with_one_over_n():
    central = {"path": "centralised", "master_data": 1000}
    run = {"path": "gputq", "dtype": "uint16", "master_data": 150,
           "components": {"su-0": {"data": 52}, "su-1": {"data": 48}, "proxy": {"data": 90}},
           "stored_per_unit": {"su-0": 60, "su-1": 40}}
    shares = host_shares([central, run], central, 2)
    assert shares["n"] == 2 and shares["ideal_share"] == 0.5
    assert shares["dtypes"]["uint16"] == {"local_unit_share": 0.52, "stored_share": 0.6, "within_10pct": True,
                                          "stored_within_10pct": False, "local_unit_of_central": 0.052,
                                          "ratio": 0.15}


@pytest.mark.timeout(10)
def test_hosts_without_cap_net_admin_say_why_and_exit_zero(monkeypatch, capsys):
    reason = "needs CAP_NET_ADMIN (run as root) to create network namespaces and veth pairs"
    monkeypatch.setattr("bench.hosts.unavailable", lambda: reason)
    main(["--hosts", "2", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert f"skipped: {reason}" in out and json.loads(out[-1]) == {"bench": "memory", "skipped": reason}


def _bench(module, *args, timeout=290):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = run_torn_down([sys.executable, "-m", module, *args], timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_memory_bench_json_and_figures(tmp_path):
    pytest.importorskip("grpc", reason="bench.memory reads the object store through Ray's grpc client")
    pytest.importorskip("matplotlib")
    out = _bench("bench.memory", "--units", "2", "--dtypes", "int32,uint16", "--sessions", "2", "--steps", "2",
                 "--tokens", "64", "--layers", "4", "--topk", "2", "--idle", "0.3", "--json-compact",
                 "--fixed-capacity-mib", "4", "--plots", str(tmp_path), "--json")
    assert 0 < out["master_peak_ratio"] and out["verified"] is True
    assert [(r["path"], r["units"], r["dtype"], r["arena"]) for r in out["runs"]] == [
        ("centralised", 0, "int32", "-"), ("gputq", 2, "int32", "sized"), ("gputq", 2, "uint16", "sized"),
        ("gputq", 2, "int32", "fixed"), ("gputq", 2, "uint16", "fixed")]
    central, int32, uint16, fixed32, fixed16 = (r["master_data"] for r in out["runs"])
    assert out["master_peak_ratio"] == uint16 / central and out["master_peak_ratio_int32"] == int32 / central
    assert out["narrowing"] == {"uint16": uint16 / int32}
    assert out["fixed"] == {"capacity_MiB": 4, "master_peak_ratio_int32": fixed32 / central,
                            "master_peak_ratio_uint16": fixed16 / central}
    assert [r["capacity_per_unit"] for r in out["runs"][3:]] == [4 << 20] * 2
    assert all(r["capacity_per_unit"] < (1 << 20) + (1 << 19) for r in out["runs"][1:3])  # sized: 1 MiB + the run
    assert set(out["runs"][1]["components"]) >= {"proxy", "rollout_manager", "controller", "su-0", "su-1",
                                                 "object_store"}
    assert {"centralised", "residual", "local_unit"} <= set(out["calibration"])
    for name in ("memory_timeline.png", "memory_peaks.png", "memory_share_vs_units.png", "capacity_curve.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.slow  # a Ray cluster on two network namespaces: tens of seconds, minutes beside busy cores
@pytest.mark.ray
@pytest.mark.timeout(580 + TEARDOWN_GRACE_S + 20)
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_memory_bench_on_two_hosts_measures_the_master_on_host_0_and_leaves_nothing():
    pytest.importorskip("grpc", reason="bench.memory reads the object store through Ray's grpc client")
    out = _bench("bench.memory", "--hosts", "2", "--dtypes", "int32,uint16", "--sessions", "2", "--steps", "2",
                 "--tokens", "64", "--layers", "4", "--topk", "2", "--idle", "0.3", "--json-compact", "--json",
                 timeout=580)
    assert out["verified"] is True and out["config"]["hosts"] == 2
    assert [(r["path"], r["units"], r["dtype"]) for r in out["runs"]] == [
        ("centralised", 0, "int32"), ("gputq", 2, "int32"), ("gputq", 2, "uint16")]
    assert not any(r["arena"] == "fixed" for r in out["runs"])
    for run in out["runs"][1:]:  # both units measured: the master's on host 0, the other on host 1
        assert {"proxy", "rollout_manager", "controller", "su-0", "su-1"} <= set(run["components"])
        assert set(run["stored_per_unit"]) == {"su-0", "su-1"} and sum(run["stored_per_unit"].values()) > 0
        share = out["hosts"]["dtypes"][run["dtype"]]
        units = run["components"]["su-0"]["data"], run["components"]["su-1"]["data"]
        assert share["local_unit_share"] == units[0] / sum(units)
        assert share["ratio"] == run["master_data"] / out["runs"][0]["master_data"]
    assert out["hosts"]["n"] == 2 and out["hosts"]["ideal_share"] == 0.5
    assert out["master_peak_ratio_int32"] == out["hosts"]["dtypes"]["int32"]["ratio"]
    assert out["leftovers"] == {"namespaces": [], "processes": [], "tmp": [], "ray_processes": [], "ray_pointer": []}


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_peers_bench_with_transferqueue(tmp_path):
    pytest.importorskip("transfer_queue", reason="needs the bench extra: pip install 'gputq[bench]'")
    pytest.importorskip("matplotlib")
    out = _bench("bench.peers", "--sizes", "16", "--repeats", "1", "--layers", "4", "--topk", "2",
                 "--systems", "gputq-auto,transferqueue,ray", "--plots", str(tmp_path), "--json")
    assert not out["errors"]
    assert {r["system"] for r in out["rows"]} == {"gputq-auto", "transferqueue", "ray"}
    assert out["get_speedup_vs_transferqueue"] > 0 and out["get_speedup_vs_ray"] > 0
    assert (tmp_path / "peers_bandwidth.png").stat().st_size > 1000
    assert np.isfinite(out["get_speedup_vs_ray"])
