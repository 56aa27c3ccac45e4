"""The console script, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gputq.cli import build_parser


def _run(*args, timeout=150):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "gputq.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_parser_defaults_match_documented_demo():
    args = build_parser().parse_args(["demo"])
    assert (args.sessions, args.units, args.dtype, args.transport) == (8, 2, "uint16", "auto")


@pytest.mark.ray
@pytest.mark.slow
def test_demo_json_last_line_reports_verified():
    proc = _run("demo", "--json", "--sessions", "2", "--steps", "2", "--layers", "4", "--topk", "2",
                "--tokens", "32", "--transport", "tcp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("verified", "segments", "unique_keys_fetched_per_rank", "bytes_offloaded", "fetch_gbps"):
        assert key in result
    assert result["verified"] is True
    assert result["bytes_offloaded"] > 0 and result["segments"] >= 2


def test_import_needs_only_numpy():
    blocked = ["torch", "cupy", "nixl", "ray", "msgpack", "yaml"]
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "import gputq, transport, kernels\n"
            "print(len(gputq.__all__))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 20
