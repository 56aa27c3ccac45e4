"""bench.fetch and bench.e2e at tiny sizes: they run, verify and report what the docs quote."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys

import numpy as np
import pytest

from bench import e2e, fetch, trainer, trainer_rank, trainer_throughput
from bench.common import SelfTimed, remote_units, same_host_copy_threads
from bench.trainer_rank import EXPERTS, MIB, micro_batches, rank_fields, rank_slice, rollout, run_python
from gputq.client.reader import Reader
from gputq.client.writer import Writer
from gputq.config import GputqConfig


@pytest.mark.timeout(120)
def test_fetch_times_call_to_return_and_reports_the_socket_ratio(capsys):
    fetch.main(["--sizes", "1", "--repeats", "2", "--layers", "4", "--topk", "2", "--rows-per-step", "256",
                "--mb-samples", "64",
                "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row, streamed = out["rows"]
    assert (row["path"], streamed["path"]) == ("copy", "stream")
    assert row["transport"] == streamed["transport"] == "tcp" and row["ratio_vs_socket"] > 0
    # The call-to-return figure includes the transfer, so it can never be the faster one.
    assert row["fetch+restore_GBps"] <= row["fetch_GBps"]
    assert streamed["ratio_vs_socket"] > 0 and streamed["fetch_GBps"] is None  # transfers overlap restores
    # Both memcpys are reported; the goal's is on as many threads as the path copies with.
    assert row["threads"] == same_host_copy_threads(1) and streamed["threads"] == fetch.STREAM_THREADS
    assert row["memcpy_GBps"] > 0 and row["memcpy1_GBps"] > 0 and row["goal"] == "n/a (< 16 MiB)"
    assert out["goal_met"] == {} and out["goal_met_all"] is False  # no shard of 16 MiB here
    for r in (row, streamed):  # the no-gputq ceiling, against the goal's baseline (the socket over tcp)
        assert r["ceiling_GBps"] > 0 and r["ceiling_vs_goal_base"] > 0 and r["total_vs_ceiling"] > 0


@pytest.mark.timeout(120)
def test_fetch_compares_packed_ids_with_uint16_per_restored_byte_over_the_same_steps(capsys):
    fetch.main(["--sizes", "1", "--repeats", "2", "--layers", "4", "--topk", "8", "--rows-per-step", "256",
                "--mb-samples", "64", "--dtype", "uint16,packed", "--experts", "384", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["dtype"], r["path"]) for r in out["rows"]] == [("uint16", "copy"), ("uint16", "stream"),
                                                              ("packed", "copy"), ("packed", "stream")]
    wide, packed = out["rows"][0], out["rows"][2]
    assert wide["samples"] == packed["samples"] and wide["out_vs_first"] == 1.0 and packed["out_vs_first"] > 0
    # the same steps, stored at 9 bytes a row and layer instead of 16 (logprobs are 4 bytes a row in both)
    rows = wide["samples"] * 256
    assert abs(packed["shard_MiB"] - rows * (4 * 9 + 4) / 2**20) <= 0.05  # (rounded to 0.1 MiB)
    assert abs(wide["shard_MiB"] - rows * (4 * 16 + 4) / 2**20) <= 0.05


@pytest.mark.timeout(120)
def test_fetch_over_shm_reports_the_staged_and_the_in_place_restore_against_memcpy(capsys):
    fetch.main(["--sizes", "1", "--repeats", "2", "--layers", "4", "--topk", "2", "--rows-per-step", "256",
                "--mb-samples", "64",
                "--transport", "shm", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    copy, in_place, streamed = out["rows"]
    assert (copy["path"], in_place["path"], streamed["path"]) == ("copy", "in place", "stream")
    assert streamed["fetch+restore_GBps"] > 0 and streamed["fetch_vs_memcpy"] is None
    assert copy["transport"] == in_place["transport"] == "shm"
    assert copy["fetch_vs_memcpy"] > 0 and copy["fetch_GBps"] >= copy["fetch+restore_GBps"]
    # in place there is no transfer apart from the restore's own reads
    assert in_place["fetch_GBps"] is None and in_place["fetch_vs_memcpy"] is None
    assert in_place["total_vs_memcpy"] > 0
    assert all(r["ceiling_vs_goal_base"] > 0 for r in out["rows"])  # a widen on the memcpy's threads


@pytest.mark.timeout(300)
def test_trainer_reports_bytes_memory_and_overlap_per_rank(capsys, tmp_path):
    # Scales from 2: the stream's buffers are sized over the smallest scale's shard, not --samples. Segments of
    # 32K tokens: slices of 0.5 and 1 MiB, over which a widen's CPU shows beside a pass's fixed costs (at 2K
    # tokens, slices of tens of KiB, the receivers' CPU per MiB was those costs, in either order).
    trainer.main(["--dp", "1", "--pp", "2", "--cp", "2", "--layers", "4", "--topk", "2", "--tokens", "32768",
                  "--samples", "2", "--scales", "2,4", "--repeats", "1", "--step-samples", "10",
                  "--overlap-steps", "3", "--figures", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["rank"] for r in out["bytes_rows"]] == ["dp0/pp0/cp0", "dp0/pp0/cp1", "dp0/pp1/cp0", "dp0/pp1/cp1"]
    assert out["every_rank_exactly_its_slice"] and out["bytes_goal"] == 0.25
    assert abs(out["bytes_ratio_vs_whole_shard"] / 0.25 - 1) < 0.01  # the group moves the shard once
    paths = {(r["scale"], r["path"]) for r in out["memory_rows"]}
    assert paths == {(2, "stream"), (2, "whole"), (4, "stream"), (4, "whole")}
    assert out["overlap_ratio"] > 0 and out["peak_growth_4x"] > 0
    assert out["overlap"]["step_samples"] == 10 and out["overlap"]["micro_batches"] == 5  # cycling the 8 stored
    assert out["overlap"]["compute"] == "twice the fetch+restore" and out["overlap"]["host_compute"] == "idle"
    assert out["overlap"]["switch_interval_ms"] == round(sys.getswitchinterval() * 1e3, 3)  # the interpreter's
    assert abs(out["overlap"]["compute_ms"] - 2 * out["overlap"]["fetch_restore_ms"]) <= 0.011  # each rounded
    ratios = out["overlap"]["step_ratios"]  # the figure is the median step's, every step's shown beside it
    assert len(ratios) == out["overlap"]["steps"] == 3 and out["overlap_ratio"] == sorted(ratios)[1]
    # Opening the stream (every micro-batch checked and sized) is part of the first micro-batch's wait.
    assert 0 < out["overlap"]["open_ms"] <= out["overlap"]["first_wait_ms"]
    for row in out["throughput_rows"]:  # the cores each side kept busy: the miss reason on a CPU-bound box
        assert 0 < row["stream_cores"] <= os.cpu_count() + 0.5 and 0 < row["baseline_cores"] <= os.cpu_count() + 0.5
        assert row["cpu_per_byte_vs_baseline"] > 0
        assert row["unit_requests_per_micro_batch"] >= 1  # over tcp a read request at least per micro-batch
        assert row["ceiling"] == "socket, widened as it lands" and row["ceiling_GBps"] > 0
        assert row["ceiling_vs_baseline"] > 0 and row["stream_vs_ceiling"] > 0 and row["second_half_vs_ceiling"] > 0
        assert row["reads_GBps"] > 0 and row["reads_vs_baseline"] > 0 and row["stream_vs_reads"] > 0
        receiving = ("stream_receiver", "stream_units", "baseline_receiver", "baseline_sender", "ceiling_receiver",
                     "reads_receiver")
        assert all(row[f"{side}_us_per_MiB"] > 0 for side in receiving), row
        if os.path.exists("/proc/self/task"):  # the kernel says how long each side's threads waited for a core
            waiting = ("stream_receiver", "stream_units", "baseline_receiver", "baseline_sender")
            assert all(row[f"{side}_waiting_cores"] >= 0 for side in waiting), row
            # and the CPU of each of the receiver's threads: over tcp the fetch thread widens as replies land
            assert row["stream_fetch_thread_us_per_MiB"] > 0 and row["stream_consumer_us_per_MiB"] > 0, row
            assert row["stream_restore_thread_us_per_MiB"] >= 0, row
    assert gc.get_freeze_count() == 0  # the trainer's frozen objects are thawed once the bench ends


@pytest.mark.timeout(300)
def test_trainer_overlap_at_a_fixed_compute_over_shm(capsys, tmp_path):
    # Two libraries compared at one compute: the goal's (twice the fetch+restore) grows with a slower stream.
    # The compute runs Python here, under a switch interval of 1 ms for the overlap's steps only.
    interval = sys.getswitchinterval()
    trainer.main(["--dp", "1", "--pp", "2", "--cp", "2", "--layers", "4", "--topk", "2", "--tokens", "8192",
                  "--samples", "2", "--scales", "2,4", "--repeats", "1", "--step-samples", "8",
                  "--overlap-steps", "1", "--overlap-compute-ms", "3.5", "--transport", "shm", "--figures", "",
                  "--host-compute", "python", "--switch-interval-ms", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["transport"] == "shm" and out["every_rank_exactly_its_slice"]
    for row in out["throughput_rows"]:  # the ceiling's widen on two threads, and on one as the stream's restore
        assert row["baseline"] == "memcpy x2 threads" and row["ceiling"] == "widen x2 threads"
        assert row["one_thread_widen_GBps"] > 0 and row["one_thread_widen_vs_ceiling"] > 0
        assert row["second_half_vs_ceiling"] > 0
        # the stream's restores alone, timed beside it: the same plans' widen over the leased mappings
        assert row["restores_GBps"] > 0 and row["restores_vs_ceiling"] > 0 and row["stream_vs_restores"] > 0
        if os.path.exists("/proc/self/task"):  # in place, the restore thread widens; the fetch thread leases
            stages = [row[f"stream_{stage}_us_per_MiB"] for stage in trainer_throughput.STAGE_THREADS]
            assert all(us > 0 for us in stages), row
            assert sum(stages) <= 1.1 * row["stream_receiver_us_per_MiB"] + len(stages), row  # a share of it
    assert "one_thread_widen_vs_ceiling" not in out  # no slice of 16 MiB or more here: no summary figure
    assert out["overlap"]["compute"] == "fixed" and out["overlap"]["compute_ms"] == 3.5
    assert out["overlap"]["host_compute"] == "python" and out["overlap"]["switch_interval_ms"] == 1
    assert sys.getswitchinterval() == interval  # set for the overlap's steps, then restored
    # Four micro-batches of 3.5 ms each: the compute alone, however long the fetches took.
    assert 4 * 3.5e-3 <= out["overlap"]["compute_alone_s"] < 4 * 3.5e-3 + 0.5
    for bad in (["--overlap-compute-ms", "-1"], ["--switch-interval-ms", "-1"], ["--host-compute", "gpu"]):
        with pytest.raises(SystemExit):
            trainer.main(bad)


@pytest.mark.timeout(10)
def test_the_python_compute_stand_in_runs_bytecode_for_its_time_and_never_sleeps(monkeypatch):
    # A clock that moves 1 s a reading: the stand-in reads it until its 10 s are up, never sleeping.
    readings = []

    def clock() -> float:
        readings.append(float(len(readings)))
        return readings[-1]

    def sleep(seconds: float) -> None:
        raise AssertionError("the Python stand-in slept")

    monkeypatch.setattr(trainer_rank, "time", argparse.Namespace(perf_counter=clock, sleep=sleep))
    run_python(10)
    assert readings == [float(i) for i in range(11)]  # the start, then every reading until the 10 s are up


@pytest.mark.timeout(120)
def test_trainer_restores_alone_restore_the_streams_bytes():
    # The figure stands for the stream's own restores: the same plans, widened and shaped into the same bytes.
    args = argparse.Namespace(layers=4, pp=2, cp=2, mb_samples=1, prefetch=2, topk=2, dtype="uint16")
    config = GputqConfig(transport="shm", num_units=2, routed_experts_dtype="uint16", num_experts=EXPERTS,
                         unit_capacity_bytes=64 * MIB, host="127.0.0.1")
    with remote_units(config) as (config, clients), Writer(clients, config) as writer, \
            Reader(clients, config) as reader, contextlib.ExitStack() as stack:
        shard = rollout(writer, 3, 1024, args.layers, args.topk)
        with reader.stream(shard, micro_batches(3, 1), rank_slice(args, 0, 0), fields=rank_fields(args, 0)) as stream:
            streamed = [[np.array(layer) for layer in batch.routed_experts] for batch in stream]
            nbytes = stream.slice_bytes
        restores = trainer_throughput._RestoresAlone(clients, config, shard, args, nbytes, stack)
        assert restores.last is None
        timed = restores()  # its restores' own seconds, the leases taken before the clock not among them
        assert restores.last is not None and isinstance(timed, SelfTimed) and timed > 0
        layers, experts, _ = restores.last
        assert list(layers) == [0, 1] and len(experts) == len(streamed[-1]) == 2
        assert all(np.array_equal(got, want) for got, want in zip(experts, streamed[-1]))
        with pytest.raises(RuntimeError, match="name .* bytes, the stream"):
            trainer_throughput._RestoresAlone(clients, config, shard, args, nbytes + 1, stack)


def test_trainer_second_half_paces_the_later_micro_batches_against_the_ceiling():
    # Four equal micro-batches, the first wait holding the stream's opening: the later two took 2 s, and the
    # ceiling moved the whole slice in 2 s, so their half in 1 s: half the ceiling's pace, the opening aside.
    steps = [(5.0, 0.0), (1.5, 0.0), (1.0, 0.0), (1.0, 0.0)]
    assert trainer_throughput.second_half(steps, 2.0) == 0.5
    assert trainer_throughput.second_half(steps[:3], 3.0) == 0.8  # an odd count: the later two of three, 2.5 s for 2 s


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_e2e_both_paths_verify(capsys):
    e2e.main(["--sessions", "2", "--steps", "2", "--tokens", "32", "--layers", "4", "--topk", "2",
              "--rollouts", "1", "--transport", "tcp", "--unit-mib", "16", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verified"] is True and len(out["rows"]) == 2
    assert out["ray_bytes_ratio"] < 1
