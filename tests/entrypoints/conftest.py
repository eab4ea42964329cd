"""Fixtures for the OpenAI server tests: a fake engine served live on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import API_KEY, MAX_BODY_BYTES
from openai_live_server import LiveServer

from flowengine.entrypoints.openai.app import AppOptions


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(model_name="fake-model", max_model_len=512, step_s=0.001)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[LiveServer]:
    options = AppOptions(api_key=API_KEY, max_request_body_bytes=MAX_BODY_BYTES)
    with LiveServer(engine, app_options=options, model_names=("fake-model", "alias")) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as c:
        yield c
