"""The saved dashboard: one self-contained HTML file holding the page and the records.

:func:`save_dashboard` embeds a record tree (node path → records, as
:func:`flodl.monitor.records.read_tree` or the hub's rings give it) in the dashboard page as
``<script type="application/json" id="flodl-archive">…</script>``; the page sees the tag and
renders from it without any network request (its Content-Security-Policy, set by a ``<meta>``
tag, forbids them: ``connect-src 'none'``). :func:`serve_directory` serves a record directory
live instead (``flodl dashboard DIR``).

Choices:
    - Every ``<``, ``>`` and ``&`` in the embedded JSON is written as ``\\u003c``, ``\\u003e``,
      ``\\u0026``: valid JSON with the same value, and no record string can close the script
      element (``</script>``) or open an HTML comment (``<!--``) inside it. This covers the
      ``</`` → ``<\\/`` escape and more. U+2028/U+2029 are escaped too.
    - Non-finite floats become ``null`` (browsers' ``JSON.parse`` has no NaN).
    - The size is the page (~30 KB) plus the JSON of the records given; bound it by what you
      pass in (the on-disk or in-memory ring).
    - The file is written to a temporary sibling and renamed over the target, so a reader never
      sees half a file and a crash leaves the old file (or none).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from flodl.errors import ConfigError
from flodl.monitor.dashboard import ARCHIVE_MARKER, DashboardThread, page_csp, page_html
from flodl.monitor.hub import RecordHub, finite
from flodl.monitor.records import read_tree, validate_path

__all__ = ["ARCHIVE_VERSION", "save_dashboard", "archive_json", "serve_directory"]

ARCHIVE_VERSION: Final = 1
_ESCAPES: Final = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def archive_json(records_by_path: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The archive payload as JSON text that is safe inside a ``<script>`` element.

    Raises:
        ConfigError: a key is not a valid node path, or a record is not JSON-serializable.
    """
    records: dict[str, list[Any]] = {}
    for path, recs in records_by_path.items():
        try:
            validate_path(path)
        except ConfigError as exc:
            raise ConfigError(f"save_dashboard: {exc}") from None
        records[path] = list(recs)
    payload = {"v": ARCHIVE_VERSION, "records": records}
    try:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    except ValueError:
        try:
            text = json.dumps(finite(payload), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"save_dashboard: records are not JSON-serializable: {exc}") from None
    except (TypeError, RecursionError) as exc:
        raise ConfigError(f"save_dashboard: records are not JSON-serializable: {exc}") from None
    return text.translate(_ESCAPES)


def save_dashboard(
    path: str | os.PathLike[str],
    records_by_path: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    theme: str | None = None,
) -> Path:
    """Write one self-contained HTML dashboard of ``records_by_path`` to ``path``, atomically.

    Args:
        path: the file to write (its directory must exist).
        records_by_path: node path → that node's records, oldest first.
        theme: pin the page's theme, ``"light"`` or ``"dark"``; ``None`` follows the viewer.

    Returns:
        the written path.

    Raises:
        ConfigError: a bad theme, a bad node path, or records that are not JSON-serializable.
        OSError: the file could not be written (nothing is left half-written).
    """
    page = page_html(theme)
    data = archive_json(records_by_path)
    tag = f'<script type="application/json" id="flodl-archive">{data}</script>'
    page = page.replace(ARCHIVE_MARKER, tag, 1)
    # frame-ancestors is not allowed in a <meta> policy (browsers ignore it with a warning)
    csp = "; ".join(
        d for d in page_csp(page, connect=False).split("; ") if not d.startswith("frame-ancestors")
    )
    meta = f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
    page = page.replace('<meta charset="utf-8">', '<meta charset="utf-8">\n' + meta, 1)

    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(page)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def serve_directory(
    directory: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    theme: str | None = None,
) -> DashboardThread:
    """Load a record directory into a hub and serve it; returns the started thread.

    The caller stops it with :meth:`DashboardThread.stop`.

    Raises:
        ConfigError: ``directory`` is not a record directory, or a bad theme.
        OSError: the address could not be bound.
    """
    hub = RecordHub(max_bytes_per_node=64 * 2**20)  # a saved ring holds up to 32 MiB per node
    hub.load(read_tree(directory))
    thread = DashboardThread(hub, host, port, theme)
    thread.start()
    return thread
