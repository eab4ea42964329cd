"""Decode GEMVs on CUDA: y = x W^T for M <= 8 rows (decode and small verify batches),
for bf16/fp16 weights, FP8 E4M3 weights with per-output-channel scales (W8A16) and
4-bit GPTQ / AWQ groups (W4A16, canonical layout of kernels/w4a16.py).

At M <= 8 the product is a read of the weights: no `tl.dot` (no padding to 16 rows),
products in fp32 reduced with `tl.sum`. A program owns BLOCK_N output columns and one
of SPLIT_K slices of K. The fp32 partials are added in a fixed order (split 0, 1, ...:
deterministic) by the tile's last program to finish, which also adds the bias, casts and
stores (`_finish_tile`: one launch per GEMV; per-device tile counters that the last
program resets, so CUDA graphs replay it as is); FLOWENGINE_GEMV_FUSED_FINISH=0 goes
back to fp8_linear's split-K reduce kernel as a second launch (the same bits).

- dense / FP8, weight [N, K]: each step loads a [BLOCK_N, BLOCK_K] tile contiguous
  along K (wide loads) and, at M = 1, accumulates w * x elementwise in a
  [BLOCK_N, BLOCK_K] fp32 tile reduced once at the end of the slice; at M > 1 each
  step reduces [BLOCK_M, BLOCK_N, BLOCK_K] products over K. FP8 scales are applied once
  per column at the end.
- W4A16, qweight [K / 8, N] int32: each step loads [BLOCK_K / 8, BLOCK_N] words
  (contiguous along N) and takes nibble i by a shift: rows k0 + 8 r + i. x is gathered
  at those rows ([BLOCK_K / 8] strided loads, cached). Without act-order a step lies in
  one group, so sum_k (q - z) s x = s (sum_k q x - z sum_k x): per-nibble partial sums
  of q x, zeros and scales once per column and step (at M = 1 and BLOCK_N <= 128
  kept per word row and reduced once at the end of the slice). With act-order g_idx each nibble
  row gathers its own group's zeros and scales.

Tile sizes come from a graph-timed sweep per shape (benchmarks/gemv_gpu.py, stored in
kernels/configs/gemv,device_name=*.json with whether the GEMV beat the current path);
`gemv_config` falls back to a heuristic.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from .fp8_linear import _split_k_reduce_kernel
from .validation import FLOAT_DTYPES, check_tensor

GEMV_MAX_M = 8
# The W4A16 group size the tables are swept at (benchmarks/gemv_gpu.py); the layers take
# the table's W4A16 entries for this group size only.
GEMV_W4_GROUP = 128
_REDUCE_BLOCK = 1024
# FLOWENGINE_GEMV_FUSED_FINISH=0: split-K partials reduced by a second launch (_finish), as
# before the in-kernel finish (A/B runs).
_FUSED_FINISH = os.environ.get("FLOWENGINE_GEMV_FUSED_FINISH", "1") != "0"
# Split-K tile counters (one int32 per BLOCK_N tile of a call), per device: zero between
# calls, since the last program of each tile resets its counter. Calls on one device must
# not overlap (the engine runs its forward on one stream): two GEMVs running at once on
# one device would count into the same slots.
_COUNTER_SLOTS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}
_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


@triton.jit
def _finish_tile(acc, part_ptr, out_ptr, bias_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n,
                 m_valid, n_valid, N, part_stride: tl.int64,
                 SPLIT_K: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr):
    # acc: this program's [BLOCK_M, BLOCK_N] fp32 sums over its K slice. Not FUSED: its
    # partial into part [split, M, N] for _finish's reduce launch. With SPLIT_K > 1
    # each program stores its partial, then counts itself in with an acq_rel atomic
    # (after a barrier, so the whole tile's stores precede the count); the tile's last
    # program adds the partials in split order 0, 1, ... (the same sums, in the same
    # order, as _split_k_reduce_kernel: the result does not depend on which program
    # came last), adds the bias, casts, stores and resets the counter for the next call.
    # The "serial split-K with a semaphore" of CUTLASS's GEMM universal, one launch.
    mask = m_valid[:, None] & n_valid[None, :]
    idx = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    last = FUSED
    if not FUSED:
        tl.store(part_ptr + pid_k.to(tl.int64) * part_stride + idx, acc, mask=mask)
    elif SPLIT_K > 1:
        tl.store(part_ptr + pid_k.to(tl.int64) * part_stride + idx, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
    if last:
        if SPLIT_K > 1:
            acc = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                acc += tl.load(part_ptr + s * part_stride + idx, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, final_ptr, bias_ptr, count_ptr,
    M, x_stride: tl.int64, out_stride_split: tl.int64,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    n_valid = offs_n < N
    m_valid = offs_m < M
    k_lo = pid_k * K_PER_SPLIT
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < K
            x = tl.load(x_ptr + k, mask=k_valid, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :],
                        other=0.0).to(tl.float32)
            acc2 += w * x[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BN]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < K
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + k[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_rows + k[None, :], mask=n_valid[:, None] & k_valid[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_SCALE:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    _finish_tile(acc, out_ptr, final_ptr, bias_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n,
                 m_valid, n_valid, N, out_stride_split, SPLIT_K, FUSED, HAS_BIAS)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr, final_ptr, bias_ptr,
    count_ptr, M, x_stride: tl.int64, out_stride_split: tl.int64,
    N: tl.constexpr, K: tl.constexpr, GROUP_SIZE: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_G_IDX: tl.constexpr, FUSED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K // 8)
    offs_m = tl.arange(0, BLOCK_M)
    n_valid = offs_n < N
    m_valid = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # M = 1 without act-order at BLOCK_N <= 128: a [BLOCK_K / 8, BLOCK_N] float32
    # accumulator instead of a cross-warp reduce per step (measured on an H100 in
    # session 41: 10-20% faster at those tiles, slower at 256 where registers run out).
    REDUCE_ONCE: tl.constexpr = BLOCK_M == 1 and not HAS_G_IDX and BLOCK_N <= 128
    acc2 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        rows = k0 // 8 + offs_r  # words holding rows k0 .. k0 + BK - 1
        r_valid = rows < K // 8
        words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=r_valid[:, None] & n_valid[None, :], other=0)  # [BK/8, BN]
        if HAS_G_IDX:
            for i in tl.static_range(8):
                k = rows * 8 + i
                q = ((words >> (4 * i)) & 0xF).to(tl.float32)
                g = tl.load(g_idx_ptr + k, mask=r_valid, other=0)
                grp = g[:, None].to(tl.int64) * N + offs_n[None, :]
                gm = r_valid[:, None] & n_valid[None, :]
                z = tl.load(qzeros_ptr + grp, mask=gm, other=0).to(tl.float32)
                s = tl.load(scales_ptr + grp, mask=gm, other=0.0).to(tl.float32)
                w = (q - z) * s  # [BK/8, BN]
                x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + k[None, :],
                            mask=m_valid[:, None] & r_valid[None, :],
                            other=0.0).to(tl.float32)  # [BM, BK/8]
                if BLOCK_M == 1:
                    acc += tl.sum(w * tl.reshape(x, (BLOCK_K // 8,))[:, None],
                                  axis=0)[None, :]
                else:
                    acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        else:
            # NOTE: a split's last steps may start past K (K_PER_SPLIT is rounded up):
            # their group does not exist, so its row must not be read.
            g = k0 // GROUP_SIZE
            gm = n_valid & (k0 < K)
            z = tl.load(qzeros_ptr + g * N + offs_n, mask=gm, other=0).to(tl.float32)
            s = tl.load(scales_ptr + g * N + offs_n, mask=gm, other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                part = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
                xsum = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
                for i in tl.static_range(8):
                    k = rows * 8 + i
                    x = tl.load(x_ptr + k, mask=r_valid, other=0.0).to(tl.float32)
                    part += ((words >> (4 * i)) & 0xF).to(tl.float32) * x[:, None]
                    xsum += x
                if REDUCE_ONCE:  # the group's terms stay per word row: one reduce at the end
                    acc2 += s[None, :] * (part - z[None, :] * xsum[:, None])
                else:
                    qx = tl.sum(part, axis=0)  # [BN]
                    acc += (s * (qx - z * tl.sum(xsum, axis=0)))[None, :]
            else:
                qx = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                xsum = tl.zeros([BLOCK_M], dtype=tl.float32)
                for i in tl.static_range(8):
                    k = rows * 8 + i
                    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + k[None, :],
                                mask=m_valid[:, None] & r_valid[None, :],
                                other=0.0).to(tl.float32)  # [BM, BK/8]
                    q = ((words >> (4 * i)) & 0xF).to(tl.float32)
                    qx += tl.sum(x[:, :, None] * q[None, :, :], axis=1)
                    xsum += tl.sum(x, axis=1)
                acc += s[None, :] * (qx - z[None, :] * xsum[:, None])
    if REDUCE_ONCE:
        acc += tl.sum(acc2, axis=0)[None, :]
    _finish_tile(acc, out_ptr, final_ptr, bias_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n,
                 m_valid, n_valid, N, out_stride_split, SPLIT_K, FUSED, HAS_BIAS)


# --- configs ---------------------------------------------------------------------------

def _device_name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_name_of(index)


@functools.lru_cache(maxsize=16)
def _device_name_of(index: int) -> str:  # asked per linear call of <= 8 rows: cached
    return torch.cuda.get_device_name(index).replace(" ", "_")


@functools.lru_cache(maxsize=8)
def _load_table(device_name: str) -> dict:
    path = os.path.join(_CONFIG_DIR, f"gemv,device_name={device_name}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _m_bucket(m: int) -> int:
    """Swept row counts: 1 (decode) and 8 (small verify batches, also used for 2..7)."""
    return 1 if m <= 1 else 8


def table_entry(fmt: str, m: int, n: int, k: int, device: torch.device) -> dict | None:
    """The swept entry for (format, M bucket, N, K) on this device, or None. Keys:
    block_n, block_k, split_k, num_warps, num_stages, faster (the GEMV beat the current
    path in the sweep)."""
    if device.type != "cuda":
        return None
    return _load_table(_device_name(device)).get(f"{fmt},{_m_bucket(m)},{n},{k}")


def use_gemv(fmt: str, m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether the linear layers should take the GEMV for this shape: only where the
    graph-timed sweep measured it faster than the current path (FLOWENGINE_GEMV=0
    turns it off, =1 forces it for every M <= 8)."""
    env = os.environ.get("FLOWENGINE_GEMV", "")
    if m > GEMV_MAX_M or m < 1 or env == "0":
        return False
    if env == "1":
        return True
    entry = table_entry(fmt, m, n, k, device)
    return bool(entry and entry.get("faster"))


