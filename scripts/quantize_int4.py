"""Quantize a float safetensors checkpoint into a 4-bit GPTQ or AWQ checkpoint (CPU).

Written from the formats' layouts (flowengine/model/layers/int4.py documents them):
AutoGPTQ's `qweight` / `qzeros` / `scales` / `g_idx` with `checkpoint_format` gptq (v1:
zeros stored minus one) or gptq_v2, and AutoAWQ's GEMM packing (`version: gemm`). The
values come from round-to-nearest (RTN) per group of `group_size` input features, not
from the GPTQ / AWQ calibration searches: those choose *which* integers to store, the
format that FlowEngine must read is the same. Per group g of a row (GPTQ's quantizer):

    asymmetric: lo = min(w, 0), hi = max(w, 0), s = (hi - lo) / 15, z = round(-lo / s)
    symmetric:  s = 2 * max|w| / 15, z = 8
    q = clamp(round(w / s) + z, 0, 15)          s stored float16 (q uses that value)

Act-order (`--desc-act`): input features are grouped in a permuted order, as GPTQ's
act-order does by decreasing Hessian diagonal; here the order is a random permutation
drawn per input (q/k/v share one, as they share their Hessian; gate/up likewise), and
g_idx[perm[j]] = j // group_size.

    python scripts/quantize_int4.py SRC_DIR OUT_DIR --method gptq [--desc-act] [--asym]
        [--group-size 128] [--checkpoint-format gptq|gptq_v2]

`quantize_checkpoint` returns the dequantized float32 weights ((q - z) * s, by the
checkpoint's names) for a reference model (tests/quantization/test_int4_checkpoints.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowengine.model.layers.int4 import AWQ_PACK_ORDER, pack_cols, pack_rows  # noqa: E402

_PROJ_INPUT = {  # projection -> the input it shares (one act-order permutation each)
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
    "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in",
    "gate_up_proj": "mlp_in", "down_proj": "mlp_out",
}


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None,
                 min_zero: int = 0) -> dict[str, torch.Tensor]:
    """w [N, K] float -> {"q" uint8 [K, N], "zeros" uint8 [G, N], "scales" float16
    [G, N], "g_idx" int32 [K]}; G = ceil(K / group_size). min_zero: the smallest zero
    point allowed (1 for GPTQ v1, which stores z - 1 in four bits)."""
    n, k = w.shape
    w = w.detach().float()
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    groups = -(-k // group_size)
    # [N, G, group_size] in group order; a short last group is padded with zeros, which
    # change neither min(w, 0), max(w, 0) nor max|w|.
    wg = torch.nn.functional.pad(w[:, order], (0, groups * group_size - k))
    wg = wg.view(n, groups, group_size)
    if sym:
        s = (2 * wg.abs().amax(dim=-1) / 15).clamp_min(1e-8)
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = wg.amin(dim=-1).clamp_max(0), wg.amax(dim=-1).clamp_min(0)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp(min_zero, 15)
    s16 = s.to(torch.float16)  # [N, G]
    qg = torch.clamp(torch.round(wg / s16.float()[..., None]) + z[..., None], 0, 15)
    q = torch.empty(k, n, dtype=torch.uint8)
    q[order] = qg.view(n, -1)[:, :k].t().to(torch.uint8)
    zeros = z.t().to(torch.uint8).contiguous()
    scales = s16.t().contiguous()
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def dequantize_rtn(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """(q - z) * s in float32 -> [N, K] (the reference weights)."""
    g = parts["g_idx"].long()
    z, s = parts["zeros"].float()[g], parts["scales"].float()[g]  # [K, N]
    return ((parts["q"].float() - z) * s).t().contiguous()


def gptq_tensors(parts: dict[str, torch.Tensor], v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors: qweight int32 [K / 8, N], qzeros int32 [G, N / 8] (z - 1 for
    v1), scales float16 [G, N], g_idx int32 [K]."""
    zeros = parts["zeros"].to(torch.int64) - (1 if v1 else 0)
    return {"qweight": pack_rows(parts["q"]), "qzeros": pack_cols(zeros & 0xF),
            "scales": parts["scales"], "g_idx": parts["g_idx"]}


def awq_tensors(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors: qweight int32 [K, N / 8], qzeros int32 [G, N / 8] (both in
    AWQ_PACK_ORDER), scales float16 [G, N]."""
    return {"qweight": pack_cols(parts["q"], AWQ_PACK_ORDER),
            "qzeros": pack_cols(parts["zeros"], AWQ_PACK_ORDER), "scales": parts["scales"]}


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 2)
    return (".layers." in name and name.endswith(".weight") and tensor.dim() == 2
            and len(leaf) == 3 and leaf[1] in _PROJ_INPUT)


def quantize_checkpoint(src: str, out: str, method: str, *, group_size: int = 128,
                        sym: bool = True, desc_act: bool = False,
                        checkpoint_format: str = "gptq", seed: int = 0
                        ) -> dict[str, torch.Tensor]:
    """Write a GPTQ / AWQ copy of the safetensors checkpoint `src` (config.json,
    tokenizer files and all) to `out`; return the float32 dequantized state dict (the
    float tensors as they were, each quantized projection as (q - z) * s).

    Raises:
        ValueError: unknown method, AWQ with sym / desc_act, or a projection whose
            in_features is not a multiple of 8 or out_features not a multiple of 8.
    """
    from safetensors.torch import load_file, save_file

    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    if method == "awq" and (sym or desc_act):
        raise ValueError("AWQ is asymmetric and has no act-order; pass sym=False, "
                         "desc_act=False")
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            path = os.path.join(src, f)
            if os.path.isfile(path):
                shutil.copy(path, os.path.join(out, f))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        state.update(load_file(str(f)))
    saved: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    v1 = method == "gptq" and checkpoint_format == "gptq"
    for name, tensor in state.items():
        if not _is_quantized(name, tensor):
            saved[name] = tensor.contiguous()
            reference[name] = tensor.float()
            continue
        n, k = tensor.shape
        if k % 8 or n % 8:
            raise ValueError(f"{name} is [{n}, {k}]; 4-bit packing needs multiples of 8")
        prefix = name.removesuffix(".weight")
        layer, proj = prefix.rsplit(".", 2)[0], prefix.rsplit(".", 1)[1]
        perm = None
        if desc_act:
            key = f"{layer}.{_PROJ_INPUT[proj]}"
            if key not in perms:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                perms[key] = torch.randperm(k, generator=gen)
            perm = perms[key]
        parts = quantize_rtn(tensor, group_size, sym, perm, min_zero=1 if v1 else 0)
        packed = awq_tensors(parts) if method == "awq" else gptq_tensors(parts, v1)
        for leaf, t in packed.items():
            saved[f"{prefix}.{leaf}"] = t.contiguous()
        reference[name] = dequantize_rtn(parts)
    save_file(saved, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
              "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size,
              "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    config["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    return reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--method", choices=["gptq", "awq"], required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="asymmetric (always for AWQ)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order (g_idx)")
    p.add_argument("--checkpoint-format", default="gptq", choices=["gptq", "gptq_v2"])
    a = p.parse_args()
    quantize_checkpoint(a.src, a.out, a.method, group_size=a.group_size,
                        sym=not a.asym and a.method == "gptq", desc_act=a.desc_act,
                        checkpoint_format=a.checkpoint_format)
    print(f"wrote {a.method} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
