"""Messages between actors, grouped by the channel they travel on (DESIGN.md §2).

Every message is a `msgspec.Struct` (array_like, omit_defaults, gc=False) so it can
cross a shared-memory ring with msgspec's msgpack codec; nothing here may need pickle.
"""

from __future__ import annotations

import msgspec

from flowengine.sampling_params import SamplingParams


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


# ---------------------------------------------------------------- channel "requests"
class NewRequest(_Msg, tag=True):
    """A tokenized request entering the engine (frontend -> scheduler)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    # Tokens already delivered to the caller before an engine restart (recompute).
    output_token_ids: list[int] = []
    cache_salt: str | None = None


class AbortRequest(_Msg, tag=True):
    """Stop a request: the caller went away or a stop string matched."""

    request_ids: list[str]


class Shutdown(_Msg, tag=True):
    """Drain and stop: the engine finishes the requests it holds, then exits.

    It carries no timeout: the frontend bounds the drain (`AsyncEngine.shutdown`'s
    `drain_timeout_s`) and stops the engine itself when the time is up.
    """


class ClientStart(_Msg, tag=True):
    """First message of an extra API server process (`--api-server-count` > 1) on its
    own requests ring: the engine aborts what an earlier process of the same index
    left running (flowengine/engine/client_router.py)."""


RequestsMsg = NewRequest | AbortRequest | Shutdown | ClientStart


# ---------------------------------------------------------------- channel "steps"
class NewRequestData(_Msg):
    """A request the executor has not seen (or that resumes after preemption), in full.

    token_ids: prompt followed by the outputs generated so far (recompute after
    preemption); num_prompt_tokens splits them. block_ids: its whole block table.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None


