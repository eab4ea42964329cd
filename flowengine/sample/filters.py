"""Truncation of the sampling distribution: top-k, top-p (nucleus) and min-p, batched.

Each row has its own k / p / min_p; rows that do not use a filter hold its neutral
value (k = V, p = 1, min_p = 0), so one pass serves the whole batch with no host sync.
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p sets to -inf, in place.

    Algorithm: vLLM's `apply_top_k_top_p` (one ascending sort per row). Top-k keeps
    every logit >= the k-th largest (ties at the threshold are all kept). Top-p
    (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration") keeps the
    smallest set of most likely tokens whose probability sums to >= p; the most likely
    token is always kept.

    logits: [R, V] float32 (temperature already applied). top_k: [R] int64 in [1, V]
    or None. top_p: [R] float32 in (0, 1] or None. Returns `logits`.
    """
    if top_k is None and top_p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (logits_sort.shape[1] - top_k).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_index)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        cumulative = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        # Ascending order: drop the tail whose total mass stays within 1 - p.
        drop = cumulative <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probability of tokens less likely than `min_p` times the row's most
    likely token, in place (Nguyen et al. 2024, "Min P Sampling"; vLLM's semantics).

    probs: [R, V] float32, need not be normalised. min_p: [R] float32 in [0, 1].
    Returns `probs`.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)
