"""One streamed request against an OpenAI-compatible server, timed like vLLM's client.

Timing follows vLLM's `async_request_openai_completions`: TTFT is the arrival of the
first chunk with content, every later content chunk adds an ITL gap, the latency
ends at the last content chunk. Output tokens come from the server's usage chunk
(`stream_options.include_usage`); a server that sends none is credited one token per
content chunk.

`run_load` is one client's whole run (arrivals, the concurrency limit, every request);
the in-process benchmark and each `serve_worker` process call it alike.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from flowengine.bench.serve_dataset import BenchRequest
from flowengine.bench.serve_metrics import RequestResult


@dataclass(frozen=True)
class ClientJob:
    """What one client sends: where, its requests, and how fast (rate in req/s)."""

    base_url: str
    headers: dict[str, str]
    endpoint: str
    model: str
    requests: list[BenchRequest]
    max_concurrency: int
    request_rate: float  # inf: all at once
    burstiness: float
    seed: int
    ignore_eos: bool
    temperature: float

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def open_client(job: ClientJob) -> httpx.AsyncClient:
    """An HTTP client with one keep-alive connection per request the job may have in flight."""
    limit = job.max_concurrency
    return httpx.AsyncClient(
        base_url=job.base_url,
        headers=job.headers,
        timeout=httpx.Timeout(None, connect=30.0),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )


async def run_load(
    client: httpx.AsyncClient, job: ClientJob, on_done: Callable[[], object] = lambda: None
) -> list[RequestResult]:
    """Send every request of the job as `arrivals` releases it, at most
    `job.max_concurrency` in flight; results in the job's request order."""
    semaphore = asyncio.Semaphore(job.max_concurrency)

    async def one(req: BenchRequest) -> RequestResult:
        payload = build_payload(
            req, job.model, chat=job.is_chat, ignore_eos=job.ignore_eos,
            temperature=job.temperature,
        )  # fmt: skip
        async with semaphore:
            result = await send_request(client, job.endpoint, payload, req.prompt_len)
        on_done()
        return result

    tasks = []
    async for req in arrivals(job.requests, job.request_rate, job.burstiness, job.seed):
        tasks.append(asyncio.ensure_future(one(req)))
    return list(await asyncio.gather(*tasks))


def build_payload(
    req: BenchRequest, model: str, *, chat: bool, ignore_eos: bool, temperature: float
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extra field: exactly output_len tokens
    return payload


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    path: str,
    payload: dict[str, Any],
    prompt_len: int,
) -> RequestResult:
    """Send one streaming request; never raises for HTTP or stream errors."""
    result = RequestResult(prompt_len=prompt_len)
    num_chunks = 0
    usage: dict[str, Any] | None = None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                result.error = f"HTTP {resp.status_code}: {body[:300].decode(errors='replace')}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                usage = chunk.get("usage") or usage
                if _content(chunk):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    if num_chunks == 0:
        result.error = "the stream held no content"
        return result
    result.latency_s = last - start
    result.output_tokens = int(usage["completion_tokens"]) if usage else num_chunks
    if usage and usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])  # what the server really processed
    result.success = True
    return result


async def arrivals(
    requests: Sequence[BenchRequest], request_rate: float, burstiness: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Yield requests spaced by gamma-distributed gaps (Poisson at burstiness 1).

    The mean gap is 1 / request_rate seconds; `inf` sends all at once (vLLM's
    `get_request`: shape = burstiness, scale = 1 / (rate * burstiness)).
    """
    rng = random.Random(seed)
    for i, req in enumerate(requests):
        yield req
        if request_rate != float("inf") and i + 1 < len(requests):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
