"""The console script, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from gputq.tools.cli import build_parser, demo_setup
from gputq.tools.demo import format_summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=150, env=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUTQ_")}, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gputq.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


#: The demo and stats run on Ray: without the ray extra they say what to install (the test after these).
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray: pip install 'gputq[ray]'")


@needs_ray
def test_parser_defaults_match_documented_demo():
    args = build_parser().parse_args(["demo"])
    assert (args.sessions, args.units, args.dtype, args.transport) == (8, None, None, None)
    options, config = demo_setup(args, env={})
    assert (options.units, options.dtype, options.transport) == (2, "int32", "auto")


@pytest.mark.parametrize("argv", [["demo"], ["stats", "--once"]])
def test_without_ray_the_demo_and_stats_say_what_to_install_in_one_line(argv, capsys, monkeypatch):
    from gputq.tools.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("this needs Ray: pip install 'gputq[ray]'") and len(err.splitlines()) == 1, err


@needs_ray
def test_demo_reads_the_libraries_file_and_environment(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("num_units: 3\nrouted_experts_dtype: uint8\n")
    args = build_parser().parse_args(["demo", "--experts", "200"])
    options, config = demo_setup(args, env={"GPUTQ_CONFIG": str(path), "GPUTQ_TRANSPORT": "tcp"})
    assert (options.units, options.dtype, options.transport) == (3, "uint8", "tcp")
    args = build_parser().parse_args(["demo", "--units", "1", "--transport", "auto", "--dtype", "uint16"])
    options, _ = demo_setup(args, env={"GPUTQ_CONFIG": str(path), "GPUTQ_TRANSPORT": "tcp"})
    assert (options.units, options.dtype, options.transport) == (1, "uint16", "auto")  # flags win


@pytest.mark.parametrize("args, env, message", [
    (["demo", "--units", "0"], {}, "argument --units: must be at least 1, got 0"),
    (["demo", "--ranks", "0"], {}, "argument --ranks: must be at least 1, got 0"),
    (["demo", "--tokens", "many"], {}, "argument --tokens: 'many' is not an integer"),
    (["demo", "--device", "tpu"], {}, "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--dtype", "uint8", "--experts", "300"], {}, "expert IDs up to 299 do not fit uint8"),
    (["demo"], {"GPUTQ_TRANSPORT": "udp"}, "environment variable GPUTQ_TRANSPORT='udp': transport must be one of"),
    (["demo"], {"GPUTQ_NUM_UNITS": "2.5"}, "GPUTQ_NUM_UNITS='2.5': num_units must be an integer"),
    (["demo", "--config", "/nonexistent/tq.yaml"], {}, "cannot read transfer-queue config /nonexistent/tq.yaml"),
    (["stats", "--interval", "0"], {}, "argument --interval: must be a finite number of seconds in (0, 604800]"),
])
def test_bad_input_is_one_line_and_exit_2_before_ray(args, env, message):
    started = time.monotonic()
    proc = _run(*args, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr
    assert time.monotonic() - started < 20  # refused before any Ray start-up


def test_cuda_without_a_gpu_is_refused():
    from gputq.kernels import cuda_available

    if cuda_available():
        pytest.skip("this machine has a CUDA device")
    proc = _run("demo", "--device", "cuda", timeout=60)
    assert proc.returncode == 2 and "no usable CUDA device" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_help_shows_defaults():
    proc = _run("demo", "--help", timeout=60)
    assert proc.returncode == 0
    assert "(default: 8)" in proc.stdout and "(default: 1024)" in proc.stdout
    assert "(default: lineage)" in proc.stdout
    proc = _run("stats", "--help", timeout=60)
    assert "(default: auto)" in proc.stdout and "--check" in proc.stdout


@needs_ray
@pytest.mark.ray
@pytest.mark.slow
def test_demo_json_last_line_reports_verified():
    proc = _run("demo", "--json", "--sessions", "2", "--steps", "2", "--layers", "4", "--topk", "2",
                "--tokens", "32", "--transport", "tcp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("verified", "segments", "unique_keys_fetched_per_rank", "bytes_offloaded", "fetch_restore_gbps"):
        assert key in result
    assert result["verified"] is True and result["transport"] == ["tcp"]
    assert result["bytes_offloaded"] > 0 and result["segments"] >= 2
    assert result["keys_left_after_release"] == 0
    # The speed shown is what a rank waits for: bytes over its fetch and restore, not the transfer alone.
    assert "fetch_gbps" not in result and result["fetch_restore_seconds"] > 0
    assert result["fetch_restore_gbps"] == pytest.approx(
        result["bytes_fetched"] / result["fetch_restore_seconds"] / 1e9, rel=1e-2)
    assert f"cold fetch+restore {result['fetch_restore_gbps']:.2f} GB/s over ['tcp']" in format_summary(result)


def test_import_needs_only_numpy():
    blocked = ["torch", "cupy", "nixl", "ray", "msgpack", "yaml", "prometheus_client"]
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "import gputq, transport, kernels, gputq.integrations.sglang, gputq.integrations.slime, gputq.cluster.metrics\n"
            "print(len(gputq.__all__))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 20


def test_a_numeric_token_in_the_config_file_is_refused_without_showing_it(tmp_path):
    path = tmp_path / "tq.yaml"
    path.write_text("num_units: 1\ntoken: 1234567890123456\n")
    proc = _run("demo", "--config", str(path), timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "token must be a string" in line and "tq.yaml" in line
    assert "1234567890123456" not in proc.stderr + proc.stdout


_BINARY = b"\xff\xfe\x00\x81binary"


@pytest.mark.parametrize("argv,message", [
    (["capacity", "--calibration", "{binary}"], "not UTF-8 text"),
    (["capacity", "--context", "{binary}"], "not UTF-8 text"),
    (["capacity", "--layers", "1" + "0" * 400], "layers must be in [1, 1e+09]"),
    (["capacity", "--segments", "nan"], "segments must be a finite number"),
    (["capacity", "--segments", "inf"], "segments must be a finite number"),
    (["capacity", "--host-tb", "-1"], "--host-tb must be a finite number of TB"),
    (["capacity", "--host-tb", "0"], "--host-tb must be a finite number of TB"),
    (["capacity", "--host-tb", "nan"], "--host-tb must be a finite number of TB"),
    (["capacity", "--calibration", "{negative}"], "centralised must be a finite number > 0, got -1.0"),
    (["capacity", "--calibration", "{nan}"], "residual must be a finite number >= 0, got nan"),
    (["demo", "--config", "{binary}"], "not UTF-8 text"),
    (["demo", "--seed", "-1"], "--seed: must be in [0, 2**63)"),
    (["demo", "--tokens", "1000000000"], "GiB of expert IDs twice, more than this machine's"),
    (["stats", "--interval", "inf"], "--interval: must be a finite number of seconds"),
    pytest.param(["stats", "--once", "--address", "127.0.0.1:1"], "no Ray cluster at --address '127.0.0.1:1'",
                 marks=needs_ray),
])
def test_every_bad_cli_value_is_one_line_and_exit_2_before_anything_starts(argv, message, tmp_path, capsys,
                                                                           monkeypatch):
    """Values that once ended in a traceback (exit 1) or printed NaN and negative figures (exit 0)."""
    from gputq.cluster import names
    from gputq.tools.cli import main

    def no_ray():
        raise AssertionError("Ray must not start for a bad value")

    monkeypatch.setattr(names, "import_ray", no_ray)
    monkeypatch.setattr("gputq.tools.cli.import_ray", no_ray)
    files = {"binary": tmp_path / "binary", "negative": tmp_path / "negative.json", "nan": tmp_path / "nan.json"}
    files["binary"].write_bytes(_BINARY)
    files["negative"].write_text(json.dumps({"calibration": {"centralised": -1, "residual": 0.1, "local_unit": 1.1}}))
    files["nan"].write_text('{"calibration": {"centralised": 2.0, "residual": NaN, "local_unit": 1.1}}')
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal of a flag's value
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and len(err.splitlines()) == 1, err
