"""One run's monitoring on the host: records, alerts, the live dashboard, progress, the archive.

The coordinator's shell (or the single-device loop) hands every observation to a
:class:`MonitorSession`, which turns it into records (:mod:`flodl.monitor.records` format) and
fans them out to what the run enabled:

* the record log (``record_log(dir, max_bytes)``): JSONL ring per node;
* the hub (in memory) behind the live dashboard (``dashboard(port)``) and the saved archive
  (``save_dashboard(path)``, written at :meth:`MonitorSession.close`, after the last record);
* the alert lane (``kind: "event"``, collapsed per class and path, always printed);
* the terminal progress display.

The first record of the run is ``meta`` at ``root``: run info and the reduction of every metric
(framework metrics fixed, user scalars ``scalar_reduction(name, …)``, default ``mean``).

Per-epoch node records: when sub-epoch reports are off, every epoch produces one node report
per rank, host and root from :class:`~flodl.wire.frames.EpochMetrics` (the dashboard always has
data); with ``reports_per_epoch(n)`` the coordinator's reports are the node records and epochs
are ``epoch`` records only. Nothing here ever raises into training: every sink failure is
logged once and costs observability only.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flodl.coord.metrics import REDUCTIONS, node_paths, window_records
from flodl.errors import ConfigError
from flodl.monitor.alerts import AlertLane
from flodl.monitor.progress import ProgressDisplay
from flodl.monitor.records import RecordLog, make_record
from flodl.wire.frames import EpochMetrics

__all__ = ["MonitorSession", "framework_reductions"]

logger = logging.getLogger(__name__)


STREAM_ENV = "FLODL_DASHBOARD_STREAM_S"
DEFAULT_STREAM_S = 30.0


def stream_lifetime() -> float:
    """How long one ``/stream`` response lasts before the page reconnects (resuming after the
    last record it got, so nothing is lost): ``FLODL_DASHBOARD_STREAM_S``, default 30 s. Ending
    streams bounds a connection's life behind proxies and lets headless browsers settle."""
    raw = os.environ.get(STREAM_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_STREAM_S
    except ValueError:
        raise ConfigError(f"{STREAM_ENV}={raw!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{STREAM_ENV}={raw!r} must be a positive number of seconds")
    return value


def framework_reductions(scalars: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every metric's reduction across ranks: the framework's fixed ones, then user scalars."""
    out = dict(REDUCTIONS)
    for name, how in (scalars or {}).items():
        if name not in out:
            out[name] = how
    return out


class MonitorSession:
    """The monitoring of one run (see the module docstring).

    Args:
        world_size: ranks; ``hosts`` names each rank's host (record tree root → host → rank).
        total_epochs: for the progress display.
        batch_size: per-rank batch size (node reports count steps).
        record_dir / max_bytes: the record log (``None``: off).
        dashboard_port: serve the live dashboard (``0``: any free port; ``None``: off).
        dashboard_host: its bind address (loopback unless asked).
        save_dashboard: write the self-contained archive here at :meth:`close`.
        theme: ``"light"``, ``"dark"`` or ``None`` (the reader's OS preference).
        progress: print progress lines.
        sub_epoch_reports: the coordinator emits node reports (no per-epoch node records).
        scalar_reductions: user scalar name → ``sum|mean|max|min``.
        run_info: free-form, JSON-ready (mode, world size, …) for the meta record.
    """

    def __init__(
        self,
        *,
        world_size: int,
        total_epochs: int,
        batch_size: int = 1,
        hosts: Sequence[str] | None = None,
        record_dir: str | Path | None = None,
        max_bytes: int = 0,
        dashboard_port: int | None = None,
        dashboard_host: str = "127.0.0.1",
        save_dashboard: str | Path | None = None,
        theme: str | None = None,
        progress: bool = False,
        sub_epoch_reports: bool = False,
        scalar_reductions: Mapping[str, str] | None = None,
        run_info: Mapping[str, Any] | None = None,
        first_epoch: int = 0,
        printer: Callable[[str], None] | None = None,
    ) -> None:
        self.world_size = world_size
        self.batch_size = batch_size
        self.reductions = framework_reductions(scalar_reductions)
        self.paths = node_paths(world_size, hosts)
        self.sub_epoch_reports = sub_epoch_reports
        self.log = RecordLog(record_dir, max_bytes or 32 * 2**20) if record_dir else None
        self.save_path = Path(save_dashboard) if save_dashboard else None
        self.theme = theme
        self.hub: Any = None
        self.dashboard: Any = None
        self.url: str | None = None
        if dashboard_port is not None or self.save_path is not None:
            from flodl.monitor.hub import RecordHub

            self.hub = RecordHub()
        if dashboard_port is not None:
            from flodl.monitor.dashboard import DashboardThread

            self.dashboard = DashboardThread(
                self.hub,
                host=dashboard_host,
                port=dashboard_port,
                theme=theme,
                stream_lifetime_s=stream_lifetime(),
            )
            port = self.dashboard.start()
            self.url = f"http://{dashboard_host}:{port}/"
        self.lane = AlertLane(printer=printer)
        self.progress = (
            ProgressDisplay(total_epochs, world_size, first_epoch=first_epoch) if progress else None
        )
        self._closed = False
        reductions = self.reductions
        info = {"world_size": world_size, "total_epochs": total_epochs, **(run_info or {})}
        if self.url is not None:
            info["dashboard"] = self.url
        self.publish(make_record("root", "meta", {"reductions": reductions, "run": info}))

    # ------------------------------------------------------------------ inputs
    def publish(self, record: dict[str, Any]) -> None:
        """One finished record to every sink (never raises)."""
        if self.log is not None:
            self.log.write(record)
        if self.hub is not None:
            self.hub.publish(record)

    def record(self, path: str, kind: str, data: dict[str, Any], sev: str = "info") -> None:
        """A coordinator record (node report, epoch, anchor change, event, resource sample)."""
        try:
            rec = make_record(path, kind, data, sev=sev)
        except Exception:  # a bad path or kind from a caller: drop it, loudly once
            logger.exception("dropping a malformed record at %r", path)
            return
        self.publish(rec)
        if self.progress is not None and kind == "node":
            self.progress.on_node(path, data)

    def alert(self, cls: str, path: str, detail: str, sev: str = "warning") -> None:
        for rec in self.lane.offer(cls, path, detail, sev=sev, now=time.monotonic()):
            self.publish(rec)

    def sub_epoch_report(self, epoch: int, progress: float, node: dict[str, float]) -> None:
        """The single-device tier's sub-epoch report (``reports_per_epoch``): ``node`` is its
        one rank's batches since the previous report; the coordinator's come as records."""
        engine = {"epoch": epoch, "epoch_progress": progress, "ranks": 1, "syncs": 0}
        for path, data in window_records({0: node}, self.paths, engine, self.reductions):
            self.record(path, "node", data)

    def epoch(self, m: EpochMetrics, root_extra: Mapping[str, Any] | None = None) -> None:
        """An aggregated epoch: an ``epoch`` record, and (without sub-epoch reports) one node
        report per rank, host and root built from it."""
        extra = dict(root_extra or {})
        summary = {
            "epoch": m.epoch,
            "avg_loss": m.avg_loss,
            "epoch_ms": m.epoch_ms,
            "syncs": m.syncs,
            "anchor": m.anchor,
            "scalars": dict(m.scalars),
        }
        self.publish(make_record("root", "epoch", {**summary, **extra}))
        if not self.sub_epoch_reports:
            ranks = range(min(self.world_size, len(m.per_rank_samples)))
            nodes = {r: _rank_node(m, r, self.batch_size) for r in ranks}
            engine = {"epoch": m.epoch, "syncs": m.syncs, "anchor": m.anchor, **extra}
            engine["epoch_progress"] = 1.0
            for path, node in window_records(nodes, self.paths, engine, self.reductions):
                if path == "root":
                    node["loss"] = m.avg_loss  # the batch-weighted epoch mean
                self.publish(make_record(path, "node", node))
        if self.progress is not None:
            for r in range(len(m.per_rank_throughput)):
                self.progress.on_node(self.paths[r], _rank_node(m, r, self.batch_size))
            engine = {"syncs": m.syncs, "anchor": m.anchor, "ranks": extra.get("ranks")}
            self.progress.on_epoch(m.epoch, m.avg_loss, engine)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Flush pending alerts, write the archive, stop the server, close the files."""
        if self._closed:
            return
        self._closed = True
        for rec in self.lane.flush(time.monotonic()):
            self.publish(rec)
        if self.save_path is not None and self.hub is not None:
            try:
                from flodl.monitor.archive import save_dashboard

                save_dashboard(self.save_path, self.hub.tree(), theme=self.theme)
            except Exception:
                logger.exception("saving the dashboard to %s failed", self.save_path)
        if self.dashboard is not None:
            try:
                self.dashboard.stop()
            except Exception:
                logger.exception("stopping the dashboard failed")
        if self.hub is not None:
            self.hub.close()
        if self.log is not None:
            self.log.close()


def _rank_node(m: EpochMetrics, r: int, batch_size: int) -> dict[str, Any]:
    """A rank's epoch as a node report; metrics it did not measure are absent."""
    samples = m.per_rank_samples[r] if r < len(m.per_rank_samples) else 0
    node: dict[str, Any] = {"steps": float(-(-samples // max(1, batch_size)))}
    if r < len(m.per_rank_batch_share):
        node["batch_share"] = m.per_rank_batch_share[r]
    if samples <= 0:
        return node
    loss = m.per_rank_loss[r] if r < len(m.per_rank_loss) else None
    if loss is not None:
        node["loss"] = loss
    if r < len(m.per_rank_throughput):
        node["throughput"] = m.per_rank_throughput[r]
    if r < len(m.per_rank_compute_only_ms):
        node["compute_only_ms"] = m.per_rank_compute_only_ms[r]
    if r < len(m.per_rank_data_starve_ms):
        node["data_starve_ms"] = m.per_rank_data_starve_ms[r]
    if r < len(m.per_rank):
        node.update(m.per_rank[r])
    return node
