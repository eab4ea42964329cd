"""Long prompts are tokenized in a worker thread, so one huge request does not stall the
event loop (and every other request of the frontend process); short ones stay inline."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import anyio

from flowengine.actors.tokenizer import (
    THREAD_PROMPT_CHARS,
    TokenizeJob,
    TokenizerActor,
    prompt_chars,
)
from flowengine.sampling_params import SamplingParams


class _SlowInputProcessor:
    """Records the thread of each call; a long prompt takes 0.3 s of blocking work
    (as encoding 600 KB of text does), holding no lock the loop needs."""

    pooler_config = None

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def default_params(self) -> SamplingParams:
        return SamplingParams()

    def process(self, request_id, prompt, params, **kwargs):
        self.threads.append(threading.current_thread())
        if prompt_chars(prompt) > THREAD_PROMPT_CHARS:
            time.sleep(0.3)
        return SimpleNamespace(request_id=request_id, children=[])


class _Detokenizer:
    def __init__(self) -> None:
        self.registered: list[str] = []

    def register(self, processed) -> None:
        self.registered.append(processed.request_id)


def test_a_long_prompt_is_tokenized_off_the_event_loop():
    ip, detok = _SlowInputProcessor(), _Detokenizer()
    actor = TokenizerActor(ip, detok, SimpleNamespace())
    ticks = []

    async def ticker(done: anyio.Event) -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await anyio.sleep(0.01)

    async def main() -> None:
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker, done)
            await anyio.sleep(0.02)
            before = len(ticks)
            await actor.submit(TokenizeJob("long", "x" * (THREAD_PROMPT_CHARS + 1), None, 0))
            during = len(ticks) - before
            await actor.submit(TokenizeJob("short", "x" * THREAD_PROMPT_CHARS, None, 0))
            done.set()
        # 0.3 s of tokenizing: the loop ran its 10 ms ticker all along.
        assert during >= 10, during

    anyio.run(main)
    assert ip.threads[0] is not threading.main_thread()  # the long one: a worker
    assert ip.threads[1] is threading.main_thread()  # the short one: inline
    assert detok.registered == ["long", "short"]


def test_prompt_chars_counts_text_of_every_prompt_shape():
    assert prompt_chars("abc") == 3
    assert prompt_chars({"prompt": "abcd", "cache_salt": "s"}) == 4
    assert prompt_chars([1, 2, 3]) == 0
    assert prompt_chars({"prompt_token_ids": [1, 2]}) == 0
    conversation = [{"role": "system", "content": "ab"},
                    {"role": "user", "content": [{"type": "text", "text": "cde"},
                                                 {"type": "image_url", "image_url": {}}]},
                    {"role": "assistant", "content": None}]
    assert prompt_chars(conversation) == 5
    assert prompt_chars({"messages": conversation, "add_generation_prompt": True}) == 5
    assert prompt_chars(None) == 0


def test_a_caller_cancelled_while_its_prompt_is_encoded_leaves_nothing_behind():
    """The thread cannot be interrupted; the cancellation takes effect when it is done,
    before the request is registered or sent."""
    ip, detok = _SlowInputProcessor(), _Detokenizer()
    sent = []

    class _Requests:
        async def send_async(self, msg) -> None:
            sent.append(msg)

    actor = TokenizerActor(ip, detok, _Requests())

    async def main() -> None:
        with anyio.move_on_after(0.05) as scope:
            await actor.submit(TokenizeJob("r1", "x" * (THREAD_PROMPT_CHARS + 1), None, 0))
        assert scope.cancelled_caught

    anyio.run(main)
    assert len(ip.threads) == 1  # it was encoded, then dropped
    assert detok.registered == [] and sent == []


def test_an_error_in_the_thread_reaches_the_caller():
    class _Failing(_SlowInputProcessor):
        def process(self, request_id, prompt, params, **kwargs):
            raise ValueError("the prompt has 2000000 tokens")

    actor = TokenizerActor(_Failing(), _Detokenizer(), SimpleNamespace())

    async def main() -> None:
        try:
            await actor.submit(TokenizeJob("r", "x" * (THREAD_PROMPT_CHARS + 1), None, 0))
        except ValueError as exc:
            assert "2000000 tokens" in str(exc)
        else:
            raise AssertionError("no error")

    anyio.run(main)
