"""Build a model and fill its weights: safetensors by name, GGUF, or random ("dummy").

The model is built on the meta device (no memory, no random init), materialized
uninitialized on the target device in the target dtype, then every parameter is
written exactly once from the checkpoint (gpt-fast's recipe). Safetensors files are
read tensor by tensor through memory maps, so a checkpoint is never held twice.

Quantization (CPU): "gguf" keeps every linear layer whose GGUF tensors share one
block format the CPU kernels run (Q4_0, Q4_1, Q8_0; Q4_K as Q4_1) in that format: the layer's float
weight is swapped for empty packed planes before materialization and filled from the
file's blocks; the other tensors are dequantized as before. "int8" quantizes the
linear layers of a float checkpoint after loading (the q8_0 layout, per 32 weights).
See flowengine/model/layers/quant_linear.py.

A 4-bit GPTQ / AWQ checkpoint (`quantization_config` in config.json, on any device)
loads its projections as packed `Int4Linear` layers, never dequantized whole
(flowengine/model/int4_loader.py, flowengine/model/layers/int4.py). An FP8 checkpoint
(compressed-tensors float-quantized, or "quant_method": "fp8") loads its projections as
`Fp8Linear` layers holding the checkpoint's E4M3 bytes and scales
(flowengine/model/fp8_loader.py).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from flowengine.distributed.pp_group import SINGLE_STAGE, PipelineStage
from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend, get_attn_backend
from flowengine.model.fp8_loader import Fp8Plan, checkpoint_fp8_config, place_fp8, swap_fp8_layers
from flowengine.model.fp8_loader import expected_names as fp8_expected_names
from flowengine.model.int4_loader import (
    Int4Plan,
    checkpoint_names,
    fill_dummy_int4,
    finalize_int4,
    place_int4,
    swap_int4_layers,
)
from flowengine.model.int4_loader import expected_names as int4_expected_names
from flowengine.model.layers.fp8 import fp8_supported
from flowengine.model.layers.int4 import Int4QuantConfig
from flowengine.model.layers.linear import QuantizableWeight
from flowengine.model.layers.quant_linear import PackedTensor
from flowengine.model.model_config import ModelConfig
from flowengine.model.models import model_class
from flowengine.model.models.llama import LlamaForCausalLM
from flowengine.model.weight_shards import WeightShard

logger = logging.getLogger(__name__)

# Dummy weights: small enough that 30+ layers keep activations finite in bf16.
_DUMMY_RANGE = 1e-3


def load_model(
    model_config: ModelConfig,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    gguf_file: str | None = None,
    attn_backend: AttentionBackend | None = None,
    seed: int = 0,
    tp: TensorParallelGroup = SINGLE_RANK,
    quantization: str | None = None,
    pp: PipelineStage = SINGLE_STAGE,
) -> LlamaForCausalLM:
    """Build the model for `model_config` and load its weights, in eval mode, no grads.

    Under tensor parallelism (`tp`), builds this rank's shard and reads only its slice
    of each tensor.

    Args:
        load_format: "auto" (safetensors in model_config.model_path, else a GGUF file
            there), "safetensors", "gguf" (dequantized from `gguf_file`, else the one
            .gguf in the model directory, else the file a converted directory came
            from) or "dummy" (uniform(-1e-3, 1e-3) weights, norm weights 1, from `seed`;
            each tensor is drawn whole from its own generator seeded by `seed` and its
            name, then sliced, so every tensor-parallel size gets the same model).
        dtype: parameter dtype. device: where parameters live.
        attn_backend: defaults to get_attn_backend(device).
        pp: the pipeline stage; the model keeps only the stage's layers (and the
            embedding / final norm and LM head on the first / last stage) and reads
            only their tensors (LlamaForCausalLM.keep_pipeline_stage).
        quantization: None (float weights); "fp8": after loading, every linear layer
            except the LM head becomes an E4M3 `Fp8Linear` (flowengine/model/layers/fp8.py);
            "gguf" (CPU): keep the GGUF file's Q4_0 / Q4_1 / Q8_0 blocks (load_format
            must resolve to "gguf"); "int8" (CPU): weight-only, quantized after loading;
            "gptq" / "awq": the checkpoint's own 4-bit format (also chosen when unset and
            config.json has a GPTQ / AWQ quantization_config). An FP8 checkpoint loads
            as FP8 with quantization unset or "fp8" (with load_format "dummy": random
            float weights quantized per channel).

    Raises:
        ValueError: unknown load_format or quantization, no weight files, a weight
            file that is not readable safetensors (truncated), checkpoint tensors that are missing / unexpected / of the wrong shape (listed in the
            message), quantization="fp8" on a device without FP8 GEMMs, "gguf" /
            "int8" off the CPU, or a quantization that disagrees with the checkpoint's
            quantization_config.
    """
    device = torch.device(device)
    if quantization not in (None, "fp8", "gguf", "int8", "gptq", "awq"):
        raise ValueError(f"unknown quantization {quantization!r}; supported: 'fp8', 'gguf', "
                         "'int8', 'gptq', 'awq'")
    fp8_ckpt = checkpoint_fp8_config(model_config)
    if fp8_ckpt is not None and quantization not in (None, "fp8"):
        raise ValueError(f"{model_config.model_path} is an FP8 checkpoint ({fp8_ckpt.method}); "
                         f"leave quantization unset (or 'fp8'), not {quantization!r}")
    int4 = None if fp8_ckpt is not None else _int4_config(model_config, quantization)
    if quantization in ("gguf", "int8") and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only; on "
                         f"{device.type} leave it unset (the weights are dequantized)")
    if attn_backend is None:
        attn_backend = get_attn_backend(device)
    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config, attn_backend, tp)
        if pp.size > 1:
            keep = getattr(model, "keep_pipeline_stage", None)
            if keep is None:
                raise ValueError(f"pipeline parallelism is not supported for "
                                 f"{model_config.architecture} models; serve it with "
                                 "pipeline_parallel_size 1")
            keep(pp.start_layer, pp.end_layer, pp.is_first, pp.is_last)
    model = model.to(dtype=dtype)
    fmt = _resolve_format(model_config.model_path, load_format, gguf_file)
    if quantization == "gguf" and fmt != "gguf":
        raise ValueError(
            f"quantization 'gguf' needs GGUF weights, but {model_config.model_path} loads "
            f"as {fmt!r}; pass the .gguf file (or use quantization 'int8')")
    names: set[str] = set()
    int4_plan: Int4Plan = {}
    if int4 is not None:
        if fmt not in ("safetensors", "dummy"):
            raise ValueError(f"{int4.method.upper()} checkpoints load from safetensors, not "
                             f"{fmt!r}")
        names = set() if fmt == "dummy" else checkpoint_names(
            safetensors_files(model_config.model_path))
        int4_plan = swap_int4_layers(model, int4, dtype, None if fmt == "dummy" else names, tp)
    fp8_plan: Fp8Plan = {}
    if fp8_ckpt is not None and fmt != "dummy":
        if fmt != "safetensors":
            raise ValueError(f"FP8 checkpoints load from safetensors, not {fmt!r}")
        if not fp8_supported(device):
            raise ValueError(f"this FP8 checkpoint needs FP8 GEMMs (CUDA compute capability "
                             f">= 8.9, or the CPU's float32 reference); {device} has none")
        fp8_plan = swap_fp8_layers(model, fp8_ckpt, dtype, checkpoint_names(
            safetensors_files(model_config.model_path)), device)
    expected = (model.expected_weight_names() | int4_expected_names(int4_plan, int4)
                | fp8_expected_names(fp8_plan, fp8_ckpt))
    packed: dict[str, list[tuple[QuantizableWeight, WeightShard]]] = {}
    if quantization == "gguf":
        gguf_file = gguf_file or _single_gguf(model_config.model_path)
        packed = _swap_packed_layers(model, gguf_file, dtype)
    model = model.to_empty(device=device)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    if fmt == "dummy":
        model.load_weights(dummy_weights(model, seed, device))
        fill_dummy_int4(model, seed)
    else:
        weights: Iterator[tuple[str, Any]]
        if fmt == "safetensors":
            weights = iter_safetensors(safetensors_files(model_config.model_path))
            placed_int4: set[str] = set()
            if int4 is not None:
                weights = place_int4(weights, int4_plan, int4, names, placed_int4)
            if fp8_plan:
                assert fp8_ckpt is not None
                weights = place_fp8(weights, fp8_plan, fp8_ckpt, placed_int4)
        else:
            from flowengine.model.gguf_loader import iter_gguf_tensors

            weights = iter_gguf_tensors(gguf_file or _single_gguf(model_config.model_path),
                                        frozenset(packed))
        placed: set[str] = set()
        loaded = model.load_weights(_place_packed(weights, packed, placed)) | placed
        if fmt == "safetensors":
            loaded |= placed_int4
        missing = expected - loaded
        if missing:
            raise ValueError(
                f"checkpoint {model_config.model_path} lacks {len(missing)} tensor(s) the "
                f"{model_config.architecture} config needs: {sorted(missing)[:20]}; the "
                "download may be incomplete or config.json may not match the weights"
            )
    if quantization == "int8":
        _quantize_int8(model)
    if int4 is not None:
        finalize_int4(model)
    model.requires_grad_(False)
    if quantization == "fp8" or (fp8_ckpt is not None and fmt == "dummy"):
        # (An FP8 checkpoint's config with dummy weights, for benchmarks: random float
        # weights quantized per output channel.)
        from flowengine.model.layers.fp8 import quantize_model_fp8_

        quantize_model_fp8_(model, device)
    return model.eval()


def _int4_config(model_config: ModelConfig, quantization: str | None
                 ) -> Int4QuantConfig | None:
    """The checkpoint's GPTQ / AWQ config when its layers load as packed int4; checks
    that `quantization` (None: from the checkpoint, as vLLM) agrees with it."""
    int4 = model_config.quantization_config
    if int4 is None:
        if quantization in ("gptq", "awq"):
            raise ValueError(
                f"quantization {quantization!r} needs a {quantization.upper()} checkpoint "
                f"(quantization_config in config.json); {model_config.model_path} has none")
        return None
    if quantization not in (None, int4.method):
        raise ValueError(
            f"{model_config.model_path} is a {int4.method.upper()} checkpoint; leave "
            f"quantization unset (or {int4.method!r}), not {quantization!r}")
    return int4


def _quantizable(model: torch.nn.Module) -> dict[str, QuantizableWeight]:
    """Parameter name ("...qkv_proj.weight") -> its layer, for every layer whose weight
    can stay quantized."""
    return {f"{name}.weight" if name else "weight": module
            for name, module in model.named_modules()
            if isinstance(module, QuantizableWeight) and module.quant_format is None}


def _swap_packed_layers(model: LlamaForCausalLM, gguf_file: str, dtype: torch.dtype
                        ) -> dict[str, list[tuple[QuantizableWeight, WeightShard]]]:
    """Give packed planes to every layer whose checkpoint tensors all share one packed
    GGUF format (a fused qkv of Q4_1 q/k and a Q8_0 v stays float); return
    checkpoint name -> the (layer, shard) pairs its packed blocks fill."""
    from flowengine.model.gguf_loader import gguf_packed_formats

    formats = gguf_packed_formats(gguf_file)
    layers = _quantizable(model)
    by_param: dict[str, list[WeightShard]] = {}
    for shard in model.weight_shards():
        if shard.param in layers:
            by_param.setdefault(shard.param, []).append(shard)
    targets: dict[str, list[tuple[QuantizableWeight, WeightShard]]] = {}
    kept: dict[str, int] = {}
    for param, shards in by_param.items():
        fmts = {formats.get(s.hf_name) for s in shards}
        if len(fmts) != 1 or None in fmts:
            continue
        (fmt,) = fmts
        if layers[param].weight.shape[1] % 32:
            continue
        layers[param].quantize_as(fmt, dtype)
        kept[fmt] = kept.get(fmt, 0) + 1
        for s in shards:
            targets.setdefault(s.hf_name, []).append((layers[param], s))
    logger.info("GGUF weights kept quantized: %s; %d layer(s) dequantized to %s",
                ", ".join(f"{n} {f}" for f, n in sorted(kept.items())) or "none",
                len(layers) - sum(kept.values()), str(dtype).removeprefix("torch."))
    return targets


def _place_packed(weights: Iterator[tuple[str, Any]],
                  targets: dict[str, list[tuple[QuantizableWeight, WeightShard]]],
                  placed: set[str]) -> Iterator[tuple[str, Any]]:
    """Copy the packed tensors into their layers' planes (recording their names in
    `placed`); pass every other tensor on to load_weights."""
    for name, tensor in weights:
        if not isinstance(tensor, PackedTensor):
            yield name, tensor
            continue
        for layer, shard in targets[name]:
            if tensor.shape != shard.full_shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tensor.shape} but the model built "
                    f"from config.json expects {shard.full_shape}")
            src = tensor if shard.length < 0 else tensor.narrow(shard.dim, shard.start,
                                                                 shard.length)
            qs, scales = layer.weight_qs, layer.weight_scales
            if shard.dim == 0 and shard.length >= 0:
                qs = qs.narrow(0, shard.dest_start, shard.length)
                scales = scales.narrow(0, shard.dest_start, shard.length)
            qs.copy_(src.qs)
            scales.copy_(src.scales)
            if shard.param.endswith(("embed_tokens.weight", "lm_head.weight")):
                # vocabulary padding rows of the last rank: weights 0
                layer.weight_scales[shard.length:].zero_()
                layer.weight_qs[shard.length:].zero_()
        placed.add(name)


def _quantize_int8(model: torch.nn.Module) -> None:
    """Online weight-only int8 of every linear layer (and of a tied embedding, which is
    also the LM head); an untied embedding stays float (it is only looked up)."""
    tied = getattr(model, "lm_head", "absent") is None
    count = 0
    for param, layer in _quantizable(model).items():
        if param.endswith("embed_tokens.weight") and not tied:
            continue
        if layer.weight.shape[1] % 32:
            continue
        layer.quantize_from_float("q8_0")
        count += 1
    logger.info("int8 weight-only quantization: %d layer(s) in the q8_0 layout", count)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's *.safetensors files, in order.

    Uses model.safetensors.index.json when present (so that extra files such as
    Mistral's consolidated.safetensors are ignored). Raises ValueError when none exist.
    """
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(
        p for p in glob.glob(os.path.join(model_dir, "*.safetensors"))
        if not os.path.basename(p).startswith("consolidated")
    )
    if not files:
        raise ValueError(
            f"no *.safetensors files in {model_dir}; FlowEngine loads safetensors or GGUF "
            "weights (re-save .bin checkpoints with save_pretrained(safe_serialization=True))"
        )
    return files


