"""A fake `EngineClient` whose model answers from a script: the reply to a chat is
`scripts[last user message]` (or `scripts[key(messages)]` with a `key` function), sent a
few characters per step (sizes cycling 1..5, so
markers and JSON are cut at every kind of place), each piece one token. Ends with
finish_reason "stop", or "length" once max_tokens pieces were sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from openai_fake_engine import FakeEngine

from flowengine.outputs import CompletionOutput, RequestOutput
from flowengine.sampling_params import SamplingParams


def pieces(text: str) -> list[str]:
    out, i, k = [], 0, 1
    while i < len(text):
        out.append(text[i : i + k])
        i += k
        k = k % 5 + 1
    return out


class ScriptedEngine(FakeEngine):
    def __init__(self, scripts: dict[str, str], key: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scripts = scripts
        self.key = key

    async def _generate(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int
    ) -> AsyncIterator[RequestOutput]:
        text, ids = self._prompt_ids(prompt)
        messages = prompt["messages"] if isinstance(prompt, dict) else prompt
        users = [m["content"] for m in messages if m["role"] == "user"]
        wanted = self.key(messages) if self.key is not None else (users[-1] if users else "")
        script = self.scripts.get(wanted, "no script for this prompt")
        self.submitted.append((request_id, prompt, params))
        parts = pieces(script)
        limit = params.max_tokens or len(parts)
        for step in range(min(len(parts), limit)):
            await asyncio.sleep(self.step_s)
            last = step == min(len(parts), limit) - 1
            reason = None if not last else ("stop" if step == len(parts) - 1 else "length")
            outs = [
                CompletionOutput(index=i, text=parts[step], token_ids=[step],
                                 finish_reason=reason)
                for i in range(params.n)
            ]  # fmt: skip
            yield RequestOutput(request_id, text, ids, outs, finished=last)
