"""What every route handler shares: the engine, the served names, admission, metrics."""

from __future__ import annotations

import builtins
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import msgspec

from flowengine.engine.protocol import EngineClient
from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.errors import APIError, from_decode_error, too_deep
from flowengine.entrypoints.openai.generation import Admission
from flowengine.entrypoints.openai.protocol import null_default_fields
from flowengine.entrypoints.openai.sampling import RequestLimits
from flowengine.metrics import ServingMetrics

T = TypeVar("T")
logger = logging.getLogger("flowengine.entrypoints.openai.requests")


@dataclass
class ServingContext:
    """State shared by the handlers of one server.

    Attributes:
        engine: the `EngineClient` that serves every request.
        model_names: names a request may use in `model`; the first is the default and
            the name reported by /v1/models first.
        admission: the server-side queue limit.
        metrics: the server's Prometheus metrics.
        started_s: Unix time the server started (the `created` of /v1/models).
        limits: per-request limits (n, log-probabilities, n x max_tokens).
        enable_prompt_tokens_details: usage carries prompt_tokens_details.cached_tokens.
        trust_request_chat_template: chat requests may bring their own `chat_template`.
        chat_parsing: tool-call and reasoning parsers of chat outputs.
    """

    engine: EngineClient
    model_names: tuple[str, ...]
    admission: Admission
    metrics: ServingMetrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    enable_prompt_tokens_details: bool = False
    trust_request_chat_template: bool = False
    chat_parsing: ChatParsingOptions = field(default_factory=ChatParsingOptions)
    started_s: int = field(default_factory=lambda: int(time.time()))

    @cached_property
    def tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (for echo, logprob texts, /tokenize)."""
        return self.engine.get_tokenizer()

    def resolve_model(self, name: str | None) -> str:
        """The served name for a request's `model`. Raises APIError(404) if unknown."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model_names)}",
                param="model",
                code="model_not_found",
            )
        return name

    def request_chat_template(self, chat_template: str | None) -> str | None:
        """A chat request's own `chat_template` (template text), for the chat route and
        /tokenize alike. Raises APIError(400) naming `chat_template` when one is sent
        without --trust-request-chat-template (vLLM's rule and message: a template is
        code the server would run)."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template.",
                param="chat_template",
            )
        return chat_template

    @staticmethod
    def decode(body: bytes, type: type[T]) -> T:
        """Parse and validate a JSON body. A request struct's top-level field sent as
        null takes its default where null is not one of its values (`"stream": null`:
        OpenAI's spec makes such fields nullable). Raises APIError(400) naming the bad
        field."""
        if not body:
            raise APIError(
                400, "the request body is empty; send a JSON object", code="invalid_json"
            )
        try:
            try:
                return msgspec.json.decode(body, type=type)
            except msgspec.ValidationError:
                # The error path only: decode again without the nulls that mean "default".
                data = _without_null_defaults(body, type)
                if data is None:
                    raise
                return msgspec.convert(data, type, str_keys=True)
        except msgspec.DecodeError as err:
            raise from_decode_error(err, body) from err
        except RecursionError:
            # msgspec recurses once per nesting level, also inside fields it skips.
            raise too_deep() from None


def _without_null_defaults(body: bytes, type: Any) -> dict[str, Any] | None:
    """The JSON object `body` without its nulls of `null_default_fields(type)`, or None
    when `type` is not a request struct or there is no such null."""
    if not (isinstance(type, builtins.type) and issubclass(type, msgspec.Struct)):
        return None
    names = null_default_fields(type)
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:  # e.g. 1e999, out of range untyped too: the typed error stands
        return None
    if not isinstance(data, dict):
        return None
    kept = {k: v for k, v in data.items() if v is not None or k not in names}
    return kept if len(kept) < len(data) else None


def usage(
    ctx: ServingContext, num_prompt: int, num_completion: int, num_cached: int
) -> dict[str, Any]:
    """OpenAI's usage object; with --enable-prompt-tokens-details also
    prompt_tokens_details.cached_tokens (prefix-cache hit tokens), as vLLM."""
    body: dict[str, Any] = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }
    if ctx.enable_prompt_tokens_details:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return body


def log_request(
    kind: str,
    request_id: str,
    num_prompt_tokens: int,
    num_generated_tokens: int,
    finish_reasons: list[str | None],
    ttft_s: float | None,
    elapsed_s: float,
    outcome: str = "ok",
) -> None:
    """One INFO line per generation request: ids, counts and timings, never any text."""
    logger.info(
        "%s %s %s: prompt_tokens=%d completion_tokens=%d finish=%s ttft=%s e2e=%.3fs",
        kind,
        request_id,
        outcome,
        num_prompt_tokens,
        num_generated_tokens,
        ",".join(str(r) for r in finish_reasons),
        "-" if ttft_s is None else f"{ttft_s:.3f}s",
        elapsed_s,
    )
