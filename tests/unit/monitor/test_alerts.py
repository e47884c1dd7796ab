"""Alert lane: first alert immediate, repeats collapsed, counts exact, bounded live set."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.errors import ConfigError
from flodl.monitor.alerts import AlertLane, format_alert


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


def lane(**kw: Any) -> tuple[AlertLane, Lines]:
    printed = Lines()
    return AlertLane(printer=printed, **kw), printed


def counts(records: list[dict[str, Any]]) -> Counter[tuple[str, str]]:
    total: Counter[tuple[str, str]] = Counter()
    for r in records:
        assert r["kind"] == "event"
        total[r["data"]["class"], r["path"]] += r["data"]["count"]
    return total


def test_first_alert_is_immediate_and_well_formed() -> None:
    al, printed = lane()
    out = al.offer("rank_lost", "root/rank3", "silent 30 s", sev="critical", now=5.0, wall_ms=7)
    assert out == [
        {
            "v": 1,
            "ts": 7,
            "sev": "critical",
            "path": "root/rank3",
            "kind": "event",
            "data": {"class": "rank_lost", "detail": "silent 30 s", "count": 1},
        }
    ]
    assert printed.lines == ["flodl [rank_lost] root/rank3: silent 30 s"]


def test_repeats_in_the_window_collapse_into_the_next_record() -> None:
    al, printed = lane(window_s=10.0)
    assert len(al.offer("drift", "root", "d0", now=0.0)) == 1
    for t in (1.0, 5.0, 9.999):
        assert al.offer("drift", "root", f"d{t}", now=t) == []
    out = al.offer("drift", "root", "d10", now=10.0)
    assert [r["data"] for r in out] == [{"class": "drift", "detail": "d10", "count": 4}]
    assert printed.lines[-1] == "flodl [drift] root: d10 (×4)"
    # the window restarts at the last emission (t=10), not at the first alert
    assert al.offer("drift", "root", "x", now=19.0) == []
    assert al.offer("drift", "root", "y", now=20.0)[0]["data"]["count"] == 2
    # after a quiet window the next one is immediate with count 1
    assert al.offer("drift", "root", "z", now=100.0)[0]["data"]["count"] == 1
    assert len(printed.lines) == 4


def test_keys_are_class_and_path() -> None:
    al, _ = lane()
    assert al.offer("drift", "root/rank0", "a", now=0.0)
    assert al.offer("drift", "root/rank1", "a", now=0.1)
    assert al.offer("control_drop", "root/rank0", "a", now=0.2)
    assert al.offer("drift", "root/rank0", "a", now=0.3) == []


def test_emitted_severity_is_the_worst_it_counts() -> None:
    al, _ = lane()
    al.offer("reduce_stall", "root", "a", sev="info", now=0.0)
    al.offer("reduce_stall", "root", "b", sev="critical", now=1.0)
    out = al.offer("reduce_stall", "root", "c", sev="info", now=11.0)
    assert out[0]["sev"] == "critical"
    assert al.offer("reduce_stall", "root", "d", sev="info", now=30.0)[0]["sev"] == "info"


def test_flush_emits_pending_counts_with_the_last_detail() -> None:
    al, printed = lane()
    al.offer("drift", "root/rank0", "a", now=0.0)
    al.offer("drift", "root/rank0", "b", now=1.0)
    al.offer("drift", "root/rank0", "c", sev="critical", now=2.0)
    al.offer("rank_lost", "root/rank1", "gone", now=3.0)  # nothing pending
    out = al.flush(4.0, wall_ms=9)
    assert out == [
        {
            "v": 1,
            "ts": 9,
            "sev": "critical",
            "path": "root/rank0",
            "kind": "event",
            "data": {"class": "drift", "detail": "c", "count": 2},
        }
    ]
    assert printed.lines[-1] == "flodl [drift] root/rank0: c (×2)"
    assert al.flush(5.0) == []
    assert len(al) == 0


def test_eviction_keeps_totals_exact() -> None:
    al, _ = lane(max_live=3)
    emitted: list[dict[str, Any]] = []
    for rank in range(3):
        emitted += al.offer("drift", f"root/rank{rank}", "a", now=0.0)
        emitted += al.offer("drift", f"root/rank{rank}", "b", now=1.0)  # pending 1 each
    assert len(al) == 3
    out = al.offer("drift", "root/rank9", "new", now=2.0)
    # the least recently emitted key (rank0) is evicted and its pending count emitted first
    assert [(r["path"], r["data"]["count"]) for r in out] == [("root/rank0", 1), ("root/rank9", 1)]
    assert out[0]["data"]["detail"] == "b"
    emitted += out
    assert len(al) == 3
    emitted += al.flush(3.0)
    assert counts(emitted) == {("drift", f"root/rank{r}"): 2 for r in (0, 1, 2)} | {
        ("drift", "root/rank9"): 1
    }


def test_idle_keys_are_forgotten_before_anything_is_evicted() -> None:
    al, _ = lane(max_live=2, window_s=10.0)
    al.offer("drift", "root/rank0", "a", now=0.0)  # idle from t=10
    al.offer("drift", "root/rank1", "a", now=5.0)
    al.offer("drift", "root/rank1", "b", now=6.0)  # pending: must not be flushed early
    out = al.offer("drift", "root/rank2", "a", now=12.0)
    assert [r["path"] for r in out] == ["root/rank2"]
    assert al.flush(13.0)[0]["path"] == "root/rank1"


def test_live_set_never_exceeds_max_live() -> None:
    al, _ = lane(max_live=5)
    for i in range(50):
        al.offer("drift", f"root/rank{i}", "a", now=float(i) / 100)
        assert len(al) <= 5


def test_detail_newlines_are_flattened_in_print_only() -> None:
    al, printed = lane()
    out = al.offer("drift", "root", "line one\nline two", now=0.0)
    assert out[0]["data"]["detail"] == "line one\nline two"
    assert printed.lines == ["flodl [drift] root: line one line two"]
    assert format_alert(out[0]) == printed.lines[0]


def test_default_printer_writes_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    al = AlertLane()
    al.offer("control_drop", "root", "missed rank 2", now=0.0, wall_ms=0)
    al.offer("control_drop", "root", "missed rank 2", now=1.0, wall_ms=0)
    al.flush(2.0, wall_ms=0)
    assert capsys.readouterr().out == (
        "flodl [control_drop] root: missed rank 2\n"
        "flodl [control_drop] root: missed rank 2\n"  # the flushed count of 1 has no (×1)
    )


@pytest.mark.parametrize(
    "kw", [{"window_s": -1.0}, {"window_s": float("nan")}, {"max_live": 0}, {"max_live": True}]
)
def test_bad_settings_are_rejected(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AlertLane(**kw)


@pytest.mark.parametrize(
    ("cls", "path", "sev"),
    [("Drift", "root", "warning"), ("drift", "root/../x", "warning"), ("drift", "root", "loud")],
)
def test_bad_offers_are_rejected(cls: str, path: str, sev: str) -> None:
    al, printed = lane()
    with pytest.raises(ConfigError):
        al.offer(cls, path, "x", sev=sev, now=0.0)
    assert printed.lines == []


offer_st = st.tuples(
    st.sampled_from(["drift", "rank_lost", "control_drop"]),
    st.sampled_from(["root", "root/rank0", "root/rank1", "root/h/rank2"]),
    st.floats(min_value=0.0, max_value=7.0),  # time step since the previous offer
)


@settings(max_examples=300, deadline=None)
@given(
    offers=st.lists(offer_st, max_size=200),
    window_s=st.sampled_from([0.0, 1.0, 10.0]),
    max_live=st.integers(min_value=1, max_value=13),
)
def test_counts_sum_to_the_number_of_offers(
    offers: list[tuple[str, str, float]], window_s: float, max_live: int
) -> None:
    al, printed = lane(window_s=window_s, max_live=max_live)
    emitted: list[dict[str, Any]] = []
    last_emit: dict[tuple[str, str], float] = {}
    now = 0.0
    for i, (cls, path, dt) in enumerate(offers):
        now += dt
        key = (cls, path)
        out = al.offer(cls, path, f"d{i}", now=now, wall_ms=0)
        mine = [r for r in out if (r["data"]["class"], r["path"]) == key]
        # never delayed: a key not emitted within the window is emitted right now
        if key not in last_emit or now - last_emit[key] >= window_s:
            assert len(mine) == 1 and mine[0]["data"]["detail"] == f"d{i}"
        if mine:
            last_emit[key] = now
        assert len(out) <= 2 and len(al) <= max_live
        emitted += out
    emitted += al.flush(now, wall_ms=0)
    assert counts(emitted) == Counter((c, p) for c, p, _ in offers)
    assert all(r["data"]["count"] >= 1 for r in emitted)
    assert printed.lines == [format_alert(r) for r in emitted]
