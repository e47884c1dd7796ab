"""``python -m flodl`` is the ``flodl`` console script."""

from __future__ import annotations

import sys

from flodl.cli import main

sys.exit(main())
