"""Fixtures of the front-door tests (OpenAI Responses, Anthropic Messages): the OpenAI
server tests' fake engine, live server and helpers, imported from tests/entrypoints."""

from __future__ import annotations

import sys
from pathlib import Path

# The helpers are plain modules of tests/entrypoints (not a package); their directory
# goes on the path once, so `import openai_live_server` finds them from here.
_ENTRYPOINTS = str(Path(__file__).resolve().parents[1] / "entrypoints")
if _ENTRYPOINTS not in sys.path:
    sys.path.insert(0, _ENTRYPOINTS)
