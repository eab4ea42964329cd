"""One C call per small per-layer operation of a CPU decode step (issue #20).

At batch 1 on the default model a layer's RMSNorms, rotary embedding and KV-cache
write are [1, 576]-sized: torch spends its time dispatching their 5-10 operators each,
not computing, and the 30-layer forward paid more for them than for its matmuls. These
wrappers run the C bodies of flowengine/_cpu_ops.c instead, for float32 CPU tensors in
the layouts the model produces; for anything else they return None (or False) and the
caller takes its torch path. Same arithmetic as transformers' float32 code, up to the
order of a sum of squares.
"""

from __future__ import annotations

import os

import torch

try:
    from flowengine import _cpu_ops as _ops
except ImportError:  # not built: the torch paths serve
    _ops = None

# FLOWENGINE_CPU_NO_FUSED=1 turns these off (torch paths everywhere), for comparisons.
ENABLED = _ops is not None and os.environ.get("FLOWENGINE_CPU_NO_FUSED", "") != "1"


def _plain(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.is_contiguous() and not x.requires_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(normed, residual + x or None) for x [T, H] float32 (and residual alike), weight
    [H] float32, rows split among torch's intra-op threads in a prefill; None when the
    inputs are not of that kind."""
    if not (ENABLED and _plain(x) and weight.dtype == torch.float32 and weight.is_contiguous()
            and weight.shape == x.shape[1:] and not torch.is_grad_enabled()):
        return None
    if residual is not None and not (_plain(residual) and residual.shape == x.shape):
        return None
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = None if residual is None else torch.empty_like(x)
    _ops.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                  weight.data_ptr(), float(eps), t, h, out.data_ptr(),
                  0 if res_out is None else res_out.data_ptr(), torch.get_num_threads())
    return out, res_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up [T, I] for gate_up [T, 2 I] float32 (gate first), by the C body
    the fused decode layers use (exp to ~2e-7 relative, one rounding per operation
    otherwise), rows split among torch's intra-op threads; None when the input is not
    of that kind."""
    if not (ENABLED and _plain(gate_up) and gate_up.shape[1] % 2 == 0
            and not torch.is_grad_enabled()):
        return None
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2)
    _ops.silu_mul(gate_up.data_ptr(), t, i2 // 2, out.data_ptr(), torch.get_num_threads())
    return out


def silu_and_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up [T, I] bf16 for gate_up [T, 2 I] bf16 (gate first): each value
    widened to float32, silu_and_mul's float32 operations, one rounding to bf16 as
    torch's .to(torch.bfloat16) rounds. So it equals silu_and_mul(gate_up.float())
    .to(torch.bfloat16) bit for bit, without the two float32 tensors; None when the
    input is not of that kind. (torch's bf16 operators round after each operation.)"""
    if not (ENABLED and gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu"
            and gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
            and not gate_up.requires_grad and not torch.is_grad_enabled()):
        return None
    t, i2 = gate_up.shape
    out = torch.empty(t, i2 // 2, dtype=torch.bfloat16)
    _ops.silu_mul(gate_up.data_ptr(), t, i2 // 2, out.data_ptr(), torch.get_num_threads(),
                  True)
    return out


def _rope_source(x: torch.Tensor) -> bool:
    """[T, heads, D] float32 with contiguous heads (a view of the fused qkv rows)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and not x.requires_grad)


def rope_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotated (q, k), new contiguous tensors, for q [T, Hq, D], k [T, Hkv, D] float32,
    positions [T] int64, table [P, 2, D] float32 (cos, sin), rows split among torch's
    intra-op threads in a prefill; None when the inputs are not of that kind. Raises
    IndexError for a position outside the table."""
    if not (ENABLED and _rope_source(q) and _rope_source(k) and q.shape[2] == k.shape[2]
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.device.type == "cpu" and table.dtype == torch.float32
            and table.is_contiguous() and table.shape[1:] == (2, q.shape[2])
            and positions.shape[0] == q.shape[0] == k.shape[0] and not torch.is_grad_enabled()):
        return None
    t, hq, d = q.shape
    q_out = torch.empty(t, hq, d)
    k_out = torch.empty(t, k.shape[1], d)
    threads = torch.get_num_threads()
    _ops.rope_neox(positions.data_ptr(), t, q.data_ptr(), q.stride(0), hq, d,
                   table.data_ptr(), table.shape[0], q_out.data_ptr(), threads)
    _ops.rope_neox(positions.data_ptr(), t, k.data_ptr(), k.stride(0), k.shape[1], d,
                   table.data_ptr(), table.shape[0], k_out.data_ptr(), threads)
    return q_out, k_out


# KV cache dtypes the C kernels take, as their kv_fmt codes (KV_F32, KV_BF16, KV_F16 in
# _cpu_ops.c).
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> bool:
    """Store K/V [T, Hkv, D] (heads contiguous, any token stride) at slot_mapping [T]
    int64 (-1: skipped) of kv_cache [2, N, B, Hkv, D] (float32, bfloat16 or float16;
    float32 K/V into a bfloat16 or float16 cache are rounded to nearest even in C, the
    values torch's conversions give). False (nothing written) when the inputs are not
    of that kind. Raises IndexError (nothing written) for a slot outside the cache."""
    fmt = KV_FORMATS.get(kv_cache.dtype, 0) if k.dtype == torch.float32 else 0
    if not (ENABLED and k.dtype == v.dtype and (fmt or k.dtype == kv_cache.dtype)
            and kv_cache.dtype in KV_FORMATS and k.device.type == "cpu"
            and kv_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous() and k.shape == v.shape
            and k.shape[1:] == kv_cache.shape[3:] and slot_mapping.shape[0] == k.shape[0]):
        return False
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return False
    t = k.shape[0]
    slots = kv_cache.shape[1] * kv_cache.shape[2]
    row = k.shape[1] * k.shape[2]
    _ops.write_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, row,
                  k.element_size(), slot_mapping.data_ptr(), kv_cache.data_ptr(), slots * row,
                  fmt)
    return True
