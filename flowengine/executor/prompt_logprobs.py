"""Prompt logprobs: the log-probability of every prompt token after the first, computed
from the hidden states of the prompt positions a step runs (vLLM's `prompt_logprobs`).

Only requests that ask pay: their prompt rows go through the LM head and a
log_softmax; every other request keeps computing the logits of its last position only.
A prompt prefilled in chunks collects its rows chunk by chunk in the executor's
`RequestState`; the whole list travels with the request's first sampled token. The
scheduler never serves such a request from the prefix cache (cached positions have no
hidden states), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flowengine.messages import TokenLogprobs


def prompt_logprob_rows(
    num_computed_tokens: int, num_scheduled: int, num_prompt_tokens: int
) -> range:
    """Positions p of this step whose next token p + 1 is a prompt token: the hidden
    state at p scores token p + 1. Empty for decode steps."""
    return range(num_computed_tokens, min(num_computed_tokens + num_scheduled, num_prompt_tokens - 1))


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    rows: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
) -> list[TokenLogprobs] | None:
    """TokenLogprobs of `targets` given the hidden states at `rows`.

    hidden: [T, hidden_size] model dtype; rows: [P] int64 indices into it; targets: [P]
    int64 the prompt tokens that follow those positions. num_top: top logprobs per
    position (the vocabulary size for -1). Returns None where `compute_logits` returns
    None (tensor-parallel ranks other than 0). Logprobs are log_softmax of the float32
    logits (vLLM's raw logprobs); rank = 1 + tokens strictly more likely.
    """
    logits = compute_logits(hidden.index_select(0, rows))
    if logits is None:
        return None
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    num_top = min(num_top, logprobs.shape[1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    # One transfer per tensor; these rows are few next to the step's decode work.
    top_ids_l, top_values_l = top_ids.tolist(), top_values.tolist()
    chosen_l, ranks_l = chosen.squeeze(1).tolist(), ranks.tolist()
    return [
        TokenLogprobs(top_token_ids=i, top_logprobs=v, sampled_logprob=c, sampled_rank=r)
        for i, v, c, r in zip(top_ids_l, top_values_l, chosen_l, ranks_l, strict=True)
    ]
