"""The quantized CPU decode path that runs every decoder layer in one C call
(flowengine/model/layers/cpu_fused.py, `_cpu_ops.decode_layers`) and the thread pool of
its matmuls, against the per-operator path they replace.

- Greedy ids of the default model's Q4_1 GGUF (1, 3, 5 and 20 requests decoding together)
  equal the per-operator path's, logprobs within 3e-5 (same C bodies; the silu's exp
  differed, relative error ~2e-7, until the per-operator path took the same C silu in
  session 41; measured at most 5.5e-6 while prefill dequantized,
  1.37e-5 since prefill runs the kernel, whose float32 sums differ from torch's GEMM in
  the last bits, and 12 steps x 30 layers amplify the exp's difference more or less),
  and the fused path really ran (a counter).
- A quantized matmul gives bit-identical outputs with 1, 2 and 3 threads (every weight
  row is computed by the same code whichever thread claims its chunk).
"""

from __future__ import annotations

import pytest
import torch

from flowengine import LLM, SamplingParams
from flowengine.model.gguf_convert import conversion_source
from flowengine.model.layers import cpu_fused
from flowengine.model.layers.quant_linear import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(), reason="flowengine._cpu_ops not built")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_matmul_same_bits_for_any_thread_count(fmt, rows):
    from test_quant_kernels import _gguf_weight

    w, _ = _gguf_weight(fmt, 1000, 576, seed=rows)  # 16 chunks of 64 rows, a short last one
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(0))
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(w.matmul(x))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"),
                                      ("float32", "float16")])
def test_fused_decode_equals_per_operator_path(default_model_path, monkeypatch, dtype, kv):
    """The fused decode layers against the per-operator path, same tokens and logprobs
    within float32 rounding; with `--dtype bfloat16` (on a CPU with native bf16: a bf16
    KV cache and, with AMX, the AMX body from 4 rows) or `--kv-cache-dtype float16` (K/V
    rounded by the same C code on both paths) on both paths alike."""
    gguf = conversion_source(default_model_path)
    assert gguf is not None and gguf.endswith(".gguf")
    llm = LLM(gguf, quantization="gguf", enable_prefix_caching=False, cpu_threads=2,
              max_model_len=256, dtype=dtype, kv_cache_dtype=kv, placement="inproc")
    # float32: float32 rounding (and, before session 41, the silu's exp). bf16 products and
    # cache: such a difference moves values across bf16 rounding boundaries (2^-8
    # relative) and grows as a bf16 model's noise does (measured 3.4e-3; the bf16 path
    # against float32 transformers: 0.045, test_quantized_greedy.py). The prompts and
    # weights are fixed, so the tokens are the same run to run on a CPU.
    tol = 0.05 if llm.engine.executor.runner.kv_caches[0].dtype == torch.bfloat16 else 3e-5
    assert kv == "auto" or llm.engine.executor.runner.kv_caches[0].dtype == torch.float16
    calls = {"fused": 0}
    real = cpu_fused.decode_forward

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["fused"] += out is not None
        return out

    monkeypatch.setattr(cpu_fused, "decode_forward", counting)
    model = llm.engine.executor.runner.model.model
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [1 + (7 * i + 3 * j) % 4000 for j in range(20 + 5 * (i % 5))]}
               for i in range(20)]
    # 20 requests: a decode step of more than 16 rows (the fused path's old limit) whose
    # matmuls run the float32 body in row tiles
    for batch in (prompts[:1], prompts[:3], prompts[:5], prompts):
        monkeypatch.setattr(cpu_fused, "ENABLED", True)
        before = calls["fused"]
        fused = llm.generate(batch, params, use_tqdm=False)
        assert calls["fused"] - before >= 11  # every decode step of the batch
        assert model._cpu_fused_plan[1]
        monkeypatch.setattr(cpu_fused, "ENABLED", False)
        before = calls["fused"]
        ref = llm.generate(batch, params, use_tqdm=False)
        assert calls["fused"] == before
        for a, b in zip(fused, ref, strict=True):
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            assert ta == tb
            for step, token in enumerate(ta):
                diff = abs(a.outputs[0].logprobs[step][token].logprob
                           - b.outputs[0].logprobs[step][token].logprob)
                assert diff <= tol, f"step {step}: logprob differs by {diff:.2e}"
