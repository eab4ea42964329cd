"""Build a model and fill its weights: safetensors by name, GGUF, or random ("dummy").

The model is built on the meta device (no memory, no random init), materialized
uninitialized on the target device in the target dtype, then every parameter is
written exactly once from the checkpoint (gpt-fast's recipe). Safetensors files are
read tensor by tensor through memory maps, so a checkpoint is never held twice.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend, get_attn_backend
from flowengine.model.model_config import ModelConfig
from flowengine.model.models import model_class
from flowengine.model.models.llama import LlamaForCausalLM

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
        quantization: None, or "fp8": after loading, every linear layer except the LM
            head becomes an E4M3 `Fp8Linear` (flowengine/model/layers/fp8.py).

    Raises:
        ValueError: unknown load_format or quantization, no weight files, checkpoint
            tensors that are missing / unexpected / of the wrong shape (listed in the
            message), or quantization="fp8" on a device without FP8 GEMMs.
    """
    device = torch.device(device)
    if attn_backend is None:
        attn_backend = get_attn_backend(device)
    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config, attn_backend, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    fmt = _resolve_format(model_config.model_path, load_format, gguf_file)
    if fmt == "dummy":
        model.load_weights(dummy_weights(model, seed, device))
    else:
        weights: Iterator[tuple[str, Any]]
        if fmt == "safetensors":
            weights = iter_safetensors(safetensors_files(model_config.model_path))
        else:
            from flowengine.model.gguf_loader import iter_gguf_tensors

            weights = iter_gguf_tensors(gguf_file or _single_gguf(model_config.model_path))
        loaded = model.load_weights(weights)
        missing = model.expected_weight_names() - loaded
        if missing:
            raise ValueError(
                f"checkpoint {model_config.model_path} lacks {len(missing)} tensor(s) the "
                f"{model_config.architecture} config needs: {sorted(missing)[:20]}; the "
                "download may be incomplete or config.json may not match the weights"
            )
    model.requires_grad_(False)
    if quantization == "fp8":
        from flowengine.model.layers.fp8 import quantize_model_fp8_

        quantize_model_fp8_(model, device)
    elif quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}; supported: 'fp8'")
    return model.eval()


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


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: safetensors' `get_slice` handles, valid until the next
    item; indexing one reads just that part of the tensor (memory-mapped), so a
    tensor-parallel rank reads only its shard and a checkpoint is never held twice."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
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
