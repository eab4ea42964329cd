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

import numpy as np
import torch

from flowengine.sample import sampler
from flowengine.sample.metadata import to_device

_SHIFTS: dict[torch.device, torch.Tensor] = {}
# Pinned host buffers for the bitmask's host-to-device copy, reused round robin per
# device; each with the event of its last copy (a buffer is rewritten only once the
# copy out of it is done). Three: up to two steps are in flight.
_NUM_STAGING = 3
_STAGING: dict[torch.device, list[list]] = {}
_STAGING_NEXT: dict[torch.device, int] = {}


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
    if device.type == "cpu":
        return torch.frombuffer(bytearray(data), dtype=torch.int32).view(num_rows, -1)
    host = _staging_buffer(device, len(data))
    host.numpy()[:] = np.frombuffer(data, dtype=np.uint8)  # the one host copy
    words = host.view(torch.int32).view(num_rows, -1).to(device, non_blocking=True)
    _record_copy(device)
    return words


def _staging_buffer(device: torch.device, num_bytes: int) -> torch.Tensor:
    """The next pinned staging buffer of `device` as [num_bytes] uint8, once the copy
    last made from it is done (grown to fit)."""
    ring = _STAGING.setdefault(device, [[None, None] for _ in range(_NUM_STAGING)])
    index = _STAGING_NEXT.get(device, 0)
    entry = ring[index]
    if entry[1] is not None:
        entry[1].synchronize()  # normally long done: the copy of two steps ago
    if entry[0] is None or entry[0].numel() < num_bytes:
        entry[0] = torch.empty(max(num_bytes, 2 * (0 if entry[0] is None else entry[0].numel())),
                               dtype=torch.uint8, pin_memory=True)
    return entry[0][:num_bytes]


