"""W4A16 on the GPU: the Triton GEMM at Llama-3.1-8B's full shapes against the float32
torch reference, and a GPTQ / AWQ checkpoint end to end on CUDA.

Kernel tolerance as tests/kernels/test_kernel_w4a16.py (per element: the weight tile
rounded to bf16 before the dot, float32 accumulation, one output rounding):
|y - y_ref| <= eps * (|x| @ |W|^T) + eps * |y_ref|, eps = 2**-7 for bf16.
Model: the quantized SmolLM2-shaped checkpoints of tests/quantization in float32 on
CUDA (the kernel's IEEE float32 dot) must give transformers' greedy ids over the
dequantized weights, logits within 1e-3.
Run: pytest -s tests/gpu/test_w4a16_gpu.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

from flowengine.kernels.w4a16 import w4a16_gemm, w4a16_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))

pytestmark = pytest.mark.gpu

# Llama-3.1-8B projections (K, N): qkv, o, gate_up, down.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_full_shapes(m: int, k: int, n: int, act_order: bool) -> None:
    from test_kernel_w4a16 import _abs_bound, _random_layer

    device = torch.device("cuda")
    qweight, scales, qzeros, g_idx = _random_layer(n, k, 128, act_order, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ref = w4a16_reference(x, qweight, scales, qzeros, g_idx, 128)
    out = w4a16_gemm(x, qweight, scales, qzeros, g_idx, 128)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    bound = _abs_bound(x, qweight, scales, qzeros, g_idx, 128, torch.bfloat16, ref)
    err = (out.float() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("case", ["gptq-asym-actorder", "awq-g128", "gptq-sym-g128"])
def test_int4_checkpoint_on_cuda(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    import test_int4_checkpoints as t
    from quantize_int4 import quantize_checkpoint

    from flowengine.config import CacheConfig
    from flowengine.executor.model_runner import ModelRunner
    from flowengine.model.layers.int4 import Int4Linear
    from flowengine.model.model_config import ModelConfig

    float_dir = t.save_float_model(tmp_path_factory.mktemp("float"))
    out_dir = str(tmp_path_factory.mktemp(case))
    kwargs, _ = t.CASES[case]
    state = quantize_checkpoint(float_dir, out_dir, **kwargs)
    runner = ModelRunner(ModelConfig.from_pretrained(out_dir),
                         CacheConfig(block_size=16, num_blocks=64), torch.device("cuda"),
                         torch.float32)
    assert any(isinstance(m, Int4Linear) and m.qweight.is_cuda for m in runner.model.modules())
    driver = t.GreedyDriver(runner, token_budget=16, seed=1)
    seqs = driver.generate(t.PROMPTS, t.NUM_NEW)
    ref = t._reference(float_dir, state)
    for rid, prompt in t.PROMPTS.items():
        out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=t.NUM_NEW,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert seqs[rid].outputs == out.sequences[0, len(prompt):].tolist(), (case, rid)
        for ours, theirs in zip(seqs[rid].logits, out.logits, strict=True):
            torch.testing.assert_close(ours.float().cpu(), theirs[0].float(), atol=1e-3,
                                       rtol=0)
