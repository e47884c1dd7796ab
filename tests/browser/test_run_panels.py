"""The dashboard's run panels in headless Chromium: the held-out eval curve, the per-rank
timeline of the last averaging windows (with callback time), the roster changes, the latest
resource sample per rank, and the contribution table with its advice.

The records are hand-made with the coordinator's shapes (``flodl/coord/reporting.py``,
``contribution.py``, ``callbacks.py``, ``machine.py``): a 3-rank run of 25 windows in which
rank 2 is lost for windows 10-12 and rejoins, 3 evals, an eval and a checkpoint callback, two
resource samples and a contribution that advises evicting rank 2. The page is checked as a
saved file (one host: ranks are ``root/rankN``; two hosts: ``root/<host>/rankN``, below the
root's children) and live (two hosts, plus records streamed after the page read its history).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flodl.monitor.archive import save_dashboard
from flodl.monitor.dashboard import DashboardThread
from flodl.monitor.hub import RecordHub
from flodl.monitor.records import make_record

if TYPE_CHECKING:
    from conftest import Browser

T0 = 1_700_000_000_000
HOSTILE = '<img src=x onerror="document.title=1">'
WINDOWS = 25
DRAWN = 20
LOST = range(10, 13)  # rank 2 is not a live rank of these windows
EVICT_REASON = "it trains 11.0 % of the samples but costs the others 31.5 % of the cluster's time"
WAIT_S = 10.0

pytestmark = pytest.mark.timeout(60)


def rank_path(rank: int, hosts: bool) -> str:
    return f"root/{('h0', 'h0', 'h1')[rank]}/rank{rank}" if hosts else f"root/rank{rank}"


def run_records(*, hosts: bool) -> list[dict[str, Any]]:
    """The run's records in publish order (their ``seq`` order in a hub)."""
    ts = iter(range(T0, T0 + 10_000_000, 100))
    out: list[dict[str, Any]] = []

    def add(path: str, kind: str, data: dict[str, Any], sev: str = "info") -> None:
        out.append(make_record(path, kind, data, sev=sev, ts_ms=next(ts)))

    add("root", "meta", {"reductions": {"loss": "mean"}, "run": {"world_size": 3}})
    add("root", "job", {"world_size": 3, "ranks": [0, 1, 2], "job": {"batch_size": 32}})
    epoch = 0
    for w in range(WINDOWS):
        if w == LOST[0]:
            add(
                rank_path(2, hosts),
                "event",
                {"class": "rank_lost", "detail": "rank 2 declared dead: heartbeat timeout"},
                "critical",
            )
        if w == LOST[-1] + 1:
            add(
                rank_path(2, hosts),
                "event",
                {"class": "rank_rejoined", "detail": "rank 2 rejoined (incarnation 1)", "count": 1},
            )
        ranks = [0, 1] if w in LOST else [0, 1, 2]
        busy = {0: 470.0, 1: 300.0, 2: 150.0}
        add(
            "root",
            "window",
            {
                "cycle": w,
                "t_s": 0.5 * (w + 1),
                "span_ms": 500.0,
                "sync_ms": 25.0,
                "averaging_ms": 30.0,
                "ranks": ranks,
                "steps": [int(busy[r] // 10) for r in ranks],
                "busy_ms": [busy[r] for r in ranks],
                "idle_ms": [470.0 - busy[r] for r in ranks],
                "induced_ms": [0.0 if r else 120.0 for r in ranks],
                "ms_per_batch": [10.0 for _ in ranks],
            },
        )
        for r in range(3):
            add(rank_path(r, hosts), "node", {"loss": 1.0 / (w + 1), "throughput": 100.0 * (r + 1)})
        if w in (2, 15, 21):
            add(rank_path(0, hosts), "callback", {"fn": "eval", "elapsed_ms": 120.0})
            add("root", "eval", {"epoch": epoch, "metric": 0.5 + 0.1 * epoch, "rank": 0})
            epoch += 1
        if w == 23:
            add(rank_path(1, hosts), "callback", {"fn": "checkpoint", "elapsed_ms": 60.0})
    add(
        rank_path(0, hosts),
        "resource",
        {
            "kind": "resource_sample",
            "rank": 0,
            "cpu_percent": 97.5,
            "ram_used": 3 * 2**30,
            "ram_total": 16 * 2**30,
            "gpu_util_percent": None,
            "vram_allocated": None,
            "vram_total": None,
        },
    )
    add(
        rank_path(1, hosts),
        "resource",
        {
            "kind": "resource_sample",
            "rank": 1,
            "cpu_percent": 12.0,
            "ram_used": 2**30,
            "ram_total": 8 * 2**30,
            "gpu_util_percent": 64.0,
            "vram_allocated": 5 * 2**30,
            "vram_reserved": 6 * 2**30,
            "vram_total": 24 * 2**30,
            "device": "cuda:0",
            "gpu_name": "NVIDIA L4",
        },
    )
    rows = [
        (0, 0.52, 0.08, "keep", "it trains 52.0 % of the samples for 8.0 % of the cluster's time"),
        (1, 0.37, 0.12, "keep", "it trains 37.0 % of the samples for 12.0 % of the cluster's time"),
        (2, 0.11, 0.315, "evict", EVICT_REASON),
    ]
    add(
        "root",
        "contribution",
        {
            "epoch": 2,
            "ranks": [
                {
                    "rank": r,
                    "live": True,
                    "samples": int(share * 4096),
                    "sample_share": share,
                    "busy_s": 10.0,
                    "idle_s": 1.0,
                    "induced_idle_s": 2.0,
                    "averaging_s": 0.5,
                    "cost_share": cost,
                    "advice": advice,
                    "reason": reason,
                }
                for r, share, cost, advice, reason in rows
            ],
        },
    )
    return out


def element(dom: str, tag: str, element_id: str) -> str:
    """The serialized ``<tag id=element_id>`` element's content (``tag`` not nested in it)."""
    m = re.search(rf'<{tag}\b[^>]*\bid="{element_id}"[^>]*>(.*?)</{tag}>', dom, re.DOTALL)
    assert m is not None, f"no <{tag} id={element_id!r}> in the DOM"
    return m[1]


def lanes(timeline: str) -> dict[int, str]:
    """rank → the serialized content of its lane."""
    found = re.findall(r'<g\b[^>]*\bdata-rank="(\d+)"[^>]*>(.*?)</g>', timeline, re.DOTALL)
    return {int(rank): body for rank, body in found}


def rows(table: str, cls: str) -> list[str]:
    return re.findall(rf'<tr\b[^>]*\bclass="{cls}"[^>]*>.*?</tr>', table, re.DOTALL)


def assert_ready(dom: str, browser: Browser) -> None:
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom), "the page never finished a render"
    assert browser.console_errors() == []
    assert not [line for line in browser.console if "flodl panel error" in line]
    assert 'class="panel-error"' not in dom
    assert re.search(r'<div\b[^>]*\bid="run-panels"', dom)
    assert not re.search(r'<div\b[^>]*\bid="run-panels"[^>]*\bhidden', dom)


def assert_panels(dom: str, *, evals: int = 3) -> None:
    # the eval curve: one line through a point per eval
    chart = element(dom, "svg", "eval-chart")
    assert len(re.findall(r'<circle\b[^>]*\bclass="point"', chart)) == evals
    assert len(re.findall(r'<path\b[^>]*\bclass="series"', chart)) == 1
    assert "epoch 0" in chart and f"epoch {evals - 1}" in chart
    assert "latest " in element(dom, "div", "eval-legend")

    # the timeline: a lane per rank, the last 20 of the 25 windows
    timeline = element(dom, "svg", "timeline")
    cycles = re.findall(r'<rect\b[^>]*\bclass="win"[^>]*\bdata-cycle="(\d+)"', timeline)
    assert [int(c) for c in cycles] == list(range(WINDOWS - DRAWN, WINDOWS))
    by_rank = lanes(timeline)
    assert sorted(by_rank) == [0, 1, 2]
    for rank, lane in by_rank.items():
        assert f"rank {rank}" in lane
        assert len(re.findall(r'class="seg compute"', lane)) == DRAWN - (
            len(LOST) if rank == 2 else 0
        )
        assert len(re.findall(r'class="seg averaging"', lane)) == DRAWN - (
            len(LOST) if rank == 2 else 0
        )
    assert len(re.findall(r'class="seg idle"', by_rank[0])) == 0  # the slowest never waits
    assert len(re.findall(r'class="seg idle"', by_rank[2])) == DRAWN - len(LOST)
    assert len(re.findall(r'class="seg absent"', by_rank[2])) == len(LOST)
    assert "not a live rank" in by_rank[2]
    # callbacks on their rank's lane: the evals after windows 2 (not drawn), 15, 21; a checkpoint
    assert len(re.findall(r'data-fn="eval"', by_rank[0])) == 2
    assert len(re.findall(r'data-fn="checkpoint"', by_rank[1])) == 1
    assert 'data-fn="eval"' not in by_rank[2] and 'data-fn="checkpoint"' not in by_rank[2]
    assert "eval on rank 0: 120 ms (cycle 16" in by_rank[0]  # the window finalized after it
    for key in ("compute (busy)", "idle (waiting for the others)", "averaging", "eval"):
        assert key in element(dom, "div", "timeline-legend")

    # the roster: formation, the loss, the rejoin, in order
    roster = element(dom, "table", "roster")
    changes = [re.search(r'data-change="(\w+)"', row)[1] for row in rows(roster, "roster-row")]  # type: ignore[index]
    assert changes == ["formed", "lost", "rejoined"]
    assert "ranks 0, 1, 2" in roster and "world size 3" in roster
    assert "rank 2 declared dead: heartbeat timeout" in roster
    assert "rank 2 rejoined (incarnation 1)" in roster

    # resources: the latest sample per rank
    resources = element(dom, "table", "resources")
    assert len(rows(resources, "resource-row")) == 2
    assert "97.5 %" in resources and "3.0 GiB / 16.0 GiB" in resources
    assert "64.0 %" in resources and "5.0 GiB / 24.0 GiB (held 6.0 GiB)" in resources
    assert "cuda:0 · NVIDIA L4" in resources
    assert "no resource samples" not in resources

    # contribution: the advice per rank, evict highlighted with its reason
    table = element(dom, "table", "contribution")
    advice = rows(table, "contribution-row")
    assert [re.search(r'data-advice="(\w+)"', row)[1] for row in advice] == [  # type: ignore[index]
        "keep",
        "keep",
        "evict",
    ]
    assert re.search(r'class="advice advice-evict">evict<', advice[2])
    assert EVICT_REASON.replace("'", "&#39;") in advice[2] or EVICT_REASON in advice[2]
    assert "11.0 %" in advice[2] and "31.5 %" in advice[2] and 'class="over"' in advice[2]
    assert "after epoch 2" in element(dom, "h2", "contribution-title")


@pytest.mark.parametrize("hosts", [False, True], ids=["one-host", "two-hosts"])
def test_saved_dashboard_draws_the_run_panels(
    browser: Browser, tmp_path: Path, hosts: bool
) -> None:
    hub = RecordHub()
    for record in run_records(hosts=hosts):
        assert hub.publish(record) is not None
    page = save_dashboard(tmp_path / "run.html", hub.tree())
    dom = browser.dump_dom(page.as_uri())
    assert_ready(dom, browser)
    assert_panels(dom)
    # a drill-down view is one node's: the run panels are the root's
    dom = browser.dump_dom(page.as_uri() + "#" + rank_path(1, hosts))
    assert re.search(r'<body\b[^>]*\bdata-ready="1"', dom)
    assert re.search(r'<div\b[^>]*\bid="run-panels"[^>]*\bhidden', dom)


def test_without_run_records_each_panel_says_what_is_missing(
    browser: Browser, tmp_path: Path
) -> None:
    meta = make_record("root", "meta", {"reductions": {}, "run": {"world_size": 1}}, ts_ms=T0)
    node = make_record("root/rank0", "node", {"loss": 1.0}, ts_ms=T0 + 1)
    page = save_dashboard(tmp_path / "bare.html", {"root": [meta], "root/rank0": [node]})
    dom = browser.dump_dom(page.as_uri())
    assert_ready(dom, browser)
    assert "no eval results yet" in element(dom, "svg", "eval-chart")
    assert "no averaging windows yet" in element(dom, "svg", "timeline")
    assert "no roster changes" in element(dom, "table", "roster")
    assert "no resource samples" in element(dom, "table", "resources")
    assert "no contribution figures yet" in element(dom, "table", "contribution")


def malformed_records() -> list[dict[str, Any]]:
    """Records of the run panels' kinds with missing, null (NaN), mistyped and hostile fields,
    published after a well-formed run: the page must draw what it can and break nothing."""
    ts = iter(range(T0 + 9_000_000, T0 + 10_000_000, 100))
    out: list[dict[str, Any]] = []

    def add(path: str, kind: str, data: dict[str, Any]) -> None:
        out.append(make_record(path, kind, data, ts_ms=next(ts)))

    add("root", "window", {"cycle": "x", "ranks": "all", "busy_ms": None})
    add(
        "root",
        "window",
        {
            "cycle": 998,
            "t_s": float("nan"),
            "span_ms": float("inf"),
            "averaging_ms": -4.0,
            "ranks": [0, -1, "a", 1.5, 10**12, None, 0],
            "busy_ms": [float("nan")],
            "idle_ms": "none",
            "steps": [{"x": 1}],
        },
    )
    add(
        "root", "window", {"cycle": 999, "ranks": [1], "span_ms": 0, "busy_ms": [0], "idle_ms": [0]}
    )
    add("root/rank0", "callback", {"fn": HOSTILE, "elapsed_ms": -5.0})
    add("root/rank1", "callback", {"elapsed_ms": "slow"})
    add("root", "eval", {"epoch": "three", "metric": float("nan"), "rank": HOSTILE})
    add("root", "eval", {"epoch": 3})
    add("root/rank2", "resource", {"cpu_percent": "lots", "ram_used": -1, "vram_total": HOSTILE})
    add("root/rank1", "event", {"class": "rank_lost"})  # no detail
    add("root/rank1", "event", {"class": {"rank_lost": 1}, "detail": HOSTILE})
    add("root", "job", {"ranks": "all", "world_size": HOSTILE})
    add(
        "root",
        "contribution",
        {
            "epoch": "last",
            "ranks": [
                None,
                5,
                [1, 2],
                {"rank": HOSTILE, "advice": {"evict": True}, "reason": HOSTILE},
                {"rank": 1, "advice": HOSTILE, "sample_share": "half", "cost_share": None},
                {"rank": 2, "advice": "evict", "reason": EVICT_REASON, "sample_share": 0.1},
            ],
        },
    )
    return out


def test_malformed_run_records_break_nothing(browser: Browser, tmp_path: Path) -> None:
    hub = RecordHub()
    for record in run_records(hosts=False) + malformed_records():
        assert hub.publish(record) is not None
    page = save_dashboard(tmp_path / "odd.html", hub.tree())
    dom = browser.dump_dom(page.as_uri())
    assert_ready(dom, browser)
    assert "<img" not in dom and "&lt;img src=x" in dom  # hostile strings stay text
    assert "<title>flodl dashboard</title>" in dom  # no hostile handler ran
    # eval: the two without a finite epoch and metric are left out
    assert len(re.findall(r'class="point"', element(dom, "svg", "eval-chart"))) == 3
    # timeline: still 20 columns; the odd windows' bad rank ids are dropped
    timeline = element(dom, "svg", "timeline")
    assert len(re.findall(r'<rect\b[^>]*\bclass="win"', timeline)) == DRAWN
    assert re.findall(r'\bdata-cycle="(\d+)"', timeline)[-2:] == ["998", "999"]
    assert sorted(lanes(timeline)) == [0, 1, 2]
    assert len(re.findall(r'<g\b[^>]*\bclass="lane"', timeline)) == 3  # no lane of a bad id
    assert "nodata" in lanes(timeline)[1]  # window 999: nothing measured
    assert 'class="callback cb-other"' in timeline  # a callback of an unknown fn, unnamed
    # roster: the two events of a roster class (one of them without a detail), the odd job
    roster = element(dom, "table", "roster")
    changes = [re.search(r'data-change="(\w+)"', r)[1] for r in rows(roster, "roster-row")]  # type: ignore[index]
    assert changes == ["formed", "lost", "rejoined", "lost", "formed"]
    # resources: the odd sample shows dashes
    resources = element(dom, "table", "resources")
    assert len(rows(resources, "resource-row")) == 3 and "—" in resources
    # contribution: the latest record wins; rows that are not objects are left out
    table = element(dom, "table", "contribution")
    advice = rows(table, "contribution-row")
    assert len(advice) == 3
    assert 'class="advice advice-other"' in table
    assert re.search(r'class="advice advice-evict">evict<', table)
    assert "Contribution and advice</h2>" in dom.replace("\n", "")  # the odd epoch is not shown


def test_a_large_run_draws_bounded_panels_that_keep_what_matters(
    browser: Browser, tmp_path: Path
) -> None:
    """200 ranks: 32 lanes (and a note), 128 contribution rows that keep the one evict."""
    world = 200
    ranks = list(range(world))
    window = {
        "cycle": 0,
        "t_s": 1.0,
        "span_ms": 100.0,
        "averaging_ms": 5.0,
        "ranks": ranks,
        "steps": [1] * world,
        "busy_ms": [90.0] * world,
        "idle_ms": [5.0] * world,
    }
    figures = [
        {
            "rank": r,
            "sample_share": 1 / world,
            "cost_share": 0.05 if r == 150 else 0.001,
            "advice": "evict" if r == 150 else "keep",
            "reason": "slow" if r == 150 else "fine",
        }
        for r in ranks
    ]
    records = [
        make_record("root", "window", window, ts_ms=T0),
        make_record("root", "contribution", {"epoch": 0, "ranks": figures}, ts_ms=T0 + 1),
    ]
    page = save_dashboard(tmp_path / "big.html", {"root": records})
    dom = browser.dump_dom(page.as_uri())
    assert_ready(dom, browser)
    assert sorted(lanes(element(dom, "svg", "timeline"))) == list(range(32))
    assert "+168 ranks not drawn" in element(dom, "div", "timeline-legend")
    table = element(dom, "table", "contribution")
    shown = [re.search(r'data-advice="(\w+)"', r)[1] for r in rows(table, "contribution-row")]  # type: ignore[index]
    assert len(shown) == 128 and shown.count("evict") == 1
    assert "rank 150" in table and "72 more ranks advised keep not shown" in table


class SignallingHub(RecordHub):
    """Sets ``history_served`` once the page read its scope's history (its last read)."""

    def __init__(self) -> None:
        super().__init__()
        self.history_served = threading.Event()

    def history_json(self, path: str, n: int = 200, **scope: Any) -> str:
        try:
            return super().history_json(path, n, **scope)
        finally:
            if scope.get("children"):
                self.history_served.set()


@pytest.fixture
def live_run() -> Iterator[DashboardThread]:
    """A two-host run served live; once the page read its history, a fourth eval, a callback
    of a rank below the root's children and a new contribution follow (only the stream can
    bring them)."""
    hub = SignallingHub()
    for record in run_records(hosts=True):
        hub.publish(record)
    stop = threading.Event()

    def publisher() -> None:
        hub.history_served.wait(WAIT_S * 2)
        if stop.is_set():
            return
        late = T0 + 9_000_000
        hub.publish(
            make_record(
                rank_path(2, True), "callback", {"fn": "epoch_fn", "elapsed_ms": 9.0}, ts_ms=late
            )
        )
        hub.publish(
            make_record("root", "eval", {"epoch": 3, "metric": 0.8, "rank": 2}, ts_ms=late + 1)
        )

    thread = threading.Thread(target=publisher, name="late-records", daemon=True)
    dash = DashboardThread(hub, stream_lifetime_s=1.0)  # streams end so virtual time advances
    dash.start()
    thread.start()
    try:
        yield dash
    finally:
        stop.set()
        hub.history_served.set()
        thread.join(WAIT_S)
        dash.stop()


def test_live_dashboard_draws_the_run_panels_and_streams_into_them(
    browser: Browser, live_run: DashboardThread
) -> None:
    dom = browser.dump_dom(live_run.url)
    assert_ready(dom, browser)
    assert_panels(dom, evals=4)
    # the streamed callback of root/h1/rank2 (a grandchild of root) is in the open window
    timeline = element(dom, "svg", "timeline")
    assert 'data-fn="epoch_fn"' in lanes(timeline)[2]
    assert 'class="open-window"' in timeline
    assert "rank 2 declared dead" in element(dom, "ol", "alerts")  # deep events reach alerts
