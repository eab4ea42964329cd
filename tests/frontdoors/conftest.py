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

from collections.abc import Iterator  # noqa: E402

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from openai_fake_engine import FakeEngine  # noqa: E402
from openai_helpers import API_KEY, MAX_BODY_BYTES  # noqa: E402
from openai_live_server import LiveServer  # noqa: E402

from flowengine.entrypoints.openai.app import AppOptions  # noqa: E402

MODEL = "fake-model"


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(model_name=MODEL, max_model_len=512, step_s=0.001)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    """One live server per module, with an API key (as `flowengine serve --api-key`)."""
    options = AppOptions(api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES)
    with LiveServer(engine, app_options=options, model_names=(MODEL, "alias")) as live:
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
