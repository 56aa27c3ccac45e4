"""``python -m bench.put`` runs end to end and ends with its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from bench.put import caller_and_other_cores, on_cores


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_put_runs_small_and_reports_its_ratios(tmp_path):
    log = tmp_path / "put.log"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "bench.put", "--tokens", "256", "--puts", "20",
                           "--kinds", "uint8,logprobs", "--throughput-steps", "4", "--throughput-tokens", "256",
                           "--log", str(log), "--json"],
                          capture_output=True, text=True, timeout=240, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "put" and result["put_p50_vs_pass"] > 0 and result["put_p99_vs_p50"] >= 1
    assert result["logprobs_put_p50_us"] > 0
    assert [(r["kind"], r["tokens"], r["puts"]) for r in result["rows"]] == [("uint8", 256, 20), ("logprobs", 256, 20)]
    assert [t["threads"] for t in result["throughput"]] == [1, 4]
    assert all(t["steps_per_s"] > 0 for t in result["throughput"])
    assert "[2/2] logprobs x 256 tokens" in done.stderr  # progress
    text = log.read_text()
    assert "== gputq put" in text and text.count("raw ") == 4


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core affinity is a Linux feature")
@pytest.mark.timeout(60)
def test_caller_core_splits_the_cores_and_the_block_restores_them():
    allowed = os.sched_getaffinity(0)
    assert caller_and_other_cores(None) == (None, None)
    with pytest.raises(ValueError, match="--caller-core 4096"):
        caller_and_other_cores(4096)
    if len(allowed) < 2:
        pytest.skip("one core: nothing to split")
    core = min(allowed)
    caller, others = caller_and_other_cores(core)
    assert caller == {core} and others == allowed - {core}
    seen = {}

    def child():
        seen["thread"] = os.sched_getaffinity(0)

    with on_cores(others):
        thread = threading.Thread(target=child)
        thread.start()
        thread.join(10)
        assert os.sched_getaffinity(0) == others
    assert seen["thread"] == others and os.sched_getaffinity(0) == allowed  # started threads keep them
