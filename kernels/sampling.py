"""Sampling kernels: a grammar bitmask applied in place, and the exponential race in one
kernel per step.

`apply_token_bitmask_(logits, bitmask, rows)`: `logits[rows[k], t] = -inf` for every
token t whose bit is clear in `bitmask[k]` (bit `t % 32` of int32 word `t // 32`,
xgrammar's and vLLM's layout; tokens past the mask's words are disallowed). One program
per (mask row, vocabulary block); the torch version needs ~8 ops and a [K, W, 32]
intermediate.

`exponential_race(logits, keys, inv_temperature, greedy)`: per row the token
    argmax_t  logits[r, t] * inv_temperature[r] - log(-log(U(keys[r], t)))
(greedy rows: argmax_t logits[r, t]), the Gumbel-max form of the sampler's exponential
race argmax_t softmax(l / T)_t / q_t with q = -log(U) ~ Exp(1): the same draw without
the softmax. U(key, t) is splitmix64's output function (Steele, Lea and Flood, OOPSLA
2014) of the counter `key + (t + 1) * 0x9E3779B97F4A7C15` mod 2**64, top 24 bits
(flowengine/sample/sampler.py `seeded_exponential` computes the same U in torch).
One program per row walks the vocabulary twice in blocks: first for the row's largest
l / T, then for the race, whose scores are taken from that maximum (l / T - max, as
the softmax of the torch path and the CPU's C sampler do), so float32 keeps the
logits' precision at any temperature (l / T of 5e6 would round a score to 1/4 nat and
give ties to the lowest index). It keeps the first index of the largest score
(torch.argmax's tie rule). U = 0 (q = inf, probability 2**-24 per token) gives the
lowest finite score, so such a token loses to every other kept token but still wins
when it is the only one. -inf logits (masked tokens) are never drawn unless the whole
row is -inf (then token 0, as torch.argmax of a row of -inf gives); NaN never.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .validation import FLOAT_DTYPES, check_tensor

BLOCK_V = 2048


@triton.jit
def _bitmask_kernel(
    logits_ptr,  # [R, V] float
    logits_stride: tl.int64,
    bitmask_ptr,  # [K, W] int32
    bitmask_stride: tl.int64,
    rows_ptr,  # [K] int64: the logits row of mask row k
    V,
    W,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tok < V
    word_idx = tok // 32
    words = tl.load(bitmask_ptr + k * bitmask_stride + word_idx,
                    mask=in_vocab & (word_idx < W), other=0)
    disallowed = ((words >> (tok % 32).to(tl.int32)) & 1) == 0
    row = tl.load(rows_ptr + k)
    ptrs = logits_ptr + tl.maximum(row, 0) * logits_stride + tok
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(ptrs, neg_inf, mask=in_vocab & disallowed & (tok * 0 + row >= 0))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor) -> None:
    """Set `logits[rows[k], t] = -inf` where bit t of `bitmask[k]` is clear (in place).

    logits: [R, V] float32/float16/bfloat16, unit last stride; bitmask: [K, W] int32;
    rows: [K] int64 distinct row indices, -1 for a mask row to skip; one device.
    Raises ValueError for other shapes, dtypes or devices.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), device=logits.device)
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} entries for {bitmask.shape[0]} mask rows")
    num_rows, vocab = bitmask.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, BLOCK_V))
    _bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab,
                          bitmask.shape[1], BLOCK=BLOCK_V)


@triton.jit
def _race_kernel(
    out_ptr,  # [R] int64
    logits_ptr,  # [R, V] float
    logits_stride: tl.int64,
    keys_ptr,  # [R] int64
    inv_temp_ptr,  # [R] float32 (read when HAS_TEMP)
    greedy_ptr,  # [R] bool as int8 (read when HAS_GREEDY)
    V,
    HAS_TEMP: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + r).to(tl.uint64, bitcast=True)
    inv_t = tl.load(inv_temp_ptr + r) if HAS_TEMP else 1.0
    noisy = 1.0
    if HAS_GREEDY:
        noisy = tl.where(tl.load(greedy_ptr + r) != 0, 0.0, 1.0)
    # Pass 1 (sampled rows): the row's largest l / T, NaN aside.
    mx = tl.full([1], float("-inf"), tl.float32)
    if noisy > 0:
        for start in range(0, V, BLOCK):
            tok = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(logits_ptr + r * logits_stride + tok, mask=tok < V,
                        other=float("-inf")).to(tl.float32) * inv_t
            mx = tl.maximum(mx, tl.max(tl.where(x == x, x, float("-inf")), axis=0))
    best = tl.full([1], float("-inf"), tl.float32)
    best_idx = tl.zeros([1], tl.int64)
    # splitmix64's constants, built from their int64 bit patterns (Triton's literals
    # are signed): 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB.
    gamma = tl.full([1], -7046029254386353131, tl.int64).to(tl.uint64, bitcast=True)
    mix1 = tl.full([1], -4658895280553007687, tl.int64).to(tl.uint64, bitcast=True)
    mix2 = tl.full([1], -7723592293110705685, tl.int64).to(tl.uint64, bitcast=True)
    for start in range(0, V, BLOCK):
        tok = start + tl.arange(0, BLOCK).to(tl.int64)
        live = tok < V
        x = tl.load(logits_ptr + r * logits_stride + tok, mask=live,
                    other=float("-inf")).to(tl.float32)
        z = key + (tok + 1).to(tl.uint64) * gamma
        z = (z ^ (z >> 30)) * mix1
        z = (z ^ (z >> 27)) * mix2
        z = z ^ (z >> 31)
        u = (z >> 40).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        safe_u = tl.where(u > 0, u, 0.5)
        race = tl.where(u > 0, (x * inv_t - mx) - tl.log(-tl.log(safe_u)),
                        -3.4028234663852886e38)  # U = 0: float32's lowest finite value
        kept = live & (x == x) & (x > float("-inf"))  # NaN and masked tokens: never
        score = tl.where(kept, tl.where(noisy > 0, race, x), float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64) + start
        better = block_best > best
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + r + tl.arange(0, 1), best_idx)


def exponential_race(logits: torch.Tensor, keys: torch.Tensor,
                     inv_temperature: torch.Tensor | None = None,
                     greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row by the exponential race (module docstring): `[R]` int64.

    logits: [R, V] float32/float16/bfloat16 (unit last stride; masked tokens -inf);
    keys: [R] int64, each row's noise key (a step seed, or a fresh random value);
    inv_temperature: [R] float32, None for 1; greedy: [R] bool, rows that take the
    argmax (their key and temperature are ignored), None for none.
    Raises ValueError for other shapes, dtypes or devices.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    device = logits.device
    check_tensor("keys", keys, ndim=1, dtypes=(torch.int64,), device=device)
    num_rows, vocab = logits.shape
    if keys.shape[0] != num_rows:
        raise ValueError(f"keys has {keys.shape[0]} entries for {num_rows} rows")
    for name, t, dtype in (("inv_temperature", inv_temperature, torch.float32),
                           ("greedy", greedy, torch.bool)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(dtype,), device=device)
            if t.shape[0] != num_rows:
                raise ValueError(f"{name} has {t.shape[0]} entries for {num_rows} rows")
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    _race_kernel[(num_rows,)](
        out, logits, logits.stride(0), keys,
        keys if inv_temperature is None else inv_temperature,
        keys if greedy is None else greedy.view(torch.int8),
        vocab, HAS_TEMP=inv_temperature is not None, HAS_GREEDY=greedy is not None,
        BLOCK=BLOCK_V)
    return out
