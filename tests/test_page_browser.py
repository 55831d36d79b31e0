"""The timeline page in a real browser: headless Chromium loads it, runs its script, and the DOM
it leaves must hold the chart and the table drawn from the records; a screenshot is written.

Chromium is Debian's ``chromium`` package (``.ci/run`` installs it). Without it the test skips
on a developer machine and fails where ``FLOWEXEC_REQUIRE_BROWSER`` is set (CI sets it): a
missing browser must not pass as a green test there."""
from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from flowexec.profiler.merge import merge_spans
from flowexec.profiler.page import write_page
from flowexec.profiler.summary import summarize

from timeline_data import pipeline_spans


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("FLOWEXEC_REQUIRE_BROWSER"):
        pytest.fail("FLOWEXEC_REQUIRE_BROWSER is set but no chromium is on PATH (apt-get install chromium)")
    pytest.skip("no chromium on PATH (set FLOWEXEC_REQUIRE_BROWSER=1 to make this a failure)")


def run_chromium(*args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--disable-extensions", "--virtual-time-budget=5000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class DomReader(HTMLParser):
    """The elements the page drew: span rects, step lines, flow paths, table cells by rank and
    column."""

    def __init__(self) -> None:
        super().__init__()
        self.rects: list[dict[str, str]] = []
        self.steplines: list[str] = []
        self.flows = 0
        self.cells: dict[tuple[str, str], str] = {}
        self.rendered: str | None = None
        self._row: str | None = None
        self._col: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "")
        if tag == "body":
            self.rendered = a.get("data-rendered")
        elif tag == "rect" and cls == "span":
            self.rects.append(a)
        elif tag == "line" and cls == "stepline":
            self.steplines.append(a["data-step"])
        elif tag == "path" and cls == "flow":
            self.flows += 1
        elif tag == "tr" and cls == "rank-row":
            self._row = a["data-rank"]
        elif tag == "td" and self._row is not None:
            self._col = a.get("data-col")

    def handle_endtag(self, tag):
        if tag == "td":
            self._col = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._row is not None and self._col is not None:
            self.cells[(self._row, self._col)] = self.cells.get((self._row, self._col), "") + data


@pytest.mark.timeout(300)
def test_page_draws_chart_and_table_from_the_records_in_chromium(tmp_path):
    spans = merge_spans(pipeline_spans(offsets=(0, 2_000_000_000)))
    page = write_page(spans, str(tmp_path / "timeline.html"),
                      {"schedule": "1f1b", "n_stages": 2, "n_micro": 4, "theory_bubble": 0.2,
                       "theory_bubble_measured_costs": {0: 0.1234, 1: 0.2346}},
                      {0: (0, 0), 1: (2_000_000_000, 850)})
    res = run_chromium("--dump-dom", "file://" + page)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = DomReader()
    dom.feed(res.stdout)
    assert dom.rendered == str(len(spans)), "the page's script did not finish drawing"
    # one bar per span, each at the record's time and length (µs from the earliest span)
    assert len(dom.rects) == len(spans)
    t0 = min(s.start_ns for s in spans)
    drawn = sorted((r["data-rank"], r["data-label"], float(r["data-ts"]), float(r["data-dur"])) for r in dom.rects)
    want = sorted((str(s.rank), (f"{s.kind} mb{s.micro}" if s.micro is not None else s.kind),
                   round((s.start_ns - t0) / 1e3, 3), round(s.duration_ns / 1e3, 3)) for s in spans)
    assert drawn == want
    assert {r["data-kind"] for r in dom.rects} == {"F", "B", "OPT", "send", "recv", "wait"}
    assert sorted(dom.steplines) == ["10", "11"]
    assert dom.flows == 16  # every send to its receive
    # the table: one row per rank, figures as the records give them
    for row in summarize(spans, 0.2):
        r = str(row.rank)
        assert dom.cells[(r, "busy")] == f"{100 * row.busy:.1f} %"
        assert dom.cells[(r, "bubble")] == f"{100 * row.bubble:.1f} %"
        assert dom.cells[(r, "theory")] == "20.0 %"
        assert dom.cells[(r, "theory-costs")] == ("12.3 %", "23.5 %")[row.rank]
        assert dom.cells[(r, "steps")] == "2"
        assert dom.cells[(r, "mean-F")] == f"{row.mean_ns['F'] / 1e6:.3f} ×8"
        assert dom.cells[(r, "mean-B")] == f"{row.mean_ns['B'] / 1e6:.3f} ×8"
    # and a picture of it
    shot = tmp_path / "timeline.png"
    res = run_chromium("--window-size=1400,560", f"--screenshot={shot}", "file://" + page)
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
