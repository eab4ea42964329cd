"""POST /v1/embeddings: OpenAI's embeddings on a pooling-runner model.

`input` is a string, a list of strings, a list of token ids or a list of token-id
lists; each input runs as its own prefill-only engine request, concurrently, and
`data[i]` is input i's vector. `encoding_format` "float" gives lists of numbers,
"base64" the float32 little-endian bytes in base64 (what the `openai` SDK asks for by
default and decodes). `dimensions` is honoured only by Matryoshka models (others: 400,
as vLLM). vLLM's extra fields `truncate_prompt_tokens`, `normalize` and `priority` are
accepted. A generation model answers 400 here, and a pooling model answers 400 on the
generation routes (the engine's InputProcessor decides, in one place).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Any, Literal

import msgspec

from flowengine.entrypoints.openai.asgi import APIRequest, Response, json_response
from flowengine.entrypoints.openai.context import ServingContext, log_request
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.generation import engine_error
from flowengine.entrypoints.openai.protocol import INT64_MAX, Int64, NonNegInt, PosInt
from flowengine.pooling.params import EmbeddingRequestOutput, PoolingParams

# Most inputs in one request (OpenAI's limit for /v1/embeddings).
MAX_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's fields, then vLLM's extras)."""

    input: str | list[str | NonNegInt | list[NonNegInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PosInt | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)] | None = None
    normalize: bool | None = None
    priority: Int64 = 0


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class EmbeddingData(_Strict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a str with encoding_format "base64"


class EmbeddingUsage(_Strict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Strict):
    """The response body (OpenAI's embedding list, plus vLLM's id and created)."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def split_inputs(inp: str | list[Any]) -> list[str | list[int]]:
    """The inputs of a request. Raises APIError(400) for an empty or mixed list."""
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise bad_request("input is an empty list; give at least one input", "input")
    if all(isinstance(p, str) for p in inp):
        return list(inp)
    if all(isinstance(p, int) for p in inp):
        return [list(inp)]
    if all(isinstance(p, list) for p in inp):
        return list(inp)
    raise bad_request("input must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists; do not mix these forms", "input")


async def _embed_one(ctx: ServingContext, prompt: str | list[int], params: PoolingParams,
                     request_id: str, priority: int) -> EmbeddingRequestOutput:
    """One input through the engine. Raises APIError."""
    try:
        out = None
        async for delta in ctx.engine.encode(prompt, params, request_id,  # type: ignore[attr-defined]
                                             priority=priority):
            out = delta
    except Exception as err:  # noqa: BLE001 - mapped to the client's status code
        raise engine_error(err) from err
    if out is None or out.outputs is None:
        raise APIError(500, f"embedding request {request_id} failed: "
                       f"{'no output' if out is None else out.error}",
                       type="internal_server_error")
    return out


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


async def create_embedding(ctx: ServingContext, request: APIRequest) -> Response:
    """Handle one embeddings request. Raises APIError (400/404/429/503)."""
    req = ctx.decode(request.raw_body, EmbeddingRequest)
    model = ctx.resolve_model(req.model)
    if not getattr(ctx.engine, "is_pooling", False):
        raise APIError(400, f"the model {model!r} does not support the Embeddings API: it "
                       "serves generation; start an embedding model, or this one with "
                       "--runner pooling", code="model_not_supported")
    inputs = split_inputs(req.input)
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input has {len(inputs)} items; send at most {MAX_INPUTS} per "
                          "request (OpenAI's limit)", "input")
    try:
        params = PoolingParams(req.dimensions, req.normalize, req.truncate_prompt_tokens)
    except ValueError as err:
        raise bad_request(str(err)) from err
    start = time.monotonic()
    base_id = f"embd-{uuid.uuid4().hex}"
    ids = [base_id if len(inputs) == 1 else f"{base_id}-{i}" for i in range(len(inputs))]
    # One request in the server's queue limit however many inputs it has (they run as
    # one batch of prefill-only engine requests and finish together).
    ctx.admission.enter()
    tasks = [asyncio.ensure_future(_embed_one(ctx, p, params, rid, req.priority))
             for p, rid in zip(inputs, ids, strict=True)]
    try:
        outs = await asyncio.gather(*tasks)
    except BaseException:
        # One input failed (or the client went away): stop the others, which aborts
        # their engine requests, then answer with the first error.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        ctx.admission.leave()
    num_prompt = sum(len(o.prompt_token_ids) for o in outs)
    log_request("embedding", base_id, num_prompt, 0, ["stop"] * len(outs), None,
                time.monotonic() - start)
    return json_response({
        "id": base_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"object": "embedding", "index": i,
                  "embedding": _encode(o.outputs.vector, req.encoding_format)}
                 for i, o in enumerate(outs)],
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt},
    })