class CachedRequestData(_Msg):
    """A request the executor already holds: only what changed since the last step.

    draft_token_ids: speculative decoding (flowengine/spec_decode): tokens proposed to
    follow the request's last known token; the step computes that token and these
    drafts (num_scheduled_tokens = 1 + len(draft_token_ids)), verifies them and
    returns the accepted ones plus one token sampled after them (vLLM's
    `scheduled_spec_decode_tokens`).
    new_token_ids: pipeline parallelism (vLLM's `new_token_ids` of the same struct):
    the request's tokens at positions max(num_computed_tokens, num_prompt_tokens) up
    to the end of this step's tokens, i.e. the output tokens it computes, which the
    last stage sampled and the other stages never saw; empty otherwise.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    draft_token_ids: list[int] = []
    new_token_ids: list[int] = []


class StepPlan(_Msg, tag=True):
    """What to compute in one step (scheduler -> executors, broadcast).

    num_scheduled_tokens[i] belongs to the i-th request of new_reqs + cached_reqs, in
    that order. finished_req_ids: requests whose executor state can be dropped.

    Executor contract (DESIGN.md §2, §5): executors run plans one at a time, in step_id
    order, and for each plan
      1. drop the requests of finished_req_ids (ignoring ids they do not hold);
      2. add new_reqs (token_ids in full) and extend each cached request's block table
         with new_block_ids; a plan's num_computed_tokens equals the executor's count;
      3. compute token_ids[num_computed_tokens : num_computed_tokens + n] of each
         request (n its num_scheduled_tokens) into the KV slots of its block table;
      4. for a request whose computed tokens now reach the end of the executor's copy of
         its token_ids, sample one token, return it in the StepResult, and append it to
         that copy before the next plan runs (a partial prefill chunk samples nothing).
    With async scheduling the scheduler plans step N+1 before step N's result arrives,
    so n may cover index num_computed_tokens that only the executor holds: the token it
    sampled and appended in step N, which never travels back through the scheduler.
    A token sampled for a request that finished in the meantime is dropped by the
    scheduler, and the request comes in a later plan's finished_req_ids.

    Speculative decoding: a cached request with draft_token_ids appends them to its
    token_ids before step 3 (n = 1 + k), samples each of its 1 + k last rows, returns
    the accepted drafts plus one token, and rolls back: token_ids end with those,
    num_computed_tokens drops by the rejected count, and block-table entries past
    ceil(num_computed_tokens / block_size) are dropped (the scheduler frees the same
    blocks; flowengine/executor/spec_verify.py, flowengine/core/spec_tokens.py).

    Structured outputs: structured_output_req_ids are the constrained requests that
    sample in this step and grammar_bitmask their next-token masks, one row each in
    that order: [len(structured_output_req_ids), ceil(vocab_size / 32)] int32
    little-endian (flowengine/sample/grammar_bitmask.py), applied to their logits
    before sampling. Each row is filled from a matcher that has accepted every earlier
    token of its request. With async scheduling a constrained request may sample on a
    placeholder token (the one an earlier in-flight step samples), whose mask cannot
    be known yet: the plan then has pending_structured_output_tokens set (vLLM's
    name) and no bitmask, and its `GrammarOutput` follows on the same channel once
    the earlier steps' results were applied, before any later plan. An executor
    launches such a plan's forward at once and samples it only with its GrammarOutput.
    """

    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: list[int]
    finished_req_ids: list[str] = []
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    pending_structured_output_tokens: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def scheduled_req_ids(self) -> list[str]:
        return [r.req_id for r in self.new_reqs] + [r.req_id for r in self.cached_reqs]


class GrammarOutput(_Msg, tag=True):
    """The grammar bitmask of a plan sent with pending_structured_output_tokens
    (scheduler -> executors, broadcast; vLLM's GrammarOutput): the fields of
    StepPlan's bitmask, filled once the tokens the plan's constrained requests sample
    before it were accepted. Rows of requests that finished meanwhile are absent
    (their token in that step is dropped by the scheduler). Sent exactly once per such
    plan, after it and before any later plan, once the results of the steps before it
    were applied."""

    step_id: int
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes = b""


StepsMsg = StepPlan | GrammarOutput | Shutdown


# ---------------------------------------------------------------- channel "results"
class TokenLogprobs(_Msg):
    """Log-probabilities of one sampled token: top-N ids/values, the sampled token's."""

    top_token_ids: list[int]
    top_logprobs: list[float]
    sampled_logprob: float
    sampled_rank: int  # 1 = most likely


class SampledTokens(_Msg):
    """Tokens sampled for one request; with its first token, the logprobs of prompt
    tokens 1.. when the request asked for prompt_logprobs."""

    req_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Pooling runner: the request's pooled vector instead of a token (token_ids empty),
    # float32 little-endian bytes [hidden_size], before normalisation.
    pooled: bytes | None = None
    # Speculative decoding with a draft model: the draft tokens it proposes to follow
    # token_ids (the scheduler may schedule them in the request's next step).
    draft_token_ids: list[int] = []


class StepResult(_Msg, tag=True):
    """Sampled tokens of one step (executor rank 0 -> scheduler), or an error."""

    step_id: int
    sampled: list[SampledTokens]
    error: str | None = None
    # Another record of this step follows: a result larger than a record of the results
    # ring goes in parts, each with some of `sampled` (`split_step_result`), and the
    # receiver joins them in order (`join_step_result`).
    more: bool = False


def split_step_result(result: StepResult, max_bytes: int) -> list[StepResult] | None:
    """`result` cut into parts of at most `max_bytes` encoded bytes each (msgpack),
    every part but the last with `more=True`, `sampled` kept in order; None when one
    request's SampledTokens alone does not fit (e.g. prompt_logprobs=-1 over a long
    prefill chunk).

    A part holds whole SampledTokens; 64 bytes of each part are kept for the
    StepResult's own fields around them."""
    budget = max_bytes - 64
    parts: list[list[SampledTokens]] = [[]]
    used = 0
    for sampled in result.sampled:
        n = len(msgspec.msgpack.encode(sampled))
        if n > budget:
            return None
        if used + n > budget and parts[-1]:
            parts.append([])
            used = 0
        parts[-1].append(sampled)
        used += n
    last = len(parts) - 1
    return [StepResult(result.step_id, part, error=result.error if i == last else None,
                       more=i < last) for i, part in enumerate(parts)]


def join_step_result(first: StepResult, rest: list[StepResult]) -> StepResult:
    """One StepResult from the parts `split_step_result` made (`first` then `rest`).

    Raises RuntimeError if a part belongs to another step."""
    sampled = list(first.sampled)
    error = first.error
    for part in rest:
        if part.step_id != first.step_id:
            raise RuntimeError(f"part of step {part.step_id} arrived within step "
                               f"{first.step_id}'s result")
        sampled.extend(part.sampled)
        error = error or part.error
    return StepResult(first.step_id, sampled, error=error)


# ---------------------------------------------------------------- channel "outputs"
# A request's error that the request itself caused, found in the engine (its
# constraints leave no token to sample): RequestDelta.error (and so RequestOutput.error)
# starts with this, and the servers answer it as invalid input (HTTP 400, gRPC
# INVALID_ARGUMENT), not as an engine failure (500, INTERNAL).
REQUEST_ERROR_PREFIX = "invalid request: "


def is_request_error(error: str | None) -> bool:
    """Whether `error` (a RequestOutput's) is the request's own fault (see above)."""
    return error is not None and error.startswith(REQUEST_ERROR_PREFIX)


class RequestDelta(_Msg):
    """New tokens of one request since the last output (scheduler -> frontend)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # Logprobs of prompt tokens 1.. (prompt_logprobs), with the first token only.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # time.monotonic() when first scheduled; on the first delta with tokens only.
    scheduled_ts: float = 0.0
    # Pooling runner: the pooled vector (SampledTokens.pooled), with finish_reason "stop".
    pooled: bytes | None = None


class SchedulerStats(_Msg):
    """Scheduler counters for /metrics; totals since start, usage a fraction in [0, 1]."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Speculative decoding (vLLM's spec_decode counters): drafts proposed (requests
    # x steps with at least one draft token), draft tokens, accepted draft tokens, and
    # accepted tokens by draft position (index 0 = first draft token).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class EngineOutputs(_Msg):
    """Deltas of one engine step. `generation` counts engine restarts: the frontend
    drops outputs of an engine generation it has already replaced."""

    outputs: list[RequestDelta]
    timestamp: float = 0.0
    stats: SchedulerStats | None = None
    generation: int = 0


# ---------------------------------------------------------------- executor handshake
class ExecutorReady(_Msg, tag=True):
    """First message of executor rank 0 on "results": the KV cache it allocated."""

    num_kv_blocks: int
    rank: int = 0


ResultsMsg = StepResult | ExecutorReady
