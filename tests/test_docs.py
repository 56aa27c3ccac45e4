"""The docs state current figures: every log a page cites is there, and only those are kept."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOGS = ROOT / "docs" / "logs"
_CITED = re.compile(r"logs/([A-Za-z0-9_.:-]+\.log)")


def _cited() -> set[str]:
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/gpu/*.md"), *ROOT.glob("gputq/**/*.py")]
    return {name for page in pages for name in _CITED.findall(page.read_text())}


def test_every_cited_log_is_kept_and_only_those():
    cited, kept = _cited(), {path.name for path in LOGS.glob("*.log")}
    assert sorted(cited - kept) == []  # a figure without its log
    assert sorted(kept - cited) == []  # a log no page cites: replaced when its figure was rerun


def test_the_performance_page_opens_with_its_table_of_current_figures():
    page = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    assert len(page.splitlines()) <= 350
    header = next(line for line in page.splitlines() if line.startswith("| benchmark |"))
    assert header == "| benchmark | figure | baseline | goal | value: median (range) | date | commit | command |"
    assert page.index(header) < page.index("\n## Master-node memory")
