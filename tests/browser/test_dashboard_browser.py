"""The dashboard page in a real (headless) browser: live against a server, and as a saved file.

Each test renders the page with Chromium's ``--dump-dom`` and checks the stable DOM hooks:
``body[data-ready="1"]``, ``path.series`` in ``#loss-chart`` / ``#throughput-chart``,
``tr.child-row[data-path]`` in ``#children``, ``#alerts``, ``#cadence``, ``#breadcrumb``.
Record strings carrying markup must come out as text (escaped in the dump), never as elements.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flodl.monitor.archive import save_dashboard
from flodl.monitor.dashboard import DashboardThread
from flodl.monitor.hub import RecordHub
from flodl.monitor.records import RecordLog, make_record, read_tree

if TYPE_CHECKING:  # the fixture's type; conftest modules are not imported by name
    from conftest import Browser

T0 = 1_700_000_000_000
HOSTILE = '<img src=x onerror="document.title=1">'
LATE_MARKER = "late_marker"
WAIT_S = 10.0

pytestmark = pytest.mark.timeout(60)


def synthetic_records(step: int) -> list[dict[str, Any]]:
    """One step of a 2-rank run: a record per rank and the root aggregate."""
    ts = T0 + 500 * step
    out = [
        make_record(
            f"root/rank{r}",
            "node",
            {
                "loss": 2.0 / (step + 1) + 0.1 * r,
                "throughput": 120.0 * (r + 1),
                "batch_share": (0.35, 0.65)[r],
                "steps": 10 * step,
                "compute_only_ms": 4.0 + r,
            },
            ts_ms=ts,
        )
        for r in (0, 1)
    ]
    out.append(
        make_record(
            "root",
            "node",
            {
                "loss": 2.0 / (step + 1) + 0.05,
                "throughput": 360.0,
                "epoch": step // 10,
                "anchor": 4,
                "sync_ms": 11.5,
                "batch_counts": [3, 6],
                "syncs": step,
                "heartbeat_age_s": [0.4, 1.1],
            },
            ts_ms=ts,
        )
    )
    return out


def run_start() -> list[dict[str, Any]]:
    meta = make_record(
        "root",
        "meta",
        {
            "reductions": {"loss": "mean", "throughput": "sum", "data_starve_ms": "max"},
            "run": {"world_size": 2, "mode": "cadence", "hosts": ["localhost"]},
        },
        ts_ms=T0,
    )
    event = make_record(
        "root/rank1",
        "event",
        {"class": "drift", "detail": HOSTILE, "count": 3},
        sev="warning",
        ts_ms=T0 + 1000,
    )
    return [meta, event]


def element(dom: str, tag: str, element_id: str) -> str:
    """The serialized element ``<tag id=element_id ...>...</tag>`` (no nesting of ``tag``)."""
    m = re.search(rf'<{tag}\b[^>]*\bid="{element_id}"[^>]*>(.*?)</{tag}>', dom, re.DOTALL)
    assert m is not None, f"no <{tag} id={element_id!r}> in the DOM"
    return m[1]


def assert_rendered(dom: str) -> None:
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom), "the page never finished a render"
    for chart in ("loss-chart", "throughput-chart"):
        assert len(re.findall(r'<path\b[^>]*\bclass="series"', element(dom, "svg", chart))) >= 1
    rows = re.findall(r'<tr\b[^>]*\bclass="child-row"[^>]*>', element(dom, "table", "children"))
    assert len(rows) == 2
    assert {re.search(r'data-path="([^"]+)"', row)[1] for row in rows} == {  # type: ignore[index]
        "root/rank0",
        "root/rank1",
    }
    assert "loss (work-weighted mean)" in dom
    assert "throughput (sum)" in dom
    alerts = element(dom, "ol", "alerts")
    assert "drift ×3" in alerts
    # The markup in the event detail is text: escaped in the dump, never an element.
    assert "&lt;img src=x" in alerts
    assert "<img" not in dom
    cadence = element(dom, "dl", "cadence")
    assert "batch counts" in cadence and "3, 6" in cadence
    assert "root" in element(dom, "nav", "breadcrumb")


class SignallingHub(RecordHub):
    """Sets ``history_served`` once the page has read the history of its whole scope (the
    last read before it streams)."""

    def __init__(self) -> None:
        super().__init__()
        self.history_served = threading.Event()

    def history_json(
        self,
        path: str,
        n: int = 200,
        *,
        children: bool = False,
        deep: Collection[str] = (),
        kinds: Collection[str] | None = None,
    ) -> str:
        try:
            return super().history_json(path, n, children=children, deep=deep, kinds=kinds)
        finally:
            if children:
                self.history_served.set()


@pytest.fixture
def live_run() -> Iterator[tuple[SignallingHub, DashboardThread]]:
    """A dashboard fed by a publisher thread: a 2-rank run, then one record every 50 ms, and a
    marker event as soon as the page has read its history (so only the stream can carry it)."""
    hub = SignallingHub()
    for record in run_start():
        hub.publish(record)
    for step in range(30):
        for record in synthetic_records(step):
            hub.publish(record)
    stop = threading.Event()

    def publisher() -> None:
        step = 30
        marker_sent = False
        while not stop.wait(0.05):
            if not marker_sent and hub.history_served.is_set():
                hub.publish(
                    make_record(
                        "root",
                        "event",
                        {"class": LATE_MARKER, "detail": "sent after /history", "count": 1},
                        sev="critical",
                        ts_ms=T0 + 500 * step,
                    )
                )
                marker_sent = True
            for record in synthetic_records(step):
                hub.publish(record)
            step += 1

    thread = threading.Thread(target=publisher, name="synthetic-run", daemon=True)
    # Streams end every second so that Chromium's virtual time can advance (see conftest).
    dash = DashboardThread(hub, stream_lifetime_s=1.0)
    dash.start()
    thread.start()
    try:
        yield hub, dash
    finally:
        stop.set()
        thread.join(WAIT_S)
        dash.stop()


def test_live_page_renders_history_and_streamed_records(
    browser: Browser, live_run: tuple[SignallingHub, DashboardThread]
) -> None:
    hub, dash = live_run
    dom = browser.dump_dom(dash.url)
    assert browser.console_errors() == []
    assert_rendered(dom)
    assert hub.history_served.is_set()
    assert LATE_MARKER in element(dom, "ol", "alerts"), "a streamed record never reached the page"
    assert "mode cadence" in dom and "world size 2" in dom


def test_live_page_drills_down_to_a_rank(
    browser: Browser, live_run: tuple[SignallingHub, DashboardThread]
) -> None:
    _, dash = live_run
    dom = browser.dump_dom(dash.url + "#root/rank1")
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom)
    crumb = element(dom, "nav", "breadcrumb")
    assert 'href="#root"' in crumb and "rank1" in crumb
    assert 'class="child-row"' not in dom
    assert re.search(r'<path\b[^>]*\bclass="series"', element(dom, "svg", "loss-chart"))
    assert "drift ×3" in element(dom, "ol", "alerts")


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """A saved dashboard of a 2-rank run written through the real record log."""
    logdir = tmp_path / "records"
    with RecordLog(logdir) as log:
        for record in run_start():
            log.write(record)
        for step in range(40):
            for record in synthetic_records(step):
                log.write(record)
    return save_dashboard(tmp_path / "run.html", read_tree(logdir), theme="dark")


def test_saved_dashboard_renders_from_file_without_a_server(
    browser: Browser, archive: Path, tmp_path: Path
) -> None:
    url = archive.as_uri()
    dom = browser.dump_dom(url)
    assert browser.console_errors() == []  # CSP (connect-src 'none') refused nothing
    assert_rendered(dom)
    assert re.search(r'<html\b[^>]*\bdata-theme="dark"', dom)
    assert "archive · " in element(dom, "span", "status")
    png = browser.screenshot(url, tmp_path / "x.png")
    data = png.read_bytes()
    assert len(data) > 1000
    assert data.startswith(b"\x89PNG\r\n\x1a\n")


def test_saved_dashboard_drills_down_by_hash(browser: Browser, archive: Path) -> None:
    dom = browser.dump_dom(archive.as_uri() + "#root/rank0")
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom)
    assert 'href="#root"' in element(dom, "nav", "breadcrumb")
    assert 'class="child-row"' not in dom
    assert re.search(r'<path\b[^>]*\bclass="series"', element(dom, "svg", "throughput-chart"))
