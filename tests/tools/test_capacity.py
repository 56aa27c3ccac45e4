"""The capacity model: exact analytical figures, the calibrated projection, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gputq.errors import ConfigError
from gputq.tools.capacity import (
    PRESETS,
    TIB,
    Calibration,
    RolloutShape,
    growth,
    local_unit_increment,
    main,
    master_peak_bytes,
    parse_tokens,
    r3_bytes,
    reference_figures,
    threshold_prompts,
)
from gputq.tools.cli import main as cli_main

LARGE = PRESETS["744b-a40b"]
SMALL = PRESETS["35b-a3b"]


def test_r3_bytes_of_the_744b_preset_is_exactly_2_34375_tib():
    assert r3_bytes(LARGE) == 262144 * 75 * 8 * 4 * 4096
    assert r3_bytes(LARGE) / TIB == 2.34375


def test_ten_segments_make_23_4375_tib():
    assert r3_bytes(replace(LARGE, segments=10)) / TIB == 23.4375


def test_growth_from_35b_to_744b_is_7_5():
    assert growth(SMALL, LARGE) == 7.5


def test_local_unit_increment_is_0_46875_and_halves_with_uint16():
    assert local_unit_increment(SMALL, LARGE) == 0.46875
    assert local_unit_increment(SMALL, replace(LARGE, dtype="uint16")) == 0.234375


def test_dtype_scales_bytes_per_id():
    assert r3_bytes(LARGE, "uint8") * 4 == r3_bytes(LARGE, "uint16") * 2 == r3_bytes(LARGE)


@pytest.mark.parametrize("experts, topk, per_layer", [(128, 8, 7), (384, 8, 9), (512, 10, 12), (256, 8, 8)])
def test_packed_ids_take_ceil_log2_e_bits_per_id(experts, topk, per_layer, capsys):
    shape = replace(LARGE, topk=topk, dtype="packed", experts=experts)
    assert r3_bytes(shape) == 262144 * 4096 * 75 * per_layer
    assert main(["--dtype", "packed", "--experts", str(experts), "--topk", str(topk), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["layer_row_bytes"], out["token_row_bytes"]) == (per_layer, 75 * per_layer)
    assert out["r3_bytes"] == r3_bytes(shape)
    assert main(["--dtype", "packed", "--experts", str(experts), "--topk", str(topk)]) == 0
    assert f"{per_layer} B per layer, {75 * per_layer} B per token" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--dtype", "packed"], "needs the expert count"),
                                           (["--dtype", "uint8", "--experts", "384"], "do not fit uint8"),
                                           (["--dtype", "packed", "--experts", "70000"], "at most 16")])
def test_packed_without_experts_or_experts_beyond_the_dtype_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_token_lengths_replace_the_product():
    shape = RolloutShape(layers=2, topk=3, dtype="uint16", token_lengths=(10, 20, 5))
    assert r3_bytes(shape) == 35 * 2 * 3 * 2


@pytest.mark.parametrize("text,tokens", [("256K", 262144), ("64k", 65536), ("1M", 1 << 20), ("5000", 5000)])
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "abc", "0", "1.5"])
def test_parse_tokens_rejects_non_counts(text):
    with pytest.raises(ConfigError):
        parse_tokens(text)


def test_bad_shape_is_a_config_error():
    with pytest.raises(ConfigError):
        RolloutShape(dtype="float16")
    with pytest.raises(ConfigError):
        RolloutShape(units=0)


def test_master_peak_follows_the_calibration():
    cal = Calibration(centralised=2.0, residual=0.1, local_unit=1.0)
    s = r3_bytes(LARGE)
    assert master_peak_bytes(LARGE, cal, offload=False) == 2.0 * s
    assert master_peak_bytes(LARGE, cal, offload=True) == 0.1 * s + s / 32
    # The centralised path carries int32 whatever is stored; the local unit holds the stored dtype.
    compact = replace(LARGE, dtype="uint16")
    assert master_peak_bytes(compact, cal, offload=False) == 2.0 * s
    assert master_peak_bytes(compact, cal, offload=True) == 0.1 * s + s / 2 / 32


def test_published_factor_reproduces_the_published_threshold():
    # 3.84 TiB at 512 prompts is 1.6384 bytes per R3 byte; that puts 2 TB at ~243 prompts.
    cal = Calibration(centralised=3.84 / 2.34375, residual=0.0, local_unit=1.0)
    assert master_peak_bytes(LARGE, cal, offload=False) / TIB == pytest.approx(3.84)
    assert round(threshold_prompts(LARGE, cal, 2e12, offload=False)) == 243


def test_reference_figures_carry_exact_and_projected():
    ref = reference_figures()
    assert ref["analytical"] == {"r3_tib_744b_256k_4096": 2.34375, "r3_tib_10_segments": 23.4375,
                                 "growth_35b_to_744b": 7.5, "local_unit_increment": 0.46875,
                                 "local_unit_increment_uint16": 0.234375}
    assert set(ref["projected"]) == set(ref["published"])


def test_calibration_from_bench_reads_the_last_line(tmp_path):
    path = tmp_path / "memory.log"
    path.write_text("table\n" + json.dumps({"calibration": {"centralised": 3, "residual": 0.5,
                                                            "local_unit": 1.1}}) + "\n")
    assert Calibration.from_bench(str(path)) == Calibration(3.0, 0.5, 1.1, source=str(path))
    path.write_text("$ python -m bench.memory --json\n" + json.dumps({"calibration": {
        "centralised": 2, "residual": 0.1, "local_unit": 1}}) + "\nrc=0\n")
    assert Calibration.from_bench(str(path)).centralised == 2.0
    path.write_text("no json here\n{\"rows\": []}\n")
    with pytest.raises(ConfigError):
        Calibration.from_bench(str(path))


def test_cli_reports_a_bad_calibration_file_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "empty.log"
    path.write_text("")
    assert main(["--calibration", str(path)]) == 2
    assert "no bench.memory --json line" in capsys.readouterr().err
    assert main(["--context", "abc"]) == 2


def test_json_output_has_r3_and_master_peak_both_ways(capsys):
    assert main(["--preset", "744b-a40b", "--segments", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["r3_bytes"] / TIB == 23.4375
    assert set(out["master_peak_bytes"]) == {"without_offload", "with_offload"}
    assert out["master_peak_bytes"]["with_offload"] < out["master_peak_bytes"]["without_offload"]


def test_context_file_of_token_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n200, 300\n")
    assert main(["--context", str(path), "--layers", "1", "--topk", "1", "--dtype", "uint8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["r3_bytes"] == 600 and out["segments_from_file"] == 3


def test_console_script_has_capacity(capsys):
    assert cli_main(["capacity", "--preset", "35b-a3b", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "S_R3" in out and "2.34375 TiB" in out and "0.46875x" in out
