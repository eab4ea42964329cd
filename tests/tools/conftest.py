"""tests/tools: the OpenAI test helpers of tests/entrypoints (fake engine, live server)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
