"""OpenAI request fields → `SamplingParams`, and the checks for fields we cannot serve.

Defaults are OpenAI's where OpenAI has one (temperature 1, top_p 1, completions
max_tokens 16) and `SamplingParams`' otherwise. `SamplingParams` validates the values;
its `ValueError`/`TypeError` becomes a 400 with the same message. The server's
per-request limits (`RequestLimits`: `n`, log-probabilities, `n x max_tokens`) are
checked here, each 400 naming the limit and its flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from flowengine.engine.input_processor import REQUESTED_MAX_TOKENS
from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams

# vLLM allows up to this many logprobs by default (ModelConfig.max_logprobs).
DEFAULT_MAX_LOGPROBS = 20
# Completions of one request (n). Each is a sequence in the batch; past this one
# request could hold every seat of the engine for its whole run (issue 21 item 3).
DEFAULT_MAX_N = 128
# Completions max_tokens when the request omits it (OpenAI's and vLLM's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits of the server (each refused with a 400 naming it).

    Attributes:
        max_n: most completions per prompt (`n`, also `best_of`); `--max-n`.
        max_logprobs: most top log-probabilities per token (completions `logprobs`,
            chat `top_logprobs`, which OpenAI caps at 20 anyway); `--max-logprobs`.
        max_request_tokens: most tokens one request may ask to generate, `n x
            max_tokens` summed over its prompts (None: no limit beyond `max_n`);
            `--max-request-tokens`.
    """

    max_n: int = DEFAULT_MAX_N
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_request_tokens: int | None = None


