"""Loading 4-bit GPTQ / AWQ checkpoints: which layers become `Int4Linear`, and how each
checkpoint layer's packed tensors fill them (flowengine/model/layers/int4.py).

Before materialization every column/row-parallel linear layer except the LM head whose
checkpoint parts (q/k/v of a fused qkv, gate/up of a fused gate_up) all carry
`.qweight` is replaced by an empty `Int4Linear`; a layer whose parts carry `.weight`
(AWQ's `modules_to_not_convert`, GPTQModel's dynamic skips) stays float. Fused parts
are concatenated along N in the canonical layout, which packs along K only, so no
repacking crosses parts. While the checkpoint streams past, a layer's 3-4 tensors are
held until all have arrived, converted, copied and dropped: at most one projection's
packed tensors are held at a time beyond the model itself.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from flowengine.distributed.tp_group import TensorParallelGroup
from flowengine.model.layers.int4 import Int4Linear, Int4QuantConfig, to_canonical
from flowengine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from flowengine.model.weight_shards import WeightShard

logger = logging.getLogger(__name__)

PACKED_LEAVES = ("qweight", "qzeros", "scales", "g_idx")
# name prefix of a checkpoint layer -> the (layer, shard of its old float weight) pairs
Int4Plan = dict[str, list[tuple[Int4Linear, WeightShard]]]


def swap_int4_layers(model: nn.Module, cfg: Int4QuantConfig, dtype: torch.dtype,
                     checkpoint_names: set[str] | None, tp: TensorParallelGroup) -> Int4Plan:
    """Replace the quantized layers of `model` (on the meta device) by `Int4Linear`s.

    checkpoint_names: every tensor name in the checkpoint, or None (dummy weights: every
    eligible layer is quantized).

    Raises:
        ValueError: tensor parallelism (not supported for 4-bit checkpoints yet), a
            fused layer whose parts are partly quantized, or packed tensors of layers
            that have no 4-bit form here (MoE experts, the LM head).
    """
    if tp.world_size > 1:
        raise ValueError(f"{cfg.method.upper()} checkpoints run with tensor_parallel_size 1 "
                         f"only (got {tp.world_size})")
    by_param: dict[str, list[WeightShard]] = {}
    for shard in model.weight_shards():
        by_param.setdefault(shard.param, []).append(shard)
    plan: Int4Plan = {}
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        shards = by_param.get(f"{name}.weight")
        if name == "lm_head" or not shards:
            continue
        prefixes = sorted({s.hf_name.removesuffix(".weight") for s in shards})
        if any(frag in p for frag in cfg.modules_to_not_convert for p in prefixes):
            continue
        if checkpoint_names is not None:
            packed = [f"{p}.qweight" in checkpoint_names for p in prefixes]
            if not any(packed):
                continue
            if not all(packed):
                raise ValueError(f"layer {name} fuses {prefixes}, of which only some are "
                                 f"{cfg.method.upper()}-quantized; FlowEngine cannot fuse them")
        out_features, in_features = module.weight.shape
        layer = Int4Linear(in_features, out_features, module.bias is not None,
                           cfg.layer_group_size(in_features), cfg.desc_act, dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, layer)
        for s in shards:
            plan.setdefault(s.hf_name.removesuffix(".weight"), []).append((layer, s))
    if checkpoint_names is not None:
        stray = sorted(n for n in checkpoint_names
                       if n.endswith(".qweight") and n.removesuffix(".qweight") not in plan)
        if stray:
            raise ValueError(
                f"{cfg.method.upper()} checkpoint quantizes {len(stray)} layer(s) FlowEngine "
                f"does not run in 4 bits (MoE experts, the LM head): {stray[:5]}")
    logger.info("%s checkpoint: %d linear layer(s) in 4 bits (group size %d%s)",
                cfg.method.upper(), len({id(lay) for v in plan.values() for lay, _ in v}),
                cfg.group_size, ", act-order" if cfg.desc_act else "")
    return plan


def expected_names(plan: Int4Plan, cfg: Int4QuantConfig | None) -> set[str]:
    """The packed tensor names a complete checkpoint provides (g_idx only required for
    act-order GPTQ)."""
    if cfg is None:
        return set()
    leaves = ["qweight", "qzeros", "scales"] + (["g_idx"] if cfg.desc_act else [])
    return {f"{p}.{leaf}" for p in plan for leaf in leaves}


def place_int4(weights: Iterator[tuple[str, Any]], plan: Int4Plan, cfg: Int4QuantConfig,
               checkpoint_names: set[str], placed: set[str]) -> Iterator[tuple[str, Any]]:
    """Fill the Int4Linear layers from their packed checkpoint tensors (recording the
    names in `placed`); pass every other tensor on.

    Raises:
        ValueError: shapes that disagree with config.json, a fused layer's parts with
            different g_idx, or a g_idx that is not k // group_size without desc_act.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    g_idx_seen: dict[int, torch.Tensor] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in plan or leaf not in PACKED_LEAVES:
            yield name, tensor
            continue
        held = pending.setdefault(prefix, {})
        held[leaf] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        placed.add(name)
        if all(f"{prefix}.{x}" not in checkpoint_names or x in held for x in PACKED_LEAVES):
            _fill(prefix, pending.pop(prefix), plan[prefix], cfg, g_idx_seen)


@torch.no_grad()
def _fill(prefix: str, tensors: dict[str, torch.Tensor],
          targets: list[tuple[Int4Linear, WeightShard]], cfg: Int4QuantConfig,
          g_idx_seen: dict[int, torch.Tensor]) -> None:
    layer = targets[0][0]
    qweight, zeros, scales, g_idx = to_canonical(cfg, tensors, layer.in_features)
    n_part = targets[0][1].full_shape[0]
    if qweight.shape[1] != n_part:
        raise ValueError(f"checkpoint layer {prefix} has {qweight.shape[1]} output features "
                         f"but the model built from config.json expects {n_part}")
    if g_idx is not None and layer.g_idx is None:
        raise ValueError(f"{prefix}.g_idx is not k // group_size but desc_act is false; "
                         "set desc_act in quantization_config")
    for layer, shard in targets:
        if shard.dim == 0 and shard.length >= 0:
            src = slice(shard.start, shard.start + shard.length)
            dst = slice(shard.dest_start, shard.dest_start + shard.length)
        else:  # the whole part (tensor parallelism is refused in swap_int4_layers)
            src, dst = slice(None), slice(None)
        layer.qweight[:, dst] = qweight[:, src]
        layer.qzeros[:, dst] = zeros[:, src]
        layer.scales[:, dst] = scales[:, src]
        if layer.g_idx is not None:
            full = (g_idx if g_idx is not None else
                    torch.arange(layer.in_features, dtype=torch.int32) // layer.group_size)
            previous = g_idx_seen.setdefault(id(layer), full)
            if not torch.equal(previous, full):
                raise ValueError(f"{prefix}.g_idx differs from the g_idx of the other "
                                 "projections fused with it (same input, so GPTQ's act-order "
                                 "gives one order); FlowEngine cannot fuse them")
            layer.g_idx.copy_(full)


def fill_dummy_int4(model: nn.Module, seed: int) -> None:
    """Random packed weights for every Int4Linear (load_format="dummy", benchmarks):
    uniform 4-bit values, zero point 8, scales in [0.5, 1.5] x 1.25e-4 (weights within
    about +-1e-3, the float dummy range), act-order layers with plain groups."""
    for name, module in model.named_modules():
        if not isinstance(module, Int4Linear):
            continue
        gen = torch.Generator(device=module.qweight.device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        module.qweight.random_(-2**31, 2**31 - 1, generator=gen)
        module.qzeros.fill_(8)
        module.scales.uniform_(0.5 * 1.25e-4, 1.5 * 1.25e-4, generator=gen)
        if module.g_idx is not None:
            module.g_idx.copy_(torch.arange(module.in_features, dtype=torch.int32,
                                            device=module.g_idx.device) // module.group_size)


def finalize_int4(model: nn.Module) -> None:
    """Per-device preparation of every Int4Linear once its buffers are filled."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.finalize()


def checkpoint_names(files: list[str]) -> set[str]:
    """Every tensor name in the safetensors files (headers only). Raises ValueError for
    an unreadable file."""
    from flowengine.model.loader import open_safetensors  # loader imports this module

    names: set[str] = set()
    for path in files:
        with open_safetensors(path) as f:
            names.update(f.keys())
    return names
