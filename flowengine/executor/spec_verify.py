"""Verification of draft tokens in the executor (speculative decoding).

A request scheduled with k draft tokens d_1..d_k computes its last known token and
the drafts in one forward (the attention backends take several query tokens per
request), which gives k + 1 next-token distributions p_0..p_k: p_j follows the known
tokens plus d_1..d_j. Each row j is sampled exactly as the non-speculative engine
would sample the token after that prefix: the row's `SamplingState` holds the output
so far plus d_1..d_j, so penalties, min_tokens, bad words, logit bias, logprobs and a
per-request seed (`step_seed(seed, output index)`) all see the same history. Then

    accepted = d_1..d_a, with a the longest prefix where t_j == d_{j+1} (t_j the row-j
    token), followed by the bonus token t_a.

For greedy rows this is the longest matching prefix plus the target's next token. For
random rows it is speculative sampling with a point-mass draft: Leviathan et al.
(2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1) /
Chen et al. (2023) accept a draft x with probability min(1, p(x) / q(x)) and on a
rejection resample from norm(max(0, p - q)); with q = one-hot(x), as for the n-gram
proposer, that is "accept with probability p(x), else draw from p restricted to the
other tokens", which is exactly the law of one draw t ~ p compared with x. So every
emitted token has the target distribution, and a seeded request emits the very tokens
it emits without speculation (each row's draw uses its own position's seed).

Rows of requests without drafts are sampled once, as always.
"""

from __future__ import annotations

import torch

from flowengine.executor.input_batch import RequestState, StepInputs
from flowengine.messages import TokenLogprobs
from flowengine.sample.metadata import SamplingState


def verification_rows(states: list[RequestState], inputs: StepInputs
                      ) -> tuple[torch.Tensor, list[list[int]] | None]:
    """The hidden-state rows to compute logits for, and each sampling request's drafts.

    Returns (inputs.logits_indices, None) when no sampling request carries drafts;
    else ([sum over sampling requests of 1 + k_i] int64 on the device: the k_i + 1 last
    rows of request i, in batch order, one row for a request without drafts) and the
    drafts of each request of `inputs.sample_req_ids` (empty lists for none).
    `states` are the step's states in batch order, drafts still appended to token_ids.
    """
    sample_ids = inputs.sample_req_ids
    if not any(s.num_draft_tokens for s in states):
        return inputs.logits_indices, None
    qsl = inputs.attn_metadata.query_start_loc_cpu
    rows: list[int] = []
    drafts: list[list[int]] = []
    j = 0
    for i, state in enumerate(states):
        if j == len(sample_ids) or state.req_id != sample_ids[j]:
            continue  # a partial prefill chunk: no sampling row
        j += 1
        end = int(qsl[i + 1])
        k = state.num_draft_tokens
        rows.extend(range(end - 1 - k, end))
        drafts.append(state.token_ids[len(state.token_ids) - k:] if k else [])
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=inputs.input_ids.is_cuda)
    return index.to(inputs.input_ids.device, non_blocking=True), drafts


def row_states(state: RequestState, drafts: list[int]) -> list[SamplingState]:
    """The sampler's states of one request's 1 + len(drafts) verification rows: row j
    follows its output so far plus drafts[:j] (token_ids still end with the drafts)."""
    params = state.sampling_params
    prompt = state.token_ids[:state.num_prompt_tokens] if params.repetition_penalty != 1.0 else []
    end = len(state.token_ids) - len(drafts)
    output = state.token_ids[state.num_prompt_tokens:end]
    return [SamplingState(params, prompt, output + drafts[:j], state.eos_token_id)
            for j in range(len(drafts) + 1)]


def accept(drafts: list[int], row_tokens: list[int],
           row_logprobs: list[TokenLogprobs | None]
           ) -> tuple[list[int], list[TokenLogprobs] | None]:
    """The tokens a request emits: drafts while each equals its row's token, then the
    first differing row's token (or the bonus row's). Returns (tokens, their logprobs
    or None)."""
    a = 0
    while a < len(drafts) and row_tokens[a] == drafts[a]:
        a += 1
    tokens = row_tokens[:a + 1]
    logprobs = row_logprobs[:a + 1]
    return tokens, None if logprobs[0] is None else logprobs  # type: ignore[return-value]
