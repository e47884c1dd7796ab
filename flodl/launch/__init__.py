"""Launching a cluster: configuration, fan-out to local and remote hosts, supervision."""

from __future__ import annotations
