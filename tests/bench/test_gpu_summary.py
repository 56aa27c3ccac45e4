"""The table ``bench/gpu_check.sh`` ends with, read from what its steps leave in ``$OUT``.

The benchmarks run here for real where they can without a GPU: the shard
fetch into "GPU" memory under the CuPy stand-in (``tests/host_cuda.py``),
the anchors and the kernel benchmark on the host. What only a GPU writes
(the kernel's per-dtype rows, the pinned copy) comes from the benchmarks'
own result builders, so the table and the benchmarks cannot drift apart.
"""

from __future__ import annotations

import json
import re

import pytest

import bench.anchors
import bench.fetch
import bench.kernel
import bench.trainer
from bench.gpu_summary import GOALS, main, summary_rows
from bench.kernel import kernel_result

pytestmark = pytest.mark.timeout(120)


def _run(capsys, module, argv: list) -> str:
    module.main(argv)
    return capsys.readouterr().out


def _step_outputs(out, capsys) -> None:
    (out / "date").write_text("2026-12-01T10:00:00Z\n")
    (out / "gpu").write_text("GPU 0: stand-in\n")
    (out / "pytest_gpu.log").write_text("........s.\n======= 12 passed, 3 skipped in 4.20s =======\n")
    (out / "anchors.log").write_text(_run(capsys, bench.anchors, ["--mib", "1", "--repeats", "1", "--json"]))
    (out / "kernel.log").write_text(_run(capsys, bench.kernel, ["--json"]))
    for transport in ("shm", "tcp"):  # rdma left nothing: a step killed by its timeout
        (out / f"fetch_{transport}.log").write_text(_run(capsys, bench.fetch, [
            "--device", "cuda", "--transport", transport, "--sizes", "1", "--repeats", "1", "--json"]))
    # The trainer over shm as the script runs it, small; over tcp nothing: killed by its timeout too.
    (out / "trainer_shm.log").write_text(_run(capsys, bench.trainer, [
        "--dp", "1", "--pp", "2", "--cp", "2", "--layers", "4", "--topk", "2", "--tokens", "8192", "--samples", "2",
        "--scales", "2", "--repeats", "1", "--step-samples", "4", "--overlap-steps", "1", "--transport", "shm",
        "--figures", "", "--json"]))


