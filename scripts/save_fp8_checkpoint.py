"""Write a small random Llama as an FP8 checkpoint in one of the layouts FlowEngine loads
(flowengine/model/fp8_loader.py), for tests and for trying the loader by hand.

    python scripts/save_fp8_checkpoint.py OUT_DIR --layout ct-channel [--hidden 256]

Layouts (each linear layer of the decoder becomes float8_e4m3fn with the scales its
format stores; embeddings, norms and the LM head stay float32):

    ct-channel         compressed-tensors float-quantized, per-channel weight_scale
                       [out, 1], dynamic per-token activations (llm-compressor FP8_DYNAMIC)
    ct-tensor-static   compressed-tensors, per-tensor weight_scale [1], static per-tensor
                       input_scale [1] (llm-compressor FP8)
    fp8-block          "quant_method": "fp8", weight_block_size [128, 128],
                       weight_scale_inv [ceil(out/128), ceil(in/128)] (DeepSeek-V3, Qwen3-FP8)
    fp8-tensor-static  "quant_method": "fp8", activation_scheme static, per-tensor
                       weight_scale and input_scale as scalars (AutoFP8)

Each scale is the largest |value| of its row / tensor / block over 448, so the E4M3
values use the whole range (as the quantizers that write these formats do).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LAYOUTS = ("ct-channel", "ct-tensor-static", "fp8-block", "fp8-tensor-static")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The static activation scale written for every layer (a plausible value for the random
# model's activations, which stay within a few units).
STATIC_INPUT_SCALE = 4.0 / FP8_MAX


def _quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one float32 [out, in] weight in `layout` (leaf name ->
    tensor, "weight" included)."""
    w = w.float()
    if layout == "ct-channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return {"weight": _quantize(w, scale), "weight_scale": scale}
    if layout in ("ct-tensor-static", "fp8-tensor-static"):
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        shape = (1,) if layout.startswith("ct") else ()
        return {"weight": _quantize(w, scale), "weight_scale": scale.reshape(shape),
                "input_scale": torch.full(shape, STATIC_INPUT_SCALE)}
    if layout == "fp8-block":
        out_f, in_f = w.shape
        nb_o, nb_i = -(-out_f // 128), -(-in_f // 128)
        padded = torch.zeros(nb_o * 128, nb_i * 128)
        padded[:out_f, :in_f] = w
        blocks = padded.view(nb_o, 128, nb_i, 128)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb_o, nb_i]
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_f, :in_f]
        return {"weight": _quantize(w, full), "weight_scale_inv": scale}
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def quantization_config(layout: str) -> dict:
    if layout.startswith("ct"):
        static = layout == "ct-tensor-static"
        acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                 "symmetric": True} if static else
                {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                 "symmetric": True})
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "input_activations": acts,
                    "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                "dynamic": False,
                                "strategy": "tensor" if static else "channel"}}}}
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    return {"quant_method": "fp8", "activation_scheme": "static"}


def save_fp8_checkpoint(path: str, layout: str, *, hidden: int = 256,
                        intermediate: int = 512, layers: int = 2, heads: int = 4,
                        kv_heads: int = 2, vocab: int = 384, seed: int = 0) -> dict:
    """Save a random LlamaForCausalLM with these shapes at `path` in `layout`; returns
    the checkpoint's tensors (name -> tensor, as written)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in _LINEARS:
            for q_leaf, q in quantize_weight(value, layout).items():
                tensors[f"{prefix}.{q_leaf}"] = q.contiguous()
        else:
            tensors[name] = value.float().contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config["quantization_config"] = quantization_config(layout)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_fp8_checkpoint(args.out_dir, args.layout, hidden=args.hidden,
                        intermediate=args.intermediate, layers=args.layers, seed=args.seed)
    print(f"wrote {args.layout} FP8 checkpoint to {args.out_dir}")


if __name__ == "__main__":
    main()