def _record_copy(device: torch.device) -> None:
    index = _STAGING_NEXT.get(device, 0)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _STAGING[device][index][1] = event
    _STAGING_NEXT[device] = (index + 1) % _NUM_STAGING


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None) -> None:
    """Set `logits[rows[k], t] = -inf` for every token t not allowed by `bitmask[k]`.

    logits: [R, V] float, modified in place. bitmask: [K, W] int32 on the same device,
    W * 32 >= V (bits past V are ignored; tokens past W * 32 are disallowed).
    rows: [K] int64, distinct row indices into logits; None: row k is logits row k,
    K = R (no gather).
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
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


# Logits dtypes numpy shares memory with (bfloat16 has none: the torch path serves it).
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


def apply_plan_bitmask(logits: torch.Tensor, sample_req_ids: list[str],
                       structured_req_ids: list[str], data: bytes) -> None:
    """Apply a plan's bitmask (`StepPlan.grammar_bitmask`, one row per id of
    `structured_req_ids`) to the logits rows of `sample_req_ids` (the step's sampling
    rows, in order). Ids that do not sample in this step are skipped. A no-op when the
    plan has no constrained rows (returning before anything else: every step calls it)."""
    if not structured_req_ids:
        return
    index = {rid: i for i, rid in enumerate(sample_req_ids)}
    pairs = [(k, index[rid]) for k, rid in enumerate(structured_req_ids) if rid in index]
    if not pairs:
        return
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        _apply_on_host(logits, data, len(structured_req_ids), pairs)
    else:
        _apply_on_device(logits, data, len(structured_req_ids), pairs)


_ROWS_IN_ORDER: dict[tuple[torch.device, int], torch.Tensor] = {}


@torch.inference_mode()  # logits are inference tensors (the forward ran in that mode)
def _apply_on_device(logits: torch.Tensor, data: bytes, num_rows: int,
                     pairs: list[tuple[int, int]]) -> None:
    bitmask = bitmask_to_device(data, num_rows, logits.device)
    kernels = (sampler.fused_kernels()
               if logits.device.type == "cuda" and sampler.FUSED_SAMPLING else None)
    if kernels is not None:
        # One Triton kernel (kernels/sampling.py) instead of ~8 torch ops: each op costs
        # ~10-15 us of host time on the H200's host (session 32), and at batch 128 the
        # mask is on the path the next step's sampling waits for.
        device = logits.device
        if len(pairs) == num_rows and all(k == r for k, r in pairs):
            rows = _ROWS_IN_ORDER.get((device, num_rows))
            if rows is None:
                rows = _ROWS_IN_ORDER[(device, num_rows)] = torch.arange(
                    num_rows, dtype=torch.int64, device=device)
        else:
            table = [-1] * num_rows
            for k, r in pairs:
                table[k] = r
            rows = to_device(table, torch.int64, device)
        kernels.apply_token_bitmask_(logits, bitmask, rows)
        return
    mask_rows = [k for k, _ in pairs]
    if len(mask_rows) != num_rows:
        bitmask = bitmask[torch.tensor(mask_rows, dtype=torch.int64, device=logits.device)]
    if len(pairs) == logits.shape[0] and all(k == r for k, r in pairs):
        apply_token_bitmask(logits, bitmask, None)  # every row constrained, in order
        return
    apply_token_bitmask(logits, bitmask,
                        to_device([r for _, r in pairs], torch.int64, logits.device))


def _apply_on_host(logits: torch.Tensor, data: bytes, num_rows: int,
                   pairs: list[tuple[int, int]]) -> None:
    """`apply_plan_bitmask` for float32/float16/float64 logits on the CPU: float32 rows
    by the C loop `flowengine._cpu_ops.apply_token_bitmask` (masked stores per 32-token
    word, 7 us per 49k-token row), the others in numpy: the words unpacked (one
    pass, no [K, W, 32] int32 intermediate) into the disallowed mask, then -inf written
    where it is set, single-threaded. torch's element-wise ops over a 49k-token row go
    to its intra-op threads, and on a loaded machine a wake-up of those can wait for a
    time slice: measured at batch 1 on the 2-core CPU, masked_fill_ 0.03 ms median but
    12 ms at the 90th percentile, numpy 0.028 / 0.038 ms (32 rows: 12.0 / 2.15 ms)."""
    if num_rows <= 0 or len(data) % (4 * num_rows):
        raise ValueError(f"a grammar bitmask of {len(data)} bytes does not split into "
                         f"{num_rows} rows of int32 words")
    vocab_size = logits.shape[1]
    ops = sampler.cpu_ops() if logits.dtype == torch.float32 and logits.stride(1) == 1 else None
    if ops is not None:
        # the C loop (flowengine/_cpu_ops.c): ~0.1 ms less per step than numpy at batch 1
        table = np.asarray(pairs, dtype=np.int64)
        ops.apply_token_bitmask(logits.data_ptr(), logits.shape[0], num_rows, vocab_size,
                                logits.stride(0),
                                np.frombuffer(data, dtype=np.uint8).ctypes.data,
                                len(data) // (4 * num_rows), table.ctypes.data, len(pairs))
        return
    words = np.frombuffer(data, dtype=np.uint8).reshape(num_rows, -1)  # little-endian
    mask_rows = [k for k, _ in pairs]
    if len(mask_rows) != num_rows:
        words = words[mask_rows]
    bits = np.unpackbits(words, axis=1, bitorder="little")  # bit t of row = token t
    if bits.shape[1] >= vocab_size:
        disallowed = bits[:, :vocab_size] == 0
    else:  # tokens past the mask's words are disallowed
        disallowed = np.ones((len(mask_rows), vocab_size), dtype=bool)
        disallowed[:, :bits.shape[1]] = bits == 0
    in_order = len(pairs) == logits.shape[0] and all(k == r for k, r in pairs)
    values = logits.numpy()  # shares the tensor's memory
    if in_order:
        np.copyto(values, -np.inf, where=disallowed)
        return
    for k, (_, r) in enumerate(pairs):
        np.copyto(values[r], -np.inf, where=disallowed[k])