def test_every_step_is_a_line_of_the_table_even_without_a_gpu(tmp_path, capsys, host_cuda):
    pytest.importorskip("torch", reason="the fetches into GPU memory return torch tensors: make test installs torch")
    _step_outputs(tmp_path, capsys)
    rows = summary_rows(tmp_path)
    table = dict(rows)
    assert table["GPU tests"] == "12 passed, 3 skipped in 4.20s"
    assert table["anchors"].startswith("no CUDA device") and table["anchor host_memcpy"].endswith(" GB/s")
    assert "needs a CUDA device" in table["kernel"]
    assert any(check.startswith("kernel host side, ") for check in table)
    fetches = [check for check in table if check.startswith("fetch+restore->GPU ")]
    assert [check.rsplit(" ", 2)[0] for check in fetches] == [
        "fetch+restore->GPU shm copy", "fetch+restore->GPU shm in place", "fetch+restore->GPU shm stream",
        "fetch+restore->GPU tcp copy", "fetch+restore->GPU tcp stream"]
    assert "fetch alone" in table[fetches[0]] and "fetch alone" not in table[fetches[1]]  # in place: no transfer
    assert table["fetch rdma"] == "fetch_rdma.log: missing (the step did not run)"
    (stream_row,) = [check for check in table if check.startswith("trainer stream shm ")]
    # Any magnitude: on a busy machine the tiny run's ratios reach 10 and more.
    assert re.fullmatch(r"\d+\.\d\dx its ceiling \(widen x2 threads, [\d.]+ GB/s\), later half \d+\.\d\dx, "
                        r"one widening thread \d+\.\d\dx, its restores alone \d+\.\d\dx", table[stream_row]), \
        table[stream_row]
    assert re.fullmatch(r"\d+\.\d{3}, after the first micro-batch \d+\.\d{3}", table["trainer overlap shm"])
    assert table["trainer tcp"] == "trainer_tcp.log: missing (the step did not run)"
    assert table["transport"] == "transport.log: missing (the step did not run)"
    main([str(tmp_path)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["gputq GPU check 2026-12-01T10:00:00Z on GPU 0: stand-in", GOALS]
    assert len(printed) == 2 + len(rows)


def test_a_step_that_raised_or_wrote_nothing_shows_why_in_its_line(tmp_path):
    (tmp_path / "fetch_shm.log").write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                            "gputq.errors.InvalidInputError: device='cuda', but no usable CUDA "
                                            "device (CuPy sees none)\n")
    (tmp_path / "trainer_tcp.log").write_text("")
    table = dict(summary_rows(tmp_path))
    assert table["fetch shm"] == ("fetch_shm.log ends without its JSON line: gputq.errors.InvalidInputError: "
                                  "device='cuda', but no usable CUDA device (CuPy sees none)")
    assert table["trainer tcp"] == "trainer_tcp.log: empty (killed by its timeout before it wrote a line?)"
    assert table["fetch rdma"] == "fetch_rdma.log: missing (the step did not run)"


def test_gpu_rows_carry_their_ratios_to_the_copies_of_the_same_run(tmp_path):
    (tmp_path / "anchors.log").write_text(json.dumps({"bench": "anchors", "pinned_h2d": 50.0, "device_copy": 4300.0,
                                                      "host_memcpy": 10.0, "socket": 3.8}) + "\n")
    steps = {2: 1.0, 4: 1.25}
    results = {"uint8": kernel_result(4_000_000_000, 1.25, 1.0, 5.0, 30.0, True, steps),
               "uint16": kernel_result(4_000_000_000, 1.0, 1.0, 4.0, 30.0, False, {})}
    packed = {"experts": 384, "bits": 9, "row_bytes": 9, "out_bytes": 10**9, "kernel_ms": 0.5, "copy_ms": 0.45,
              "kernel_out_gbps": 2000.0, "copy_out_gbps": 2222.2, "ratio_vs_copy": 0.9, "matches_reference": False}
    (tmp_path / "kernel.log").write_text("...\n" + json.dumps({"results": results, "packed": packed, "host": {
        "fragments": 1077, "table_us": 38.0, "launch_us": 44.0}}) + "\n")
    (tmp_path / "fetch_shm.log").write_text(json.dumps({"rows": [
        {"shard_MiB": 256.0, "path": "in place", "fetch+restore_GBps": 45.0, "fetch_GBps": None}]}) + "\n")
    (tmp_path / "trainer_tcp.log").write_text("...\n" + json.dumps({
        "overlap_ratio": 1.0412, "overlap_ratio_after_first": 1.0101, "throughput_rows": [
            {"slice_MiB": 48.0, "stream_vs_ceiling": 0.8123, "ceiling": "socket, widened as it lands",
             "ceiling_GBps": 3.3, "second_half_vs_ceiling": 0.9}]}) + "\n")
    (tmp_path / "transport.log").write_text("...\n" + json.dumps({"rows": [
        {"shape": "1024x16KiB", "MiB": 16.0, "rdma/nixl": 0.644, "rdma ahead/nixl": 0.864,
         "rdma steady/nixl": 0.848, "nixl GB/s": 3.53, "tcp/socket": 0.838}]}) + "\n")
    table = dict(summary_rows(tmp_path))
    assert table["rdma vs raw NIXL 1024x16KiB (16 MiB)"] == (
        "one read 0.64x, reads leased ahead 0.86x, once the first lease is answered 0.85x (3.53 GB/s); "
        "tcp 0.84x socket")
    assert table["trainer stream tcp 48 MiB"] == ("0.81x its ceiling (socket, widened as it lands, 3.3 GB/s), "
                                                  "later half 0.90x")
    assert table["trainer overlap tcp"] == "1.041, after the first micro-batch 1.010"
    assert table["anchor pinned_h2d"] == "50.0 GB/s" and table["anchor device_copy"] == "4300.0 GB/s"
    assert table["kernel uint8"] == "3200 GB/s, 0.80x copy (4000), 4.0x naive (800)"
    assert table["kernel uint8, 2 groups/thread"] == "4000 GB/s, 1.00x copy"
    assert table["kernel uint8, 4 groups/thread"] == "3200 GB/s, 0.80x copy"
    assert table["kernel uint16"].endswith("WRONG BYTES (differs from naive torch)")
    assert table["kernel host side, 1077 frags"] == "table 38 us, whole call 44 us"
    assert table["unpack E=384 (9 bits)"] == ("2000 GB/s out, 0.90x a copy of its output (2222), WRONG BYTES "
                                              "(differs from the host codec)")
    assert table["fetch+restore->GPU shm in place 256.0 MiB"] == "45.0 GB/s, 0.90x pinned"
    assert table["GPU tests"] == "no result" and "fetch tcp" in table
