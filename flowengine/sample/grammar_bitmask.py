"""Applying a step's structured-output token bitmask to its logits, on the device.

The scheduler fills the bitmask of the step's constrained rows on the CPU
(flowengine/structured_outputs/manager.py) and it travels in the `StepPlan` as bytes:
`[K, W]` int32 little-endian, W = ceil(vocab_size / 32), bit `t % 32` of word
`t // 32` set when token t is allowed (xgrammar's and vLLM's layout). The executor
copies it to the device once per step and, before the sampler runs (greedy, random and
logprobs alike: vLLM v1 also masks the logits before its sampler computes logprobs),
sets the disallowed logits to -inf. No host sync: the row indices come from the plan.
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def bitmask_to_device(data: bytes, num_rows: int, device: torch.device) -> torch.Tensor:
    """The plan's bitmask bytes as a `[num_rows, W]` int32 tensor on `device` (one
    host-to-device copy, non-blocking from pinned memory on CUDA).

    Raises ValueError when the byte count is not num_rows * W * 4 for some W."""
    if num_rows <= 0 or len(data) % (4 * num_rows):
        raise ValueError(f"a grammar bitmask of {len(data)} bytes does not split into "
                         f"{num_rows} rows of int32 words")
    words = torch.frombuffer(bytearray(data), dtype=torch.int32).view(num_rows, -1)
    if device.type == "cpu":
        return words
    host = torch.empty(words.shape, dtype=torch.int32, pin_memory=True)
    host.copy_(words)
    return host.to(device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor) -> None:
    """Set `logits[rows[k], t] = -inf` for every token t not allowed by `bitmask[k]`.

    logits: [R, V] float, modified in place. bitmask: [K, W] int32 on the same device,
    W * 32 >= V (bits past V are ignored; tokens past W * 32 are disallowed).
    rows: [K] int64, distinct row indices into logits.
    """
    num_rows, num_words = bitmask.shape
    vocab_size = logits.shape[1]
    bits = (bitmask.unsqueeze(-1) >> _shifts(logits.device)) & 1  # [K, W, 32]
    allowed = bits.view(num_rows, num_words * 32).bool()
    if num_words * 32 >= vocab_size:
        allowed = allowed[:, :vocab_size]
    else:
        pad = torch.zeros(num_rows, vocab_size - num_words * 32, dtype=torch.bool,
                          device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


@torch.inference_mode()  # logits are inference tensors (the forward ran in that mode)
def apply_plan_bitmask(logits: torch.Tensor, sample_req_ids: list[str],
                       structured_req_ids: list[str], data: bytes) -> None:
    """Apply a plan's bitmask (`StepPlan.grammar_bitmask`, one row per id of
    `structured_req_ids`) to the logits rows of `sample_req_ids` (the step's sampling
    rows, in order). Ids that do not sample in this step are skipped. A no-op when the
    plan has no constrained rows."""
    if not structured_req_ids:
        return
    index = {rid: i for i, rid in enumerate(sample_req_ids)}
    pairs = [(k, index[rid]) for k, rid in enumerate(structured_req_ids) if rid in index]
    if not pairs:
        return
    bitmask = bitmask_to_device(data, len(structured_req_ids), logits.device)
    mask_rows = [k for k, _ in pairs]
    if len(mask_rows) != len(structured_req_ids):
        bitmask = bitmask[torch.tensor(mask_rows, dtype=torch.int64, device=logits.device)]
    rows = torch.tensor([r for _, r in pairs], dtype=torch.int64,
                        pin_memory=logits.device.type == "cuda")
    apply_token_bitmask(logits, bitmask, rows.to(logits.device, non_blocking=True))
