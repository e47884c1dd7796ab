"""Headless Chromium for the dashboard page tests.

The ``browser`` fixture finds ``chromium`` (or ``chromium-browser``, ``google-chrome``) on
``PATH`` and skips the test, with the reason, only when none is installed. It runs the browser
as the tests' user, root included (``--no-sandbox``), with a throwaway profile, no background
network traffic and a bounded run time; the whole process group is killed on a timeout.

``--virtual-time-budget`` lets the page's timers run for that much *virtual* time; Chromium
stops virtual time while a request is open, so a live page's ``/stream`` must end now and then
for the budget to run out (the live test sets the server's ``stream_lifetime_s``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
RUN_TIMEOUT_S = 45.0
VIRTUAL_TIME_MS = 8000
CONSOLE_ERRORS = ("Uncaught", "Refused to", "Content Security Policy")


@dataclass
class Browser:
    """One headless Chromium binary and a scratch directory for its profiles."""

    binary: str
    scratch: Path
    runs: int = 0
    console: list[str] = field(default_factory=list)
    """The page's console messages of the last run (Chromium logs them to stderr)."""

    def console_errors(self) -> list[str]:
        """Uncaught exceptions and refused loads (CSP violations) of the last run."""
        return [line for line in self.console if any(bad in line for bad in CONSOLE_ERRORS)]

    def _args(self, *extra: str) -> list[str]:
        self.runs += 1
        profile = self.scratch / f"profile-{self.runs}"
        return [
            self.binary,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            *extra,
        ]

    def _run(self, args: list[str]) -> str:
        with subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its zygote and renderers share our kill
        ) as proc:
            try:
                out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                pytest.fail(f"chromium did not finish within {RUN_TIMEOUT_S} s: {args[-1]}")
        log = err.decode(errors="replace")
        if proc.returncode != 0:
            pytest.fail(f"chromium exited {proc.returncode}: {log[-2000:]}")
        self.console = [line for line in log.splitlines() if ":CONSOLE" in line]
        return out.decode("utf-8", errors="replace")

    def dump_dom(self, url: str) -> str:
        """The serialized DOM of ``url`` once the virtual time budget is spent."""
        return self._run(self._args("--dump-dom", url))

    def screenshot(self, url: str, png: Path) -> Path:
        """A 1280x900 PNG screenshot of ``url``."""
        self._run(self._args(f"--screenshot={png}", "--window-size=1280,900", url))
        return png


@pytest.fixture
def browser(tmp_path: Path) -> Browser:
    for name in CANDIDATES:
        binary = shutil.which(name)
        if binary is not None:
            return Browser(binary, tmp_path / "chromium")
    pytest.skip(
        "no headless Chromium on PATH (looked for " + ", ".join(CANDIDATES) + "); "
        "install it with: apt-get install -y chromium"
    )
