"""The scheduler tests here drive the Scheduler with tests/core's SimExecutor."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
