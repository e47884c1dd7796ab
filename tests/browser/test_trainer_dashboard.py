"""The dashboard of a real 2-rank Trainer run in headless Chromium: the live page while the
ranks train, then the self-contained file ``save_dashboard`` wrote at the end.

The run is the integration tests' user script (``tests/integration/callbacks_main.py``) with
``--dashboard --save-dashboard`` and a held-out eval every 5 epochs; ranks sleep a few ms a
step so the run lasts long enough to be looked at while it trains. Both pages draw the run
panels from the coordinator's own records: the eval curve, the per-rank timeline of the last
averaging windows, the roster (the run's formation) and the contribution table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Browser

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "callbacks_main.py"

pytestmark = pytest.mark.timeout(240)


def element(dom: str, tag: str, element_id: str) -> str:
    m = re.search(rf'<{tag}\b[^>]*\bid="{element_id}"[^>]*>(.*?)</{tag}>', dom, re.DOTALL)
    assert m is not None, f"no <{tag} id={element_id!r}> in the DOM"
    return m[1]


def assert_run_rendered(dom: str, sampled: set[str] | None = None) -> None:
    """The page drew the run; ``sampled``: the ranks whose resource samples it holds (``None``:
    not known, as on the live page between two samples)."""
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom), "the page never finished a render"
    for chart in ("loss-chart", "throughput-chart"):
        series = re.findall(r'<path\b[^>]*\bclass="series"', element(dom, "svg", chart))
        assert series, f"no series in #{chart}"
    rows = re.findall(r'<tr\b[^>]*\bclass="child-row"[^>]*>', element(dom, "table", "children"))
    paths = {re.search(r'data-path="([^"]+)"', row)[1] for row in rows}  # type: ignore[index]
    assert paths == {"root/rank0", "root/rank1"}
    assert "loss (work-weighted mean)" in dom and "throughput (sum)" in dom
    assert "anchor" in element(dom, "dl", "cadence")
    # the run panels: a timeline lane per rank, the formation in the roster, a resource row
    # per sampled rank (the ranks sample every 5 s)
    assert not re.search(r'<div\b[^>]*\bid="run-panels"[^>]*\bhidden', dom)
    timeline = element(dom, "svg", "timeline")
    assert set(re.findall(r'<g\b[^>]*\bclass="lane"[^>]*\bdata-rank="(\d+)"', timeline)) == {
        "0",
        "1",
    }
    assert 'data-change="formed"' in element(dom, "table", "roster")
    resources = element(dom, "table", "resources")
    drawn = set(
        re.findall(r'<td>(rank\d+)</td><td class="wrap">cpu</td><td>[\d.]+ %</td>', resources)
    )
    if sampled is None:
        assert drawn <= {"rank0", "rank1"} and (drawn or "no resource samples" in resources)
    else:
        assert drawn == sampled, resources
        assert (not drawn) == ("no resource samples" in resources)


def archived(html: str) -> list[dict[str, Any]]:
    """Every record the saved page embeds."""
    tag = r'<script type="application/json" id="flodl-archive">(.*?)</script>'
    m = re.search(tag, html, re.DOTALL)
    assert m is not None, "no embedded archive"
    return [rec for recs in json.loads(m[1])["records"].values() for rec in recs]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_live_dashboard_during_a_two_rank_run_and_the_saved_file_after(
    browser: Browser, tmp_path: Path
) -> None:
    saved = tmp_path / "dashboard.html"
    cmd = [
        sys.executable,
        str(SCRIPT),
        *("--tag", f"flodl-test-{uuid.uuid4().hex}", "--log-dir", str(tmp_path / "logs")),
        *("--ranks", "2", "--epochs", "20", "--samples", "4096", "--max-anchor", "10"),
        *("--slow", "0:12,1:20", "--reports", "4", "--dashboard", "--eval", "--eval-every", "5"),
        *("--save-dashboard", str(saved), "--theme", "dark"),
    ]
    env = {**os.environ, "FLODL_DASHBOARD_STREAM_S": "1", "FLODL_NET_TIMEOUT_SCALE": "0.5"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    try:
        assert proc.stdout is not None
        url = None
        seen: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("flodl dashboard: "):
                url = line.split(": ", 1)[1].strip()
            if url and line.startswith("METRICS "):
                break  # an epoch is in: the page has data to draw
        assert url is not None and url.startswith("http://127.0.0.1:"), "".join(seen)[-2000:]
        assert proc.poll() is None, "the run ended before the live page could be looked at"
        # hostile queries against the live server: 4xx with a message, the run unaffected
        for query, code in (
            ("/node?path=root/../../etc/passwd", 400),
            ("/node?path=root/rank0%3Cscript%3E", 400),
            ("/node?path=root/rank9", 404),
            ("/history?path=root&n=0", 400),
            ("/history?path=root&n=99999999", 400),
            ("/nope", 404),
        ):
            status, body = get(url.rstrip("/") + query)
            assert status == code, (query, status, body)
            assert "error" in json.loads(body)
        status, body = get(url.rstrip("/") + "/paths")
        assert status == 200 and set(json.loads(body)) >= {"root", "root/rank0", "root/rank1"}
        # live, while the ranks train
        dom = browser.dump_dom(url)
        assert_run_rendered(dom)
        assert browser.console_errors() == []
        assert proc.poll() is None, "the run must still be training during the live check"
        shot = browser.screenshot(url, tmp_path / "live.png")
        assert shot.stat().st_size > 10_000
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "DONE " in out
    # after the run: the server is gone, the file shows the whole run with no server
    assert saved.is_file() and saved.stat().st_size < 5_000_000
    html = saved.read_text()
    assert 'const ARCHIVE_THEME="dark";' in html or "const ARCHIVE_THEME='dark';" in html
    assert "connect-src 'none'" in html  # the file makes no network request
    file_dom = browser.dump_dom(saved.as_uri())
    sampled = {
        f"rank{rec['data']['rank']}"
        for rec in archived(html)
        if rec["kind"] == "resource" and rec["data"].get("cpu_percent") is not None
    }
    assert sampled == {"rank0", "rank1"}  # each rank sends a last sample as it finishes
    assert_run_rendered(file_dom, sampled)
    assert browser.console_errors() == []
    final_shot = browser.screenshot(saved.as_uri(), tmp_path / "saved.png")
    assert final_shot.stat().st_size > 10_000
    # every epoch of the run is in the archive
    epochs = set(re.findall(r'"epoch":(\d+)', html))
    assert {str(e) for e in range(20)} <= epochs, sorted(epochs)
    # the run panels' records are embedded, and the file draws them
    records = archived(html)
    kinds = {rec["kind"] for rec in records}
    assert {"window", "eval", "contribution", "callback", "job"} <= kinds, sorted(kinds)
    evals = [rec for rec in records if rec["kind"] == "eval"]
    assert {rec["data"]["epoch"] for rec in evals} == {4, 9, 14, 19}, evals
    windows = [rec for rec in records if rec["kind"] == "window"]
    contribution = [rec for rec in records if rec["kind"] == "contribution"]
    assert [rec["data"]["epoch"] for rec in contribution] == list(range(20))
    chart = element(file_dom, "svg", "eval-chart")
    assert len(re.findall(r'<circle\b[^>]*\bclass="point"', chart)) == len(evals)
    timeline = element(file_dom, "svg", "timeline")
    drawn = re.findall(r'<rect\b[^>]*\bclass="win"[^>]*\bdata-cycle="(\d+)"', timeline)
    assert [int(c) for c in drawn] == [rec["data"]["cycle"] for rec in windows[-20:]]
    assert re.search(r'class="seg compute"', timeline)
    advice = re.findall(
        r'<tr\b[^>]*\bdata-advice="(\w+)"', element(file_dom, "table", "contribution")
    )
    assert len(advice) == 2 and set(advice) <= {"keep", "cpu_async", "evict"}, advice