def check_limits(
    limits: RequestLimits,
    params: SamplingParams,
    num_prompts: int,
    max_model_len: int,
    logprobs_field: str = "logprobs",
    n_field: str = "n",
) -> None:
    """Raise APIError(400) when a request exceeds the server's limits.

    `logprobs_field` is the request field that asked for log-probabilities (chat:
    "top_logprobs"), named as the error's `param`; `n_field` the field that set
    `params.n` (a beam search's width: "best_of"), named in the token cap's message.
    """
    if params.n > limits.max_n:
        raise bad_request(
            f"n is {params.n}, over this server's limit of {limits.max_n} completions per "
            "prompt; ask for fewer (the server's --max-n sets the limit)",
            "n",
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None or limits.max_logprobs == -1:
            continue
        field_name = logprobs_field if name == "logprobs" else name
        if value == -1:
            raise bad_request(
                f"{field_name}=-1 asks for the whole vocabulary's log-probabilities; this "
                f"server allows {limits.max_logprobs} (--max-logprobs -1 lifts the limit)",
                field_name,
            )
        if value > limits.max_logprobs:
            raise bad_request(
                f"{value} log-probabilities per token were asked for, over this "
                f"server's limit of {limits.max_logprobs} (--max-logprobs)",
                field_name,
            )
    if limits.max_request_tokens is not None:
        per_sample = params.max_tokens if params.max_tokens is not None else max_model_len
        work = num_prompts * params.n * per_sample
        if work > limits.max_request_tokens:
            raise bad_request(
                f"this request may generate {work} tokens ({num_prompts} prompt(s) x "
                f"{n_field}={params.n} x max_tokens={per_sample}), over this server's limit "
                f"of {limits.max_request_tokens} (--max-request-tokens); lower {n_field} or "
                "max_tokens",
                "max_tokens",
            )


# Request fields a model's generation_config.json may give a default for (vLLM's
# default_sampling_params); max_tokens is handled apart (a cap, see capped_max_tokens).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def capped_max_tokens(requested: int | None, defaults: dict[str, Any]) -> int | None:
    """vLLM's `get_max_tokens`: the smallest of the request's max_tokens and the
    model's max_new_tokens (the engine caps it at the context left as well). The HTTP
    routes and gRPC (flowengine/entrypoints/grpc/server.py) use this one rule."""
    values = [v for v in (requested, defaults.get("max_tokens")) if v is not None]
    return min(values) if values else None


def completion_max_tokens_check(req: CompletionRequest) -> dict[str, Any] | None:
    """The REQUESTED_MAX_TOKENS check of a completions request: the max_tokens the
    client sent (it must fit the context with the prompt, else 400), None when it
    sent none (the default 16 is capped at the context left) or null."""
    if req.max_tokens is msgspec.UNSET or req.max_tokens is None:
        return None
    return {"param": "max_tokens", "max_tokens": max(req.max_tokens, 1)}


def chat_max_tokens_check(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The REQUESTED_MAX_TOKENS check of a chat request: max_completion_tokens (or
    max_tokens) as the client sent it; None when unset (then the answer may take the
    whole context left, as in vLLM)."""
    if req.max_completion_tokens is not None:
        return {"param": "max_completion_tokens", "max_tokens": req.max_completion_tokens}
    if req.max_tokens is not None:
        return {"param": "max_tokens", "max_tokens": req.max_tokens}
    return None


def with_max_tokens_check(prompt: Any, check: dict[str, Any] | None) -> Any:
    """`prompt` (text, token ids, a conversation or a dict prompt) as a dict prompt
    carrying `check` under REQUESTED_MAX_TOKENS (input_processor.py); as it is when
    `check` is None."""
    if check is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, REQUESTED_MAX_TOKENS: check}
    if isinstance(prompt, str):
        return {"prompt": prompt, REQUESTED_MAX_TOKENS: check}
    if prompt and isinstance(prompt[0], dict):
        return {"messages": prompt, REQUESTED_MAX_TOKENS: check}
    return {"prompt_token_ids": prompt, REQUESTED_MAX_TOKENS: check}


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token id as a JSON string -> bias) with int keys."""
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0 or str(token_id) != key:  # digits only, as the OpenAPI document says
            raise bad_request(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                "logit_bias",
            )
        bias[token_id] = value
    return bias


def _common(req: SamplingFields, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments both routes share. `defaults`: the engine's
    `default_sampling_params`, used for MODEL_DEFAULT_FIELDS the request leaves unset
    (request > model defaults > SamplingParams defaults, as vLLM)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.stream and req.prompt_logprobs not in (None, 0):
        # Streamed responses carry no prompt log-probabilities; refused rather than
        # computed and dropped (vLLM's rule, the same message).
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                          "prompt_logprobs")
    fields: dict[str, Any] = {
        "n": req.n,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias)
    optional = {
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
        "prompt_logprobs": req.prompt_logprobs,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "extra_args": req.vllm_xargs,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
    }
    for name in MODEL_DEFAULT_FIELDS:
        if optional[name] is None and defaults and defaults.get(name) is not None:
            optional[name] = defaults[name]
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


# vLLM's backend names (guided_decoding_backend is checked against them, then ignored).
VLLM_BACKEND_NAMES = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


def structured_outputs_params(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from `response_format`, `structured_outputs` or the
    `guided_*` fields (at most one of them), checked before anything is generated.

    Raises APIError(400) naming the field: two constraints at once, an invalid schema,
    regex or grammar, or a schema keyword no backend supports (validate.py).
    """
    backend = req.guided_decoding_backend
    if backend is not None and backend not in VLLM_BACKEND_NAMES:
        raise bad_request(f"guided_decoding_backend must be one of {list(VLLM_BACKEND_NAMES)}, "
                          f"got {backend!r}", "guided_decoding_backend")
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise bad_request("response_format of type json_schema needs "
                                  "json_schema.schema (a JSON schema object)",
                                  "response_format.json_schema.schema")
            found.append(("response_format.json_schema.schema",
                          {"json": fmt.json_schema.schema}))
        else:  # structural_tag: vLLM's `format`, or the older structures + triggers
            if fmt.format is not None:
                tag: dict[str, Any] = {"type": "structural_tag", "format": fmt.format}
            elif fmt.structures is not None and fmt.triggers is not None:
                tag = {"type": "structural_tag", "structures": fmt.structures,
                       "triggers": fmt.triggers}
            else:
                raise bad_request("response_format of type structural_tag needs format, or "
                                  "structures and triggers", "response_format")
            found.append(("response_format", {"structural_tag": tag}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        fields = {f: getattr(so, f) for f in so.__struct_fields__}
        found.append(("structured_outputs", fields))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                       ("structural_tag", "structural_tag")):  # chat only
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one structured-output constraint, not several ({names})",
                          found[1][0])
    field, fields = found[0]
    try:
        params = StructuredOutputsParams(**fields)
    except ValueError as err:
        message = str(err)
        if field != "structured_outputs":
            message = message.replace("structured_outputs must set", f"{field} must set")
            for kind in fields:
                message = message.replace(f"structured_outputs.{kind}", field)
        raise bad_request(message, field) from None
    from flowengine.structured_outputs.validate import validate_structured_outputs

    try:
        validate_structured_outputs(
            params, field=None if field == "structured_outputs" else field)
    except ValueError as err:
        raise bad_request(str(err), field) from None
    return params


def _build(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as err:
        # SamplingParams' messages start with the field they refuse ("top_p must be
        # ...", "logit_bias[1] must be ..."): that field is the error's `param`.
        m = _LEADING_FIELD.match(str(err))
        param = m.group(1) if m and m.group(1) in fields else None
        raise APIError(400, str(err), param=param) from err


_LEADING_FIELD = re.compile(r"([a-z][a-z0-9_]*)[\[ ]")


def completion_params(
    req: CompletionRequest, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams for /v1/completions; `defaults` as for `_common`. Raises
    APIError(400), also for max_tokens 0 without echo."""
    if req.suffix:
        raise bad_request("suffix is not supported; put the text in the prompt", "suffix")
    # With use_beam_search, best_of is the beam width (serving_beam.py checks it).
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise bad_request(
            f"best_of={req.best_of} with n={req.n} is not supported; leave best_of unset "
            "or equal to n",
            "best_of",
        )
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo: true, which returns the "
            "prompt alone)",
            "max_tokens",
        )
    fields = _common(req, defaults)
    # echo with max_tokens 0 (vLLM's echo without generation): one token is generated
    # and dropped; the choice is the prompt with its logprobs.
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
    if max_tokens is msgspec.UNSET:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    fields["max_tokens"] = capped_max_tokens(max_tokens, defaults or {})
    fields["logprobs"] = req.logprobs
    fields["structured_outputs"] = structured_outputs_params(req)
    if req.echo and req.logprobs is not None:
        # The echoed prompt tokens come with their logprobs (vLLM: prompt_logprobs =
        # logprobs unless prompt_logprobs asks for more).
        asked = fields.get("prompt_logprobs")
        if asked is None or (asked != -1 and (req.logprobs == -1 or req.logprobs > asked)):
            fields["prompt_logprobs"] = req.logprobs
    return _build(fields)


def _echo_would_change_output(req: ChatCompletionRequest) -> bool:
    """vLLM's chat `echo` prepends the last message's content when its role is the
    answer's (assistant with the generation prompt, else the last message's own role);
    otherwise echo has no effect."""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return False
    if isinstance(last.content, list):
        return any(part.text for part in last.content)
    return bool(last.content)


def chat_params(
    req: ChatCompletionRequest, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams for /v1/chat/completions; `defaults` as for `_common`. Raises
    APIError(400), also for continue_final_message with add_generation_prompt."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    if req.functions:
        # tools/tool_choice are resolved by the chat route (tool_parsers/request.py).
        raise bad_request(
            "functions (OpenAI's deprecated form) is not supported; send them as tools",
            "functions",
        )
    if req.top_logprobs and not req.logprobs:  # 0 asks for nothing: accepted, as vLLM
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            f"best_of={req.best_of} with n={req.n} is not supported; leave best_of unset "
            "or equal to n",
            "best_of",
        )
    if req.echo and _echo_would_change_output(req):
        raise bad_request(
            "echo is not supported yet on chat completions (vLLM would prepend the last "
            "message's content to the answer); remove it, it would change the output",
            "echo",
        )
    fields = _common(req, defaults)
    max_tokens = req.max_completion_tokens
    requested = req.max_tokens if max_tokens is None else max_tokens
    fields["max_tokens"] = capped_max_tokens(requested, defaults or {})
    if req.logprobs:
        fields["logprobs"] = req.top_logprobs or 0
    fields["structured_outputs"] = structured_outputs_params(req)
    return _build(fields)


def chat_messages(req: ChatCompletionRequest | Any) -> list[dict[str, Any]]:
    """Messages as the engine takes them: {"role", "content"} with text content, plus
    `name`, `tool_calls` (OpenAI's list of {"id", "type", "function": {"name",
    "arguments"}}) and `tool_call_id` where the message has them.

    Text parts are joined with newlines (vLLM's "string" content format). Roles pass
    through unchanged; the engine's chat template step maps `developer` to `system`
    for templates that do not know it, and gives templates each call's arguments as a
    dict (flowengine/tokenize/chat.py).
    """
    messages = []
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            text = m.content or ""
        else:
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(
                        f"content part type {part.type!r} is not supported; send text parts "
                        "({'type': 'text', 'text': ...})",
                        f"messages[{i}].content[{j}]",
                    )
                if part.text is None:
                    raise bad_request(
                        "a text content part needs its text ({'type': 'text', 'text': ...})",
                        f"messages[{i}].content[{j}].text",
                    )
                texts.append(part.text)
            text = "\n".join(texts)
        message: dict[str, Any] = {"role": m.role, "content": text}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(
                    "only assistant messages carry tool_calls", f"messages[{i}].tool_calls"
                )
            for j, c in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                text = c.function.arguments
                try:  # templates get the arguments as an object (tokenize/chat.py)
                    arguments = orjson.loads(text) if text.strip() else {}
                except orjson.JSONDecodeError as err:
                    raise bad_request(
                        f"the arguments of a tool call must be JSON text of an object: {err}",
                        where,
                    ) from None
                if not isinstance(arguments, dict):
                    # As the Responses route refuses a function_call's: a template would
                    # render a list or number where it expects the arguments object.
                    raise bad_request(
                        "the arguments of a tool call must be JSON text of an object, got "
                        f"{type(arguments).__name__}",
                        where,
                    )
            message["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls
            ]  # fmt: skip
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages
