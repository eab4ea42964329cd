"""The decoder layers of a CPU decode step in one C call (issue #20).

At batch 1 on the default model (30 layers of [1, 576]) a decode step spent about a
third of its CPU time in Python and torch dispatch between the C kernels: ~15 module
calls, views and allocations per layer. `decode_forward` runs every layer of a
Llama-style model (pre-norm RMSNorm, fused qkv with NeoX RoPE, paged decode attention,
SwiGLU MLP) with quantized weights in `_cpu_ops.decode_layers`: the same C bodies the
per-operator path calls (so the same numbers; with `--dtype bfloat16` the matmuls take
the AMX bodies from the rows the weights' `bf16_rows` say, as QuantizedWeight.matmul does,
and the KV cache may be bf16 or float16), with no Python between them. It applies when every
request of the step decodes one token (the CPU attention backend's decode plan) and
the model is of that exact kind; otherwise it returns None and LlamaModel.forward takes
its usual path. FLOWENGINE_CPU_NO_FUSED=1 turns it off with the other fused CPU
operators, FLOWENGINE_CPU_NO_FUSED_LAYERS=1 this alone (for comparisons).
"""

from __future__ import annotations

import os

import torch

from flowengine.model.layers import cpu_kernels
from flowengine.model.layers.cpu_kernels import KV_FORMATS
from flowengine.model.layers.quant_linear import DEQUANT_MIN_ROWS, FORMATS, QuantizedWeight

_COLS = 15  # DL_COLS in _cpu_ops.c
ENABLED = cpu_kernels.ENABLED and os.environ.get("FLOWENGINE_CPU_NO_FUSED_LAYERS", "") != "1"


def _fmt_code(weight: QuantizedWeight) -> int:
    return FORMATS[weight.fmt][0]


def _quant(linear) -> QuantizedWeight | None:
    w = getattr(linear, "weight", None)
    if (not isinstance(w, QuantizedWeight) or getattr(linear, "bias", None) is not None
            or w.dtype != torch.float32):
        return None
    return w


def _build_plan(model, kv_caches: list[torch.Tensor]):
    """The int64 pointer table [L, 15] and the step-independent arguments, or False
    when the model is not one decode_layers computes."""
    from flowengine.model.layers.activation import silu_and_mul
    from flowengine.model.layers.rms_norm import RMSNorm
    from flowengine.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if not (model.start_layer == 0 and model.end_layer == len(model.layers)
            and model.is_first_stage and model.is_last_stage
            and model.embedding_multiplier == 1.0 and type(model.norm) is RMSNorm
            and model.norm.weight.dtype == torch.float32):
        return False
    rotary = model.rotary_emb
    if (rotary.rotary_dim != rotary.head_dim or rotary.original_max_position
            or rotary.cos_sin_cache.dtype != torch.float32
            or not rotary.cos_sin_cache.is_contiguous()):
        return False
    rows = []
    shape = None
    eps = model.norm.eps
    amx = [0] * len(FORMATS)  # per format code: the AMX body from this many rows
    kv_dtype = kv_caches[0].dtype if kv_caches else None
    for layer, cache in zip(model.layers, kv_caches, strict=True):
        if type(layer) is not LlamaDecoderLayer or layer.residual_multiplier != 1.0:
            return False
        attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        if (type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP
                or mlp.act is not silu_and_mul or attn.qk_norm or attn.qk_norm_full
                or attn.clip_qkv is not None or attn.attn_kwargs
                or getattr(attn.attn_backend, "name", None) != "cpu"
                or getattr(attn.attn_backend, "fuses_rotary", False)
                or attn.o_proj.tp.world_size != 1):
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.eps != eps or n.weight.dtype != torch.float32
               or not n.weight.is_contiguous() for n in norms):
            return False
        ws = [_quant(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(w is None for w in ws):
            return False
        if (cache.dtype not in KV_FORMATS or cache.dtype != kv_dtype
                or not cache.is_contiguous() or cache.dim() != 5 or cache.shape[0] != 2):
            return False
        this = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.gate_up_proj.weight.shape[0]
                // 2, float(attn.scale), tuple(cache.shape))
        if shape is None:
            shape = this
        elif this != shape:
            return False
        hq, hkv, d, inter = this[:4]
        hidden = ws[0].shape[1]
        if (ws[0].shape != ((hq + 2 * hkv) * d, hidden) or ws[1].shape != (hidden, hq * d)
                or ws[2].shape != (2 * inter, hidden) or ws[3].shape != (hidden, inter)
                or cache.shape[3:] != (hkv, d)):
            return False
        row = [norms[0].weight.data_ptr()]
        for w in ws:
            if w.bf16_rows is not None:
                amx[_fmt_code(w)] = w.bf16_rows[0]
        for i, w in enumerate(ws):
            if i == 2:
                row.append(norms[1].weight.data_ptr())
            row += [_fmt_code(w), w.qs.data_ptr(), w.scales.data_ptr()]
        row.append(cache.data_ptr())
        rows.append(row)
    if shape is None:
        return False
    table = torch.tensor(rows, dtype=torch.int64)
    assert table.shape[1] == _COLS
    # the tensors whose pointers the table holds must stay alive: keep them
    return {"table": table, "shape": shape, "eps": float(eps), "caches": list(kv_caches),
            "amx": torch.tensor(amx, dtype=torch.int64) if any(amx) else None,
            "kv_fmt": KV_FORMATS[kv_dtype]}


def decode_forward(model, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], meta) -> torch.Tensor | None:
    """Final-norm hidden states [T, hidden] of LlamaModel `model` for a decode step, or
    None (the caller runs its layers) when this step or model does not qualify."""
    if not ENABLED or input_ids.device.type != "cpu" or torch.is_grad_enabled():
        return None
    t = input_ids.shape[0]
    if not 1 <= t <= DEQUANT_MIN_ROWS:
        return None
    # built once per set of KV cache tensors (a verdict of False included)
    key = tuple(c.data_ptr() for c in kv_caches)
    cached = getattr(model, "_cpu_fused_plan", None)
    if cached is None or cached[0] != key:
        try:
            plan = _build_plan(model, kv_caches)
        except (AttributeError, TypeError, ValueError):
            plan = False
        model._cpu_fused_plan = cached = (key, plan)
    plan = cached[1]
    if not plan:
        return None
    from flowengine.model.attention.cpu_backend import _decode_plan

    hidden = model.embed_tokens(input_ids)
    if hidden.dtype != torch.float32 or not hidden.is_contiguous() or hidden.dim() != 2:
        return None
    step = _decode_plan(meta, hidden.view(t, 1, -1))
    if step is None or step[0].shape[0] != t:
        return None
    tok_idx, req_idx, lens, block_tables = step
    slots = meta.slot_mapping
    if (positions.dtype != torch.int64 or not positions.is_contiguous()
            or positions.shape[0] != t or slots.dtype != torch.int64
            or not slots.is_contiguous() or slots.shape[0] != t):
        return None
    hq, hkv, d, inter, scale, cache_shape = plan["shape"]
    out = torch.empty_like(hidden)
    table = model.rotary_emb.cos_sin_cache
    from flowengine import _cpu_ops

    _cpu_ops.decode_layers(
        plan["table"].data_ptr(), plan["table"].shape[0], t, hidden.shape[1], hq, hkv, d,
        inter, plan["eps"], hidden.data_ptr(), model.norm.weight.data_ptr(), out.data_ptr(),
        positions.data_ptr(), table.data_ptr(), table.shape[0], slots.data_ptr(),
        cache_shape[1], cache_shape[2], tok_idx.data_ptr(), req_idx.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], lens.data_ptr(), scale,
        torch.get_num_threads(), 0 if plan["amx"] is None else plan["amx"].data_ptr(),
        plan["kv_fmt"])
    return out