def open_safetensors(path: str) -> Any:
    """safetensors' `safe_open(path)` (a context manager over the memory-mapped file).
    Raises ValueError for a file that is not safetensors or is truncated."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}); the download may be "
            "incomplete: fetch it again"
        ) from err


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: safetensors' `get_slice` handles, valid until the next
    item; indexing one reads just that part of the tensor (memory-mapped), so a
    tensor-parallel rank reads only its shard and a checkpoint is never held twice.
    Raises ValueError for an unreadable file."""
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def _resolve_format(model_dir: str, load_format: str, gguf_file: str | None) -> str:
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(
            f"load_format must be 'auto', 'safetensors', 'gguf' or 'dummy', got {load_format!r}"
        )
    if load_format != "auto":
        return load_format
    if gguf_file is not None:
        return "gguf"
    if glob.glob(os.path.join(model_dir, "*.safetensors")):
        return "safetensors"
    if glob.glob(os.path.join(model_dir, "*.gguf")):
        return "gguf"
    raise ValueError(
        f"no *.safetensors or *.gguf weights in {model_dir}; pass a directory with "
        "safetensors weights, a GGUF file, or load_format='dummy'"
    )


def _single_gguf(model_dir: str) -> str:
    from flowengine.model.gguf_convert import conversion_source

    files = sorted(glob.glob(os.path.join(model_dir, "*.gguf")))
    source = conversion_source(model_dir)
    if not files and source is not None:
        return source  # a directory FlowEngine converted from a GGUF file
    if len(files) != 1:
        raise ValueError(
            f"load_format='gguf' needs exactly one .gguf file in {model_dir}, found "
            f"{len(files)}; pass the file itself as the model"
        )
    return files[0]


def dummy_weights(model: LlamaForCausalLM, seed: int, device: torch.device
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Random checkpoint tensors, whole, for every tensor `model` reads: norm weights 1,
    everything else uniform(-1e-3, 1e-3) float32 from a generator on `device` seeded by
    `seed` and the tensor's name (so a tensor does not depend on the others, nor on the
    tensor-parallel size that slices it)."""
    seen: set[str] = set()
    for shard in model.weight_shards():
        if shard.hf_name in seen:  # a fused tensor feeding several shards: once
            continue
        seen.add(shard.hf_name)
        if shard.hf_name.endswith("norm.weight"):
            yield shard.hf_name, torch.ones(shard.full_shape, device=device)
            continue
        generator = torch.Generator(device=device)
        generator.manual_seed(seed * 1_000_003 + zlib.crc32(shard.hf_name.encode()))
        values = torch.empty(shard.full_shape, dtype=torch.float32, device=device)
        yield shard.hf_name, values.uniform_(-_DUMMY_RANGE, _DUMMY_RANGE, generator=generator)
