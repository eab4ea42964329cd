"""Loading FP8 (E4M3) checkpoints directly: the layouts of compressed-tensors and vLLM's
`"quant_method": "fp8"`, onto `Fp8Linear` (flowengine/model/layers/fp8.py).

Layouts (config.json `quantization_config`, and the tensors of each quantized linear
layer `P` beside `P.weight`, an [out, in] float8_e4m3fn tensor):

- compressed-tensors, `"format": "float-quantized"` (llm-compressor's FP8 and
  FP8-dynamic schemes): `config_groups.*.weights` = {num_bits 8, type "float",
  strategy "channel" | "tensor"}; `P.weight_scale` float, [out, 1] per channel or one
  value per tensor; `input_activations` null (weight-only), dynamic per token, or
  static per tensor (`P.input_scale`, one value); `ignore` lists the float layers
  (names, or "re:" regular expressions).
- vLLM's `"quant_method": "fp8"` (`activation_scheme` "dynamic" | "static"): either
  `weight_block_size` [128, 128] with `P.weight_scale_inv` [ceil(out/128),
  ceil(in/128)] float32 (DeepSeek-V3's and Qwen3-FP8's checkpoints), or one
  `P.weight_scale` per tensor with `P.input_scale` when static; `ignored_layers` /
  `modules_to_not_convert` list the float layers.

In every layout weight = float(P.weight) x its scale (the scale of its row, tensor or
128 x 128 block), so the loaded layer holds the checkpoint's E4M3 bytes unchanged and
its scales as float32 (an exact widening): per-tensor scales become per-row scales, and
the parts of a fused layer (q/k/v, gate/up) keep their own scales, so nothing is
re-quantized. A static input scale of a fused layer is the parts' largest (vLLM does
the same). Activations are quantized per token at run time when the checkpoint has
dynamic or no activation scales (FlowEngine's `--quantization fp8` recipe); with
static scales the W8A8 GEMM uses the checkpoint's scale. Block-scaled layers run on the
CPU (the float32 reference: weights dequantized exactly, `fp8_linear_reference`); on
CUDA FlowEngine has no block-scaled FP8 GEMM yet and refuses them with a clear error.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK
from flowengine.model.layers.fp8 import FP8_DTYPE, Fp8Linear
from flowengine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from flowengine.model.weight_shards import WeightShard

logger = logging.getLogger(__name__)

SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale")
# name prefix of a checkpoint layer -> the (layer, shard of its weight) pairs it fills
Fp8Plan = dict[str, list[tuple[Fp8Linear, WeightShard]]]


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """An FP8 checkpoint's `quantization_config` (module docstring).

    method: "compressed-tensors" or "fp8"; strategy: "channel", "tensor" or "block";
    block_size: (rows, columns) of a weight scale block for "block", else None;
    static_activations: the checkpoint has `input_scale` tensors; ignore: patterns of
    the layers kept in float (plain names match a module name or its suffix, "re:"
    patterns are regular expressions).
    """

    method: str
    strategy: str
    block_size: tuple[int, int] | None = None
    static_activations: bool = False
    ignore: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> Fp8CheckpointConfig:
        """Parse config.json's quantization_config. Raises ValueError naming what is not
        supported (another format or number type, group strategies, E5M2)."""
        method = str(qc.get("quant_method", "")).lower()
        if method == "fp8":
            return _from_vllm_fp8(qc)
        if method == "compressed-tensors":
            return _from_compressed_tensors(qc)
        raise ValueError(f"quantization_config quant_method {qc.get('quant_method')!r} is "
                         "not an FP8 checkpoint")

    def ignores(self, module_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False


def is_fp8_quant_method(qc: dict[str, Any]) -> bool:
    """Whether a quantization_config describes an FP8 checkpoint this module loads."""
    return str(qc.get("quant_method", "")).lower() in ("fp8", "compressed-tensors")


def _from_vllm_fp8(qc: dict[str, Any]) -> Fp8CheckpointConfig:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoint fmt {fmt!r} is not supported; FlowEngine loads "
                         "E4M3 weights")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 checkpoint activation_scheme {scheme!r} must be 'dynamic' "
                         "or 'static'")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list | tuple) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"fp8 checkpoint weight_block_size must be two positive "
                             f"integers, got {block!r}")
        if scheme == "static":
            raise ValueError("fp8 checkpoint with weight_block_size and static activations "
                             "is not supported (block-scaled checkpoints are dynamic)")
        return Fp8CheckpointConfig("fp8", "block", (block[0], block[1]), False, ignore)
    return Fp8CheckpointConfig("fp8", "tensor", None, scheme == "static", ignore)


def _from_compressed_tensors(qc: dict[str, Any]) -> Fp8CheckpointConfig:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; FlowEngine "
                         "loads 'float-quantized' (FP8) checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ValueError(f"compressed-tensors group {name!r}: weights must be 8-bit "
                             f"float, got {weights.get('num_bits')}-bit {weights.get('type')}")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors group {name!r}: weight strategy "
                             f"{strategy!r} is not supported (channel or tensor)")
        acts = group.get("input_activations")
        static = False
        if acts is not None:
            if acts.get("num_bits") != 8 or acts.get("type") != "float":
                raise ValueError(f"compressed-tensors group {name!r}: input activations "
                                 "must be 8-bit float")
            if acts.get("dynamic"):
                if acts.get("strategy") not in ("token", "tensor"):
                    raise ValueError(f"compressed-tensors group {name!r}: dynamic "
                                     f"activation strategy {acts.get('strategy')!r} is not "
                                     "supported (token)")
            elif acts.get("strategy") == "tensor":
                static = True
            else:
                raise ValueError(f"compressed-tensors group {name!r}: static activation "
                                 f"strategy {acts.get('strategy')!r} is not supported (tensor)")
        schemes.add((strategy, static))
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors config_groups mix schemes {sorted(schemes)}; "
                         "FlowEngine loads one FP8 scheme per checkpoint")
    strategy, static = schemes.pop()
    return Fp8CheckpointConfig("compressed-tensors", strategy, None, static,
                               tuple(qc.get("ignore") or ()))


def swap_fp8_layers(model: nn.Module, cfg: Fp8CheckpointConfig, dtype: torch.dtype,
                    checkpoint_names: set[str], device: torch.device) -> Fp8Plan:
    """Replace the FP8 layers of `model` (on the meta device) by empty `Fp8Linear`s: each
    column/row-parallel linear layer except the LM head and `cfg.ignore` whose
    checkpoint parts all carry a weight scale.

    Raises:
        ValueError: block-scaled layers off the CPU, a fused layer whose parts are
            partly FP8, a block-scaled part whose rows (or slice) are not whole blocks,
            or FP8 tensors of layers FlowEngine has no FP8 form for (MoE experts).
    """
    scale_leaf = "weight_scale_inv" if cfg.strategy == "block" else "weight_scale"
    if cfg.strategy == "block" and device.type != "cpu":
        raise ValueError(
            f"this checkpoint's FP8 weights have 128 x 128 block scales "
            f"(weight_block_size {list(cfg.block_size or ())}); FlowEngine has no "
            f"block-scaled FP8 GEMM on {device.type} yet (they run on the CPU)")
    by_param: dict[str, list[WeightShard]] = {}
    for shard in model.weight_shards():
        by_param.setdefault(shard.param, []).append(shard)
    plan: Fp8Plan = {}
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        shards = by_param.get(f"{name}.weight")
        if name == "lm_head" or not shards or cfg.ignores(name):
            continue
        prefixes = sorted({s.hf_name.removesuffix(".weight") for s in shards})
        if any(cfg.ignores(p) for p in prefixes):
            continue
        quantized = [f"{p}.{scale_leaf}" in checkpoint_names for p in prefixes]
        if not any(quantized):
            continue
        if not all(quantized):
            raise ValueError(f"layer {name} fuses {prefixes}, of which only some are FP8; "
                             "FlowEngine cannot fuse them")
        out_features, in_features = module.weight.shape
        if cfg.block_size is not None:
            _check_blocks(name, shards, cfg.block_size)
        row = isinstance(module, RowParallelLinear)
        with torch.device("meta"):  # materialized with the model (to_empty)
            layer = Fp8Linear.empty(out_features, in_features, module.bias is not None, dtype,
                                    row_parallel=row, tp=module.tp if row else SINGLE_RANK,
                                    block_size=cfg.block_size,
                                    static_input_scale=cfg.static_activations)
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, layer)
        for s in shards:
            plan.setdefault(s.hf_name.removesuffix(".weight"), []).append((layer, s))
    stray = sorted(n for n in checkpoint_names if n.endswith("." + scale_leaf)
                   and n.removesuffix("." + scale_leaf) not in plan
                   and not cfg.ignores(n.removesuffix("." + scale_leaf)))
    if stray:
        raise ValueError(f"FP8 checkpoint quantizes {len(stray)} layer(s) FlowEngine does "
                         f"not run in FP8 (MoE experts, the LM head): {stray[:5]}")
    logger.info("FP8 checkpoint (%s, %s scales): %d linear layer(s) in E4M3", cfg.method,
                cfg.strategy, len({id(lay) for v in plan.values() for lay, _ in v}))
    return plan


def _check_blocks(name: str, shards: list[WeightShard], block: tuple[int, int]) -> None:
    for s in shards:
        rows = s.full_shape[0] if s.dim != 0 or s.length < 0 else s.length
        starts = [s.dest_start] + ([s.start] if s.dim == 0 else [])
        if s.dim == 1 and s.length >= 0 and (s.start % block[1] or s.length % block[1]):
            raise ValueError(f"layer {name}: its slice of {s.hf_name} is not whole "
                             f"{block[1]}-column blocks")
        if rows % block[0] or any(x % block[0] for x in starts):
            raise ValueError(f"layer {name}: {s.hf_name} has {rows} rows, not whole "
                             f"{block[0]}-row scale blocks; FlowEngine cannot fuse it")


def expected_names(plan: Fp8Plan, cfg: Fp8CheckpointConfig | None) -> set[str]:
    """The tensor names a complete FP8 checkpoint provides for the planned layers."""
    if cfg is None:
        return set()
    leaves = ["weight", "weight_scale_inv" if cfg.strategy == "block" else "weight_scale"]
    if cfg.static_activations:
        leaves.append("input_scale")
    return {f"{p}.{leaf}" for p in plan for leaf in leaves}


def place_fp8(weights: Iterator[tuple[str, Any]], plan: Fp8Plan, cfg: Fp8CheckpointConfig,
              placed: set[str]) -> Iterator[tuple[str, Any]]:
    """Fill the Fp8Linear layers from their checkpoint tensors (recording the names in
    `placed`); pass every other tensor on. A layer part's tensors are held until all
    have arrived.

    Raises:
        ValueError: a weight that is not float8_e4m3fn, or shapes that disagree with
            config.json.
    """
    needed = set(expected_names({"x": []}, cfg))
    leaves = {n.removeprefix("x.") for n in needed}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix not in plan or leaf not in leaves:
            yield name, tensor
            continue
        held = pending.setdefault(prefix, {})
        held[leaf] = tensor if isinstance(tensor, torch.Tensor) else (
            tensor[...] if not tensor.get_shape() else tensor[:])  # a scalar: [...]
        placed.add(name)
        if leaves <= held.keys():
            _fill(prefix, pending.pop(prefix), plan[prefix], cfg)


@torch.no_grad()
def _fill(prefix: str, tensors: dict[str, torch.Tensor],
          targets: list[tuple[Fp8Linear, WeightShard]], cfg: Fp8CheckpointConfig) -> None:
    weight = tensors["weight"]
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn; the "
                         "checkpoint's quantization_config says FP8")
    full_shape = targets[0][1].full_shape
    if tuple(weight.shape) != tuple(full_shape):
        raise ValueError(f"checkpoint tensor {prefix}.weight has shape {tuple(weight.shape)} "
                         f"but the model built from config.json expects {tuple(full_shape)}")
    out_part, in_part = weight.shape
    if cfg.strategy == "block":
        assert cfg.block_size is not None
        bo, bi = cfg.block_size
        scale = tensors["weight_scale_inv"].float()
        want = (-(-out_part // bo), -(-in_part // bi))
        if tuple(scale.shape) != want:
            raise ValueError(f"{prefix}.weight_scale_inv has shape {tuple(scale.shape)}; "
                             f"{want} expected for {bo} x {bi} blocks of {tuple(weight.shape)}")
    else:
        scale = tensors["weight_scale"].float()
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(out_part)
        elif scale.numel() == out_part:
            scale = scale.reshape(out_part)
        else:
            raise ValueError(f"{prefix}.weight_scale has {scale.numel()} values; 1 (per "
                             f"tensor) or {out_part} (per output channel) expected")
    input_scale = tensors.get("input_scale")
    for layer, shard in targets:
        rows_src: slice = slice(None)
        rows_dst = slice(shard.dest_start, shard.dest_start + out_part)
        cols: slice = slice(None)
        if shard.dim == 0 and shard.length >= 0:
            rows_src = slice(shard.start, shard.start + shard.length)
            rows_dst = slice(shard.dest_start, shard.dest_start + shard.length)
        elif shard.dim == 1 and shard.length >= 0:
            cols = slice(shard.start, shard.start + shard.length)
        layer.weight[rows_dst] = weight[rows_src, cols].to(layer.weight.device)
        if cfg.strategy == "block":
            bo, bi = cfg.block_size  # type: ignore[misc]
            bsrc = slice(None if rows_src.start is None else rows_src.start // bo,
                         None if rows_src.stop is None else -(-rows_src.stop // bo))
            bdst = slice(rows_dst.start // bo, -(-rows_dst.stop // bo))
            bcols = slice(None if cols.start is None else cols.start // bi,
                          None if cols.stop is None else -(-cols.stop // bi))
            layer.weight_scale[bdst] = scale[bsrc, bcols].to(layer.weight_scale.device)
        else:
            layer.weight_scale[rows_dst] = scale[rows_src].to(layer.weight_scale.device)
        if input_scale is not None:
            value = input_scale.float().reshape(-1).max().to(layer.input_scale.device)
            # Fused parts share one input: the largest scale saturates none of them.
            seen = layer.input_scale_seen
            layer.input_scale.copy_(value if not seen else torch.maximum(layer.input_scale,
                                                                          value))
            layer.input_scale_seen = True


def checkpoint_fp8_config(model_config: Any) -> Fp8CheckpointConfig | None:
    qc = getattr(model_config, "quantization_config", None)
    return qc if isinstance(qc, Fp8CheckpointConfig) else None

