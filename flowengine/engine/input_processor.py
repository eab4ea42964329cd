"""Frontend side of admission: prompt → token ids, validation, fan-out of `n`.

Everything a caller can get wrong is checked here, before the request reaches the
scheduler, and raised as `ValueError`/`TypeError` with the numbers that matter. The
engine keeps serving everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowengine.errors import RequestTypeError, RequestValidationError
from flowengine.messages import NewRequest
from flowengine.pooling.config import PoolerConfig
from flowengine.pooling.params import PoolingParams
from flowengine.sampling_params import SamplingParams
from flowengine.tokenize.chat import apply_chat_template, encode_text

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...},
# which may also carry "cache_salt" (vLLM's TextPrompt / TokensPrompt field).
PromptType = str | Sequence[int] | dict[str, Any]
Conversation = list[dict[str, Any]]
# The most samples (`n`) one request may fan out into: vLLM's VLLM_MAX_N_SEQUENCES
# default. SamplingParams takes any int64 n (the rings carry it); past this, building
# the n child requests alone took minutes and tens of GB before anything ran.
MAX_N_SEQUENCES = 16384
# Chat-template options of a conversation request (vLLM's request field names); they
# travel with the messages as {"messages": [...], "chat_template_kwargs": {...}, ...}.
CHAT_OPTIONS = (
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
    "tools",
)  # fmt: skip


# A dict prompt's key asking that the request's max_tokens fit the context:
# {"param": the request field that set it ("max_tokens", "max_completion_tokens",
# "max_output_tokens"), "max_tokens": the value the client sent}. The OpenAI routes
# set it when the client gave a cap (vLLM's server answers 400 for one that does not
# fit); without it max_tokens is capped at the context left, as vLLM's LLM does.
REQUESTED_MAX_TOKENS = "requested_max_tokens"


def check_max_tokens_fit(
    num_prompt_tokens: int, max_model_len: int, requested: dict[str, Any] | None
) -> None:
    """Raise RequestFieldError (a ValueError) when the prompt plus the requested
    max_tokens exceed max_model_len (vLLM's `_validate_input` rule and numbers).

    Args:
        num_prompt_tokens: the prompt's length in tokens, after truncation.
        max_model_len: context limit in tokens (prompt + output).
        requested: the prompt's REQUESTED_MAX_TOKENS value, or None (no check).
    """
    if requested is None:
        return
    param, max_tokens = requested.get("param"), requested.get("max_tokens")
    if not isinstance(param, str) or not isinstance(max_tokens, int):
        # The frontend's own contract, not the client's input: a bug if it breaks.
        raise TypeError(f"{REQUESTED_MAX_TOKENS} must be {{'param': str, 'max_tokens': "
                        f"int}}, got {requested!r}")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestFieldError(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {num_prompt_tokens} input "
            f"tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}); lower "
            f"{param} to at most {max_model_len - num_prompt_tokens} or shorten the prompt",
            param,
        )


@dataclass
class ProcessedPrompt:
    """A validated request, ready for the engine: one `NewRequest` per sample (`n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    children: list[NewRequest]
    cache_salt: str | None = None
    # Embedding requests (pooling runner): their options, `normalize` resolved.
    pooling_params: PoolingParams | None = None


def validate_cache_salt(cache_salt: object) -> None:
    """Raise ValueError unless `cache_salt` is None or a non-empty string (vLLM's rule)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RequestValidationError(f"cache_salt must be a non-empty string, got {cache_salt!r}")


class RequestFieldError(RequestValidationError):
    """A request field the engine refuses; `param` names it (the HTTP error's `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


def check_priority(priority: object, scheduling_policy: str) -> None:
    """Raise TypeError unless `priority` is an int (not a bool), ValueError unless it fits
    int64 (the scheduler orders by it; the rings carry it as int64), and RequestFieldError
    (a ValueError) for a non-zero priority unless `scheduling_policy` is "priority":
    under "fcfs" the scheduler ignores it, so it is refused rather than silently dropped
    (vLLM's rule and message)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestTypeError(f"priority must be an int, not {type(priority).__name__}")
    if not -(2**63) <= priority < 2**63:
        raise RequestValidationError(f"priority must fit a signed 64-bit integer, got {priority}")
    if priority != 0 and scheduling_policy != "priority":
        raise RequestFieldError(
            f"Got priority {priority} but Priority scheduling is not enabled. Start the "
            "engine with scheduling_policy='priority' (--scheduling-policy priority), or "
            "leave priority at 0", "priority")


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-side id of sample `index` of a request (the id itself when n == 1)."""
    return request_id if n == 1 else f"{request_id}-{index}"


class InputProcessor:
    """Validates and tokenizes prompts.

    Args:
        tokenizer: a Hugging Face tokenizer (`transformers.PreTrainedTokenizerBase`).
        max_model_len: context limit in tokens; a prompt must leave room for one token.
        vocab_size: model vocabulary size; token ids must be in [0, vocab_size).
        eos_token_id: id that ends generation unless `ignore_eos`.
        extra_eos_token_ids: further end ids (generation_config.json), added to each
            request's stop_token_ids unless `ignore_eos` (as vLLM does).
        max_logprobs: largest `logprobs` / `prompt_logprobs` a request may ask for; -1
            means no limit (then -1, the whole vocabulary, is allowed), as in vLLM.
        chat_template: template text used instead of the tokenizer's (`--chat-template`).
        default_sampling_params: the model's sampling defaults (generation_config.json,
            flowengine/model/generation_config.py), as SamplingParams keyword arguments.
        structured_outputs_backend: the engine's --structured-outputs-backend; a
            request's structured_outputs is checked against it here (ValueError naming
            the field, before the request enters the engine).
        scheduling_policy: the scheduler's --scheduling-policy; a non-zero `priority`
            is refused unless it is "priority" (check_priority).
        pooler_config: the pooling runner's PoolerConfig (the model serves embeddings
            only: `process` then needs PoolingParams), or None (generation only).
        hidden_size: the model's hidden size (the longest embedding).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        extra_eos_token_ids: tuple[int, ...] = (),
        max_logprobs: int = 20,
        chat_template: str | None = None,
        default_sampling_params: dict[str, Any] | None = None,
        structured_outputs_backend: str = "auto",
        scheduling_policy: str = "fcfs",
        pooler_config: PoolerConfig | None = None,
        hidden_size: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured_outputs_backend = structured_outputs_backend
        self.scheduling_policy = scheduling_policy
        self.pooler_config = pooler_config
        self.hidden_size = hidden_size
        self.chat_template = chat_template
        self.default_sampling_params = dict(default_sampling_params or {})
        self.extra_eos_token_ids = extra_eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_logprobs = max_logprobs

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, token ids). Raises ValueError/TypeError."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestValidationError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestValidationError("the prompt is empty; give at least one character or token")
            return prompt, encode_text(self.tokenizer, prompt, "the prompt")
        if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestTypeError("token-id prompts must be lists of int")
            return None, ids
        raise RequestTypeError(
            f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}"
        )

    def default_params(self) -> SamplingParams:
        """SamplingParams for a request that gives none: the model's defaults over
        SamplingParams' (vLLM's `get_default_sampling_params`)."""
        return SamplingParams(**self.default_sampling_params)

    def chat_prompt(
        self,
        conversation: Conversation,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """Apply the chat template to one conversation: (text, token ids).

        chat_template: this request's template text, else `--chat-template`'s, else the
        tokenizer's. The other options as `flowengine.tokenize.chat.apply_chat_template`.
        Raises ValueError/TypeError naming the bad option.
        """
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise RequestTypeError(
                "chat_template_kwargs must be a dict, got "
                f"{type(chat_template_kwargs).__name__}"
            )
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise RequestTypeError(f"{name} must be a bool, got {type(flag).__name__}")
        ids = apply_chat_template(
            self.tokenizer,
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template or self.chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return self.tokenizer.decode(ids), ids

    def chat_request(self, prompt: dict[str, Any]) -> tuple[str, list[int]]:
        """`chat_prompt` of {"messages": [...], <CHAT_OPTIONS>...} (other keys ignored)."""
        messages = prompt["messages"]
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
            raise RequestValidationError("'messages' must be a non-empty list of message objects")
        return self.chat_prompt(
            messages, **{k: prompt[k] for k in CHAT_OPTIONS if prompt.get(k) is not None}
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        requested_max_tokens: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """Validate one request and fan it out into `params.n` `NewRequest`s (ValueError
        for n over MAX_N_SEQUENCES).

        pooling_params: an embedding request (the pooling runner's only kind; then
        `params` is ignored): one prefill-only NewRequest whose result is the pooled
        vector. Raises ValueError for an embedding request to a generate model or a
        generation request to a pooling model (vLLM's errors), and for `dimensions`
        the model does not support.

        cache_salt: isolates the request's prefix-cache blocks: only requests with the
        same salt share them (vLLM's `cache_salt`; a dict prompt's "cache_salt" key is
        used when this is None). Raises ValueError unless it is None or a non-empty str.

        requested_max_tokens: the client's max_tokens that must fit the context with the
        prompt (`check_max_tokens_fit`; a dict prompt's REQUESTED_MAX_TOKENS key is used
        when this is None); RequestFieldError when it does not.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, not {type(params).__name__}")
        if pooling_params is None and self.pooler_config is None:
            # NOTE: SamplingParams validates at construction, but its fields can be set
            # afterwards (sp.n = 0 fanned out no sample: an IndexError, or "ended
            # without output"; sp.stop = "ab" stopped at "a" or "b"): a copy validates
            # and normalises them again.
            params = params.clone()
        check_priority(priority, self.scheduling_policy)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        validate_cache_salt(cache_salt)
        if pooling_params is not None or self.pooler_config is not None:
            return self._process_pooling(request_id, prompt, pooling_params, priority,
                                         arrival_time, prompt_token_ids, cache_salt)
        if params.n > MAX_N_SEQUENCES:
            raise RequestValidationError(f"n={params.n} exceeds {MAX_N_SEQUENCES}, the most completions "
                             "one request may ask for; ask for fewer")
        if prompt_token_ids is None:
            text, ids = self.tokenize(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), prompt_token_ids
        ids = self.truncate(ids, params)
        self.validate(ids, params)
        if requested_max_tokens is None and isinstance(prompt, dict):
            requested_max_tokens = prompt.get(REQUESTED_MAX_TOKENS)
        check_max_tokens_fit(len(ids), self.max_model_len, requested_max_tokens)
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        self.check_allowed_token_ids(params)
        now = time.monotonic() if arrival_time is None else arrival_time
        children = [
            NewRequest(
                child_request_id(request_id, i, params.n),
                ids,
                self._child_params(params, i),
                now,
                eos_token_id=self.eos_token_id,
                priority=priority,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        return ProcessedPrompt(request_id, text, ids, params, children, cache_salt)

    def _process_pooling(self, request_id: str, prompt: PromptType,
                         params: PoolingParams | None, priority: int,
                         arrival_time: float | None, prompt_token_ids: list[int] | None,
                         cache_salt: str | None) -> ProcessedPrompt:
        """`process` for an embedding request: one NewRequest that computes the whole
        prompt (up to max_model_len tokens: nothing is generated) and finishes with its
        pooled vector (max_tokens 1, so that async scheduling plans no token after it)."""
        config = self.pooler_config
        if config is None:
            raise RequestValidationError("this model serves generation, not embeddings; start it with "
                             "runner 'pooling' (--runner pooling) to embed")
        if params is None:
            raise RequestValidationError("this model serves embeddings only (runner 'pooling'): use "
                             "LLM.embed, AsyncEngine.encode or /v1/embeddings, not generation")
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling params must be PoolingParams, not {type(params).__name__}")
        config.check_dimensions(params.dimensions, self.hidden_size)
        if params.normalize is None:
            params = PoolingParams(params.dimensions, config.normalize,
                                   params.truncate_prompt_tokens)
        if prompt_token_ids is None:
            text, ids = self.tokenize(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), prompt_token_ids
        ids = self._truncate_to(ids, params.truncate_prompt_tokens)
        if not ids:
            raise RequestValidationError("the prompt is empty; give at least one character or token")
        if len(ids) > self.max_model_len:
            raise RequestValidationError(
                f"the input has {len(ids)} tokens, but max_model_len is {self.max_model_len}; "
                "shorten it, or set truncate_prompt_tokens to keep its last tokens")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestValidationError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        sampling = SamplingParams(max_tokens=1, detokenize=False)
        now = time.monotonic() if arrival_time is None else arrival_time
        child = NewRequest(request_id, ids, sampling, now, eos_token_id=None, priority=priority,
                           cache_salt=cache_salt)
        return ProcessedPrompt(request_id, text, ids, sampling, [child], cache_salt,
                               pooling_params=params)

    def truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The last `truncate_prompt_tokens` ids, or `ids` as given. -1: as many as fit
        with one generated token, max_model_len - 1 (a prompt must leave room for one).

        Raises ValueError when truncate_prompt_tokens exceeds max_model_len (vLLM's rule).
        """
        k = params.truncate_prompt_tokens
        return self._truncate_to(ids, self.max_model_len - 1 if k == -1 else k)

    def _truncate_to(self, ids: list[int], k: int | None) -> list[int]:
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        elif k > self.max_model_len:
            raise RequestValidationError(
                f"truncate_prompt_tokens={k} is greater than max_model_len="
                f"{self.max_model_len}; choose a smaller truncation size"
            )
        return ids[-k:]

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Token ids of each bad word as it starts the text and, where that differs in
        its first token only, as it follows a space (vLLM's `update_from_tokenizer`
        rule): the word is then banned both at the beginning and in the middle of text.

        Raises ValueError for a word whose tokens fall outside the vocabulary.
        """
        words: list[list[int]] = []
        for word in bad_words:
            bare = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise RequestValidationError(f"bad word {word!r} tokenizes to no tokens")
            words.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                words.append(spaced)
            for ids in words[-2:]:
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestValidationError(f"bad word {word!r} has token id {bad[0]} outside the "
                                     f"vocabulary [0, {self.vocab_size})")
        return words

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestValidationError("the prompt is empty; give at least one character or token")
        if len(ids) >= self.max_model_len:
            raise RequestValidationError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "and at least one token must be generated; shorten the prompt or raise "
                "max_model_len"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestValidationError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is None:
                continue
            asked = self.vocab_size if value == -1 else value
            if asked > limit:
                what = f"{name}=-1 (the whole vocabulary, {self.vocab_size})" if value == -1 \
                    else f"{name}={value}"
                raise RequestValidationError(
                    f"{what} exceeds max_logprobs={self.max_logprobs}; ask for fewer or "
                    "raise max_logprobs (-1: no limit)"
                )
        if params.structured_outputs is not None:
            from flowengine.structured_outputs.validate import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs,
                                        self.structured_outputs_backend)
        # stop_token_ids too, as vLLM (SamplingParams._validate_stop_token_ids): an id
        # outside the vocabulary can never be sampled, so it could never stop anything.
        for name in ("allowed_token_ids", "logit_bias", "stop_token_ids"):
            value = getattr(params, name)
            bad = [t for t in (value or ()) if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestFieldError(
                    f"{name} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})",
                    name,
                )

    def check_allowed_token_ids(self, params: SamplingParams) -> None:
        """Raise ValueError when allowed_token_ids leaves nothing to sample: every
        allowed id is a one-token bad word, or, with min_tokens > 0, every remaining one
        ends the request (EOS, a stop token id), which min_tokens suppresses. Every
        logit would be -inf, and the sampler would emit token 0, outside the allowed
        set. (A structured-output grammar that rules out the rest is caught in the
        engine: the request then finishes with an error.)"""
        if params.allowed_token_ids is None:
            return
        banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        left = set(params.allowed_token_ids) - banned
        if not left:
            raise RequestValidationError("allowed_token_ids leaves no token to sample: bad_words bans "
                             "every one of them; allow more ids or drop those bad words")
        if params.min_tokens > 0:
            ends = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                ends.update(t for t in (self.eos_token_id, *self.extra_eos_token_ids)
                            if t is not None)
            if not left - ends:
                raise RequestValidationError(
                    f"min_tokens={params.min_tokens} suppresses EOS and the stop token ids, "
                    "but allowed_token_ids allows nothing else (bad_words aside); allow "
                    "more ids or drop min_tokens")

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Params of sample `index`: seeded samples get seed + index so they differ."""
        changes: dict[str, Any] = {"n": 1}
        if index > 0 and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None  # sample 0 computes them for all n
        if params.seed is not None and params.n > 1:
            changes["seed"] = params.seed + index
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = list(params.stop_token_ids or [])
            changes["stop_token_ids"] = stop_ids + [
                t for t in self.extra_eos_token_ids if t not in stop_ids
            ]
        return params.clone(**changes)
