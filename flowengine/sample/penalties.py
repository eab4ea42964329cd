"""Logit penalties, min_tokens / bad_words / allowed_token_ids masking and logit_bias, batched, in place on `[R, V]` float32 logits.

All functions run on the logits' device with no host synchronisation; token lists
arrive as padded id tensors (pad id = V) so one scatter builds every row's counts.
"""

from __future__ import annotations

import torch


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set `logits[rows[m], token_ids[m]] = -inf` for every m (EOS / stop ids of rows
    that have not reached min_tokens yet, vLLM's `MinTokensLogitsProcessor`).

    logits: [R, V] float32, modified in place. rows, token_ids: [M] int64.
    """
    # new_full fills on the device; torch.tensor(-inf, device=cuda) would copy from the host.
    logits.index_put_((rows, token_ids), logits.new_full((1,), float("-inf")))


def ban_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set `logits[rows[m], token_ids[m]] = -inf` for every m (bad words, vLLM's
    `apply_bad_words`). logits: [R, V] float32, in place. rows, token_ids: [M] int64."""
    logits.index_put_((rows, token_ids), logits.new_full((1,), float("-inf")))


def apply_allowed_token_ids(
    logits: torch.Tensor, rows: torch.Tensor, pair_rows: torch.Tensor, pair_ids: torch.Tensor
) -> None:
    """In each row of `rows`, set every logit to -inf except those of its allowed ids.

    logits: [R, V] float32, in place. rows: [A] int64; pair_rows / pair_ids: [P] int64,
    the (row, allowed id) pairs. Built as one [R, V] bool mask on the device.
    """
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[rows] = True
    banned.index_put_((pair_rows, pair_ids), banned.new_zeros((1,)))
    logits.masked_fill_(banned, float("-inf"))


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> None:
    """`logits[rows[k], token_ids[k]] += values[k]` (OpenAI's logit_bias: added to the
    logits before sampling). logits: [R, V] float32, in place; rows, token_ids: [K]
    int64, values: [K] float32 (each (row, id) pair at most once)."""
    logits.index_put_((rows, token_ids), values, accumulate=True)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each vocabulary id per row.

    token_ids: [R, T] int64 padded with `vocab_size`. Returns [R, vocab_size] float32.
    """
    num_reqs = token_ids.shape[0]
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    presence_penalties: torch.Tensor | None,
) -> None:
    """Apply repetition, then frequency and presence penalties in place (vLLM's order).

    - Repetition penalty (Keskar et al. 2019, "CTRL", as Hugging Face's
      `RepetitionPenaltyLogitsProcessor` applies it): for every id seen in the prompt
      or the output, a logit < 0 is multiplied by the penalty, any other divided by it.
    - Frequency and presence penalties (OpenAI API reference, "Parameter details"):
      `logit -= frequency * count + presence * (count > 0)` with counts over the
      generated tokens only.

    logits: [R, V] float32, modified in place. prompt_token_ids [R, P] and
    output_token_ids [R, O]: int64 padded with V. Penalties: [R] float32 or None
    (stage skipped). prompt_token_ids may be None only if repetition_penalties is.
    """
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)
    if repetition_penalties is not None:
        if prompt_token_ids is None:
            raise ValueError("repetition penalty needs prompt_token_ids; pass the padded prompt")
        seen = token_counts(prompt_token_ids, vocab_size) > 0
        seen |= output_counts > 0
        penalty = repetition_penalties.unsqueeze(1).expand_as(logits)
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        torch.where(seen, penalized, logits, out=logits)
    if frequency_penalties is not None:
        logits -= frequency_penalties.unsqueeze(1) * output_counts
    if presence_penalties is not None:
        logits -= presence_penalties.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
