"""FP8 checkpoints load directly (issue 14, item 1): compressed-tensors float-quantized
(per-channel and per-tensor weight scales; dynamic per-token and static activations)
and vLLM's "quant_method": "fp8" (128 x 128 block scales `weight_scale_inv`, and
per-tensor `weight_scale` + `input_scale`), written by scripts/save_fp8_checkpoint.py.

On the CPU: every decoder linear layer becomes an `Fp8Linear` holding the checkpoint's
E4M3 bytes unchanged (fused q/k/v and gate/up parts stacked), its dequantized weight
equals float(E4M3) x scale exactly, and greedy decoding matches a float32 transformers
model built from those dequantized weights (steps of <= 64 tokens use the weights as
they are, so the logits agree to float32 rounding: atol 1e-4). CI decodes two layouts;
FLOWENGINE_FP8_ALL_LAYOUTS=1 decodes all four.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.fp8_loader import Fp8CheckpointConfig, swap_fp8_layers
from flowengine.model.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, dequantize_fp8, fp8_linear
from flowengine.model.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).parents[1] / "executor"))
from runner_driver import GreedyDriver  # noqa: E402
from save_fp8_checkpoint import LAYOUTS, STATIC_INPUT_SCALE, save_fp8_checkpoint  # noqa: E402

PROMPTS = {"short": [5, 17, 3], "medium": list(range(40, 70)), "one": [9]}
# Decoding against the reference: one layout of each format in CI (their load checks run
# for every layout); FLOWENGINE_FP8_ALL_LAYOUTS=1 decodes all four.
DECODE_LAYOUTS = (LAYOUTS if os.environ.get("FLOWENGINE_FP8_ALL_LAYOUTS") == "1"
                  else ("ct-channel", "fp8-block"))
NUM_NEW = 6
ATOL = 1e-4
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _scale_of(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    if f"{prefix}.weight_scale_inv" in tensors:
        return tensors[f"{prefix}.weight_scale_inv"].float()
    scale = tensors[f"{prefix}.weight_scale"].float()
    rows = tensors[f"{prefix}.weight"].shape[0]
    return scale.reshape(1).expand(rows) if scale.numel() == 1 else scale.reshape(rows)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_loads_exactly_and_decodes_like_its_dequantized_weights(
        layout: str, tmp_path: Path) -> None:
    tensors = save_fp8_checkpoint(str(tmp_path), layout)
    config = ModelConfig.from_pretrained(str(tmp_path))
    assert isinstance(config.quantization_config, Fp8CheckpointConfig)
    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=64),
                         torch.device("cpu"), torch.float32)
    modules = dict(runner.model.named_modules())
    fp8_layers = {n: m for n, m in modules.items() if isinstance(m, Fp8Linear)}
    assert len(fp8_layers) == 4 * 2, sorted(fp8_layers)  # qkv, o, gate_up, down x 2
    dequantized: dict[str, torch.Tensor] = {}
    for name, layer in fp8_layers.items():
        prefix, _, fused = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in FUSED[fused]]
        # The checkpoint's E4M3 bytes, unchanged, parts stacked by rows.
        want = torch.cat([tensors[f"{p}.weight"] for p in parts])
        assert layer.weight.dtype == FP8_DTYPE
        assert torch.equal(layer.weight.view(torch.uint8), want.view(torch.uint8)), name
        deq = layer.dequantized_weight()
        row = 0
        for p in parts:
            part = dequantize_fp8(tensors[f"{p}.weight"], _scale_of(tensors, p))
            assert torch.equal(deq[row:row + part.shape[0]], part), (name, p)
            dequantized[f"{p}.weight"] = part
            row += part.shape[0]
        if layout.endswith("static"):
            assert layer.input_scale is not None
            assert torch.equal(layer.input_scale.reshape(()),
                               torch.tensor(STATIC_INPUT_SCALE, dtype=torch.float32))
        else:
            assert layer.input_scale is None
    if layout not in DECODE_LAYOUTS:
        return
    driver = GreedyDriver(runner, token_budget=16, seed=1)
    seqs = driver.generate(PROMPTS, NUM_NEW)
    ref = _reference(tmp_path, tensors, dequantized)
    worst = 0.0
    for rid, prompt in PROMPTS.items():
        seq = prompt + seqs[rid].outputs
        with torch.no_grad():
            logits = ref(torch.tensor([seq])).logits[0, len(prompt) - 1:len(seq) - 1]
        assert logits.argmax(-1).tolist() == seqs[rid].outputs, (layout, rid)
        worst = max(worst, (torch.stack(seqs[rid].logits) - logits).abs().max().item())
    print(f"{layout}: max |delta logit| {worst:.2e} (atol {ATOL})")
    assert worst <= ATOL, layout


def _reference(path: Path, tensors: dict[str, torch.Tensor],
               dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' Llama in float32 with the checkpoint's dequantized weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(str(path))
    cfg.quantization_config = None
    model = LlamaForCausalLM(cfg).float()
    state = {n: t for n, t in tensors.items()
             if not n.endswith(("weight_scale", "weight_scale_inv", "input_scale"))}
    state.update(dequantized)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


def test_static_input_scale_quantizes_a_many_token_gemm_with_it(tmp_path: Path) -> None:
    # 80 rows (> W8A16_MAX_M): W8A8, x quantized with the checkpoint's scale, not per token.
    tensors = save_fp8_checkpoint(str(tmp_path), "ct-tensor-static", layers=1)
    config = ModelConfig.from_pretrained(str(tmp_path))
    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=64),
                         torch.device("cpu"), torch.float32)
    layer = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Fp8Linear) and layer.input_scale is not None
    torch.manual_seed(0)
    x = torch.randn(80, layer.in_features)
    s = torch.tensor(STATIC_INPUT_SCALE, dtype=torch.float32)
    xq = (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s
    w = dequantize_fp8(tensors["model.layers.0.mlp.down_proj.weight"],
                       _scale_of(tensors, "model.layers.0.mlp.down_proj"))
    assert torch.allclose(layer(x), xq @ w.T, atol=1e-5, rtol=0)
    per_token = fp8_linear(x, layer.weight, layer.weight_scale)
    assert not torch.allclose(per_token, xq @ w.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format 'pack-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}},
     "weight strategy 'group' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
     "weights must be 8-bit float"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
])
def test_unsupported_fp8_configs_are_named(qc: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8CheckpointConfig.from_hf(qc)


def test_block_scaled_checkpoint_is_refused_on_cuda_before_loading(tmp_path: Path) -> None:
    from flowengine.model.loader import model_class

    tensors = save_fp8_checkpoint(str(tmp_path), "fp8-block", layers=1)
    config = ModelConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = model_class(config.architecture)(config, None)
    with pytest.raises(ValueError, match="no block-scaled FP8 GEMM on cuda"):
        swap_fp8_layers(model, config.quantization_config, torch.float32, set(tensors),
                        torch.device("cuda"))
