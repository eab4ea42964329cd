"""GPTQ / AWQ format handling without a model: packing round trips (exact), the
conversion of each checkpoint layout to the canonical one, `quantization_config`
parsing and the loader's errors for checkpoints it cannot run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flowengine.model.layers.int4 import (
    AWQ_PACK_ORDER,
    Int4Linear,
    Int4QuantConfig,
    dequantize,
    pack_cols,
    pack_rows,
    to_canonical,
    unpack_cols,
    unpack_rows,
)

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from quantize_int4 import awq_tensors, dequantize_rtn, gptq_tensors, quantize_rtn  # noqa: E402


def test_pack_round_trips_and_bit_positions() -> None:
    q = torch.randint(0, 16, (64, 24), dtype=torch.uint8)
    assert torch.equal(unpack_rows(pack_rows(q)), q)
    assert torch.equal(unpack_cols(pack_cols(q)), q)
    assert torch.equal(unpack_cols(pack_cols(q, AWQ_PACK_ORDER), AWQ_PACK_ORDER), q)
    # GPTQ: row 8r + i at bits 4i of word r; AWQ: nibble i holds column ORDER[i].
    one = torch.zeros(8, 8, dtype=torch.uint8)
    one[3, 0] = 0xA
    assert pack_rows(one)[0, 0].item() == 0xA << 12
    assert pack_cols(one.t().contiguous())[0, 0].item() == 0xA << 12
    # column 3 sits in nibble 5 (AWQ_PACK_ORDER[5] == 3)
    assert pack_cols(one.t().contiguous(), AWQ_PACK_ORDER)[0, 0].item() == 0xA << 4 * 5
    # a nibble 0xF in the top position is a negative int32 word
    top = torch.zeros(8, 1, dtype=torch.uint8)
    top[7, 0] = 0xF
    assert pack_rows(top).item() == -(1 << 28)


@pytest.mark.parametrize(("method", "sym", "act_order", "fmt"), [
    ("gptq", True, False, "gptq"), ("gptq", False, True, "gptq"),
    ("gptq", False, False, "gptq_v2"), ("awq", False, False, None),
])
def test_checkpoint_layouts_convert_to_the_same_weights(method: str, sym: bool,
                                                        act_order: bool, fmt: str | None) -> None:
    n, k, gs = 40, 256, 64
    w = torch.randn(n, k)
    perm = torch.randperm(k) if act_order else None
    parts = quantize_rtn(w, gs, sym, perm, min_zero=1 if fmt == "gptq" else 0)
    tensors = (awq_tensors(parts) if method == "awq" else gptq_tensors(parts, fmt == "gptq"))
    cfg = Int4QuantConfig.from_hf({"quant_method": method, "bits": 4, "group_size": gs,
                                   "desc_act": act_order, "sym": sym,
                                   **({"checkpoint_format": fmt} if fmt else {})})
    qweight, zeros, scales, g_idx = to_canonical(cfg, tensors, k)
    assert (g_idx is not None) == act_order
    got = dequantize(qweight, zeros, scales, g_idx, gs)
    assert torch.equal(got, dequantize_rtn(parts))
    # RTN error: half a step inside the grid; its ends (z rounded to an integer, s to
    # float16; symmetric GPTQ's q <= 15 = z + 7) clamp a group's extreme weights by up
    # to one step. Most weights sit inside.
    step = scales.float()[(torch.arange(k) // gs) if g_idx is None else g_idx.long()].t()
    err = (got - w).abs()
    assert bool((err <= step + 1e-6).all())
    assert (err <= 0.5 * step + 1e-6).float().mean().item() > 0.95


def _int16_body(rows: int) -> bool:
    from flowengine.model.layers.quant_linear import kernels_available

    if not kernels_available():
        return False
    from flowengine import _cpu_ops

    return "int16" in _cpu_ops.linear_path(rows)


def test_int4_linear_cpu_paths_are_exact() -> None:
    # Q4_1 repack (+ rounding correction) and the tiled fallback against (q - z) * s.
    n = 48
    # (K, group size, act-order, runs the Q4_1 kernels): K 200 is not 32-aligned.
    for k, gs, act_order, q4_1 in ((192, 64, True, True), (192, 96, False, True),
                                   (192, 48, True, False), (200, 64, False, False)):
        w = torch.randn(n, k)
        parts = quantize_rtn(w, gs, False, torch.randperm(k) if act_order else None)
        cfg = Int4QuantConfig("gptq", gs, act_order, False, 0)
        qweight, zeros, scales, g_idx = to_canonical(cfg, gptq_tensors(parts, False), k)
        layer = Int4Linear(k, n, True, gs, act_order, torch.float32)
        layer.qweight.copy_(qweight)
        layer.qzeros.copy_(zeros)
        layer.scales.copy_(scales)
        if act_order:
            layer.g_idx.copy_(g_idx)
        layer.bias.data.normal_()
        ref_w = dequantize_rtn(parts)
        layer.finalize()
        assert (layer._cpu is not None) == q4_1
        for m in (1, 5, 40):  # the fused kernel (<= 16 rows) and the dequantized GEMM
            x = torch.randn(m, k)
            want = torch.nn.functional.linear(x.double(), ref_w.double(),
                                              layer.bias.double())
            # the exact weights: float32 sums; the AVX2 int16 bodies (1 and 4+ rows,
            # CPUs without AVX-512) round x to 16 bits per 32-value block (measured 1.5e-3)
            atol = 4e-3 if q4_1 and _int16_body(m) else 2e-5
            torch.testing.assert_close(layer(x).double(), want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize(("qc", "match"), [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemm"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "multiple of 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "bitsandbytes"}, "gptq"),
])
def test_unsupported_quantization_configs_are_clear_errors(qc: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Int4QuantConfig.from_hf(qc)


def test_loader_errors(tmp_path: Path) -> None:
    from flowengine.model.loader import load_model
    from flowengine.model.model_config import ModelConfig

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                   "zero_point": True, "version": "gemm"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="AWQ checkpoint; leave"):
        load_model(config, "dummy", quantization="int8")
    model = load_model(config, "dummy")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4
    float_cfg = ModelConfig.from_pretrained(str(tmp_path)).__class__(
        **{**config.__dict__, "quantization_config": None})
    with pytest.raises(ValueError, match="needs a GPTQ checkpoint"):
        load_model(float_cfg, "dummy", quantization="gptq")