def gemv_config(fmt: str, m: int, n: int, k: int, device: torch.device
                ) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): the swept entry, else a
    heuristic with ~4 programs per multiprocessor."""
    entry = table_entry(fmt, m, n, k, device)
    if entry:
        return (entry["block_n"], entry["block_k"], entry["split_k"], entry["num_warps"],
                entry["num_stages"])
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 8)
    w4 = fmt.startswith("w4a16")
    block_n = 64 if w4 else 16
    block_k = 128 if w4 else 256
    if m > 1:
        block_k //= 2
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 4 * sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return block_n, block_k, split, 4, 3


# --- entry points ----------------------------------------------------------------------

def _finish(target: torch.Tensor, split: int, bias: torch.Tensor | None, m: int, n: int,
            dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((m, n), dtype=dtype, device=target.device)
    _split_k_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](
        target, bias if bias is not None else target, out, target.stride(0), out.stride(0),
        N=n, SPLIT_K=split, BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None,
    )
    return out


def _counter_buffer(device: torch.device) -> torch.Tensor | None:
    """The device's split-K tile counters, made on first use; None while a CUDA graph is
    being captured and none exists yet (its memory would belong to the graph's pool)."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def _outputs(x: torch.Tensor, split: int, m: int, n: int, tiles: int
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(fp32 partials [split, M, N], the [M, N] output, the tile counters): with counters
    the kernel finishes in place (_finish_tile); without (switched off, more tiles than
    counters, or capturing before the first call) it writes the partials and _finish
    reduces them. At split 1 in place the output doubles as the unused partials."""
    counters = _counter_buffer(x.device) if _FUSED_FINISH and tiles <= _COUNTER_SLOTS else None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if counters is not None else None
    if out is not None and split == 1:
        return out, out, counters
    return torch.empty((split, m, n), dtype=torch.float32, device=x.device), out, counters


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    if m > GEMV_MAX_M:
        raise ValueError(f"the GEMV takes at most {GEMV_MAX_M} rows, got {m}")
    if x.stride(1) != 1:
        raise ValueError("x must have contiguous columns")
    return m, k


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None, *,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y = x (weight [* weight_scale[:, None]])^T (+ bias) for M <= 8 rows.

    Args:
        x: [M, K] float16/bfloat16/float32, contiguous columns, M <= 8.
        weight: [N, K] contiguous, float16/bfloat16/float32 or float8_e4m3fn.
        bias: [N] or None.
        weight_scale: [N] float32 per-output-channel scales (FP8 weights), or None.
        config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) override (sweeps).

    Returns:
        [M, N] in x's dtype: fp32 products and sums, one rounding at the end.
    """
    m, k = _check_x(x)
    check_tensor("weight", weight, ndim=2, device=x.device)
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {k}] tensor, got "
                         f"{tuple(weight.shape)}")
    if weight_scale is not None and weight_scale.numel() != n:
        raise ValueError(f"weight_scale must have {n} elements, got {weight_scale.numel()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    fmt = "fp8" if weight.dtype == torch.float8_e4m3fn else "dense"
    block_n, block_k, split, warps, stages = config or gemv_config(fmt, m, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, block_n)
    target, out, counters = _outputs(x, split, m, n, tiles)
    _dense_gemv_kernel[(tiles, split)](
        x, weight, weight_scale if weight_scale is not None else target, target, out,
        bias if bias is not None else target, counters if counters is not None else target,
        m, x.stride(0), target.stride(0),
        N=n, K=k, K_PER_SPLIT=k_per_split, SPLIT_K=split,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_SCALE=weight_scale is not None, FUSED=counters is not None,
        HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
    )
    return out if counters is not None else _finish(target, split, bias, m, n, x.dtype)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               qzeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
               bias: torch.Tensor | None = None, *,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`w4a16_gemm` (kernels/w4a16.py, same arguments and layout) for M <= 8 rows.

    Without g_idx, BLOCK_K must divide group_size (a step lies in one group); the
    heuristic and the sweep keep to that.

    Returns:
        [M, N] in x's dtype: weights dequantized and products summed in fp32 (no
        rounding of the weights to x's dtype), one rounding at the end.
    """
    m, k = _check_x(x)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,), device=x.device)
    n = qweight.shape[1]
    if group_size <= 0 or group_size % 8 or k % 8:
        raise ValueError(f"group_size ({group_size}) and K ({k}) must be multiples of 8")
    if qweight.shape[0] * 8 != k or not qweight.is_contiguous():
        raise ValueError(f"qweight must be a contiguous [{k // 8}, N] int32 tensor")
    groups = triton.cdiv(k, group_size)
    for name, t in (("scales", scales), ("qzeros", qzeros)):
        if t.shape != (groups, n) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{groups}, {n}] tensor, got "
                             f"{tuple(t.shape)}")
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    fmt = "w4a16" if g_idx is None else "w4a16_act"
    block_n, block_k, split, warps, stages = config or gemv_config(fmt, m, n, k, x.device)
    if g_idx is None and group_size % block_k:
        block_k = max(8, min(block_k, group_size & -group_size))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, block_n)
    target, out, counters = _outputs(x, split, m, n, tiles)
    _w4a16_gemv_kernel[(tiles, split)](
        x, qweight, qzeros, scales, g_idx if g_idx is not None else qweight, target, out,
        bias if bias is not None else target, counters if counters is not None else target,
        m, x.stride(0), target.stride(0),
        N=n, K=k, GROUP_SIZE=group_size, K_PER_SPLIT=k_per_split, SPLIT_K=split,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_G_IDX=g_idx is not None, FUSED=counters is not None, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=stages,
    )
    return out if counters is not None else _finish(target, split, bias, m, n, x.dtype)
