"""Fixtures of the front-door tests (OpenAI Responses, Anthropic Messages): one live
server per module on the OpenAI server tests' fake engine (tests/entrypoints), with an
API key. A module may set `make_engine()` (another engine, e.g. a scripted one) and
`CHAT_PARSING` (the server's tool-call and reasoning parsers); the defaults are the
echoing `FakeEngine` and no parsers."""

from __future__ import annotations

import sys
from pathlib import Path

# The helpers are plain modules of tests/entrypoints and tests/tools (not packages);
# their directories go on the path once, so `import openai_live_server` finds them.
for _name in ("entrypoints", "tools"):
    _dir = str(Path(__file__).resolve().parents[1] / _name)
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

from collections.abc import Iterator  # noqa: E402

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from frontdoor_helpers import MODEL  # noqa: E402
from openai_fake_engine import FakeEngine  # noqa: E402
from openai_helpers import API_KEY, MAX_BODY_BYTES  # noqa: E402
from openai_live_server import LiveServer  # noqa: E402

from flowengine.entrypoints.openai.app import AppOptions  # noqa: E402


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> FakeEngine:
    make = getattr(request.module, "make_engine", None)
    if make is not None:
        return make()
    return FakeEngine(model_name=MODEL, max_model_len=512, step_s=0.001)


@pytest.fixture(scope="module")
def server(engine: FakeEngine, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """One live server per module, with an API key (as `flowengine serve --api-key`)."""
    options = AppOptions(api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES)
    parsing = getattr(request.module, "CHAT_PARSING", None)
    extra = {} if parsing is None else {"chat_parsing": parsing}
    with LiveServer(engine, app_options=options, model_names=(MODEL, "alias"), **extra) as live:
        yield live


@pytest.fixture
def oai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def claude(server: LiveServer) -> anthropic.Anthropic:
    """The official `anthropic` SDK: it sends the key as `x-api-key`."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as c:
        yield c
