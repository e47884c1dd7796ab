"""Wire formats: control frames, their codec and streams, and data-plane tensor frames."""

from __future__ import annotations
