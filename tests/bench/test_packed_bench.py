"""``python -m bench.packed`` on a tiny step: exact stored bytes and the ratios it reports."""

from __future__ import annotations

import json

import pytest

from bench.packed import main

pytestmark = pytest.mark.timeout(60)


def test_packed_bench_reports_exact_row_bytes_and_both_ratios(capsys):
    assert main(["--tokens", "64", "--layers", "2", "--repeats", "1", "--shapes", "128/8,384/8,512/10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["experts"], r["bits"], r["row_bytes"], r["uint16_row_bytes"]) for r in rows] == \
        [(128, 7, 7, 16), (384, 9, 9, 16), (512, 9, 12, 20)]
    assert all(r["pack_vs_pass"] > 0 and r["unpack_vs_widen"] > 0 for r in rows)


def test_packed_bench_refuses_a_zero_count():
    with pytest.raises(SystemExit):
        main(["--tokens", "0"])
