"""``python -m bench.release`` at a tiny size: both sides per transport, every key freed by the releasing passes."""

from __future__ import annotations

import json

import pytest

from bench import release

ARGS = ["--samples", "4", "--tokens", "64", "--layers", "2", "--topk", "2", "--pairs", "1", "--compute-ms", "0.5"]


@pytest.mark.timeout(180)
def test_release_bench_times_both_sides_over_tcp_and_shm(capsys):
    assert release.main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "release" and [row["transport"] for row in out["rows"]] == ["tcp", "shm"]
    for row in out["rows"]:
        assert row["keep_ms"] > 0 and row["release_ms"] > 0 and row["release_vs_keep"] > 0
        assert row["keep_wait_ms"] >= 0 and row["release_wait_ms"] >= 0


@pytest.mark.timeout(120)
def test_release_bench_fails_a_pass_that_leaves_keys(monkeypatch):
    real = release.stream_pass
    monkeypatch.setattr(release, "stream_pass", lambda *args, release=None: real(*args))  # releases nothing
    with pytest.raises(AssertionError, match="8 keys left after a pass that released every micro-batch"):
        release.main([*ARGS, "--transports", "tcp"])


def test_release_bench_refuses_bad_options():
    for bad in (["--transports", "udp"], ["--pairs", "0"], ["--compute-ms", "-1"]):
        with pytest.raises(SystemExit):
            release.main(bad)
