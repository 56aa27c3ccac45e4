"""``python -m bench.put`` runs end to end and ends with its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


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
