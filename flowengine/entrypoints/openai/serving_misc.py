"""The small routes: /v1/models (and /v1/models/{model}), /tokenize, /detokenize, /health, /version, /metrics.

Shapes of /tokenize and /detokenize are vLLM's (`vllm/entrypoints/openai/protocol.py`,
TokenizeRequest / TokenizeResponse / DetokenizeResponse).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

import flowengine
from flowengine.engine.protocol import EngineDeadError
from flowengine.entrypoints.openai.asgi import (
    APIRequest,
    Response,
    json_response,
    plain_response,
)
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, from_decode_error, too_deep
from flowengine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flowengine.entrypoints.openai.sampling import chat_messages
from flowengine.entrypoints.openai.tool_parsers.request import check_tools

logger = logging.getLogger(__name__)


def _card(ctx: ServingContext, name: str) -> dict[str, Any]:
    """The model card of served name `name`; `root` is the model as given to serve (a
    path or hub id; vLLM's base model path), the same for every served name."""
    args = getattr(ctx.engine, "args", None)
    return {
        "id": name,
        "object": "model",
        "created": ctx.started_s,
        "owned_by": "flowengine",
        "root": getattr(args, "model", None) or ctx.engine.model_name,
        "max_model_len": ctx.engine.max_model_len,
    }


async def list_models(ctx: ServingContext, request: APIRequest) -> Response:
    return json_response({"object": "list", "data": [_card(ctx, n) for n in ctx.model_names]})


async def retrieve_model(ctx: ServingContext, request: APIRequest) -> Response:
    """GET /v1/models/{model}: the card of one served name (OpenAI's "retrieve model").
    Raises APIError(404, model_not_found) for another name."""
    name = request.path_params["model"]
    return json_response(_card(ctx, ctx.resolve_model(name)))


def _decode_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A /tokenize body holds either `prompt` or `messages` (vLLM's two forms)."""
    obj = ServingContext.decode(body, dict[str, Any])
    kind = TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest
    try:
        return msgspec.convert(obj, type=kind)
    except msgspec.ValidationError as err:
        raise from_decode_error(err) from err
    except RecursionError:
        raise too_deep() from None


async def tokenize(ctx: ServingContext, request: APIRequest) -> Response:
    """Token ids of a prompt, or of messages after the chat template."""
    req = _decode_tokenize(request.raw_body)
    ctx.resolve_model(req.model)
    tokenizer = ctx.tokenizer
    if isinstance(req, TokenizeChatRequest):
        # The engine's own template step, so the count is what a chat request uses
        # (its tools rendered too, checked as the chat route checks them).
        from flowengine.tokenize.chat import apply_chat_template

        tools = check_tools(req.tools) if req.tools else None
        # The request's own template where the chat route would take it (vLLM's
        # /tokenize), else --chat-template's, as the engine's template step chooses.
        template = ctx.request_chat_template(req.chat_template)
        try:
            ids = apply_chat_template(
                tokenizer,
                chat_messages(req),
                req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=template or getattr(ctx.engine, "chat_template", None),
                chat_template_kwargs=req.chat_template_kwargs,
                tools=tools,
            )
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
    else:
        ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": ctx.engine.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }
    return json_response(body)


async def detokenize(ctx: ServingContext, request: APIRequest) -> Response:
    req = ctx.decode(request.raw_body, DetokenizeRequest)
    ctx.resolve_model(req.model)
    # Hugging Face's fast tokenizers decode an id past their vocabulary to "" without a
    # word (the model's own vocabulary may be padded past it): refuse it, as prompts'
    # out-of-vocabulary ids are.
    size = len(ctx.tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in the tokenizer's vocabulary "
                            f"(ids 0..{size - 1})", param="tokens")
    try:
        text = ctx.tokenizer.decode(req.tokens)
    except (ValueError, TypeError, OverflowError, IndexError) as err:
        raise APIError(400, f"cannot decode these token ids: {err}", param="tokens") from err
    return json_response({"prompt": text})


async def health(ctx: ServingContext, request: APIRequest) -> Response:
    """200 with an empty body while the engine can serve; 503 once it is dead."""
    try:
        await ctx.engine.check_health()
    except EngineDeadError as err:
        raise APIError(
            503, f"the engine is dead: {err}", type="service_unavailable_error", code="engine_dead"
        ) from err
    return plain_response(b"", "text/plain; charset=utf-8")


async def version(ctx: ServingContext, request: APIRequest) -> Response:
    return json_response({"version": flowengine.__version__})


async def metrics(ctx: ServingContext, request: APIRequest) -> Response:
    return plain_response(ctx.metrics.render(), ctx.metrics.content_type)
