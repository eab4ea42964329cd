"""Greedy decoding of the quantized CPU paths against Hugging Face transformers.

The 16 engine-core prompts (tests/engine/engine_prompts.py), 24 greedy tokens each:
- `quantization="gguf"` on the default model's Q4_1 GGUF file against transformers in
  float32 on the same weights dequantized (the converted default model directory);
- `quantization="int8"` against transformers with every linear weight replaced by its
  int8 round trip (quantize_q8_0, then dequantized);
- `dtype="bfloat16"` (float checkpoint) against transformers in float32.
- `dtype="float32"` with the GGUF weights (a float32 KV cache instead of the default
  float16 one), as the first.
transformers runs teacher-forced on the engine's own continuation, so every step is
compared on the same prefix: the engine's token must be transformers' argmax, except at
a near-tie (top-two logit gap below NEAR_TIE, recorded and counted), and the engine's
logprob of its token must be within LOGPROB_TOL of transformers'.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

import flowengine.model.layers.quant_linear as ql
from flowengine import LLM, SamplingParams
from flowengine.model.gguf_convert import conversion_source
from flowengine.model.layers.cpu_kernels import KV_FORMATS
from flowengine.model.layers.quant_linear import QuantizedWeight, kernels_available, quantize_q8_0

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels_available(), reason="flowengine._cpu_ops not built")]

_spec = importlib.util.spec_from_file_location(
    "engine_prompts", Path(__file__).parents[1] / "engine" / "engine_prompts.py")
_prompts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_prompts)
PROMPTS = _prompts.PROMPTS

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _quantized_logprob_tol() -> float:
    """Float32 dot products in another order than transformers': logprobs agree to ~1e-5
    (measured 1.3e-5-2.6e-5), so 1e-4. On a CPU with AVX2 and no AVX-512, matmuls of 4
    or more activation rows (these batched runs) take the int16 body: each 32-value
    block of the activations rounded to multiples of max|x_block| / 32767 (1.5e-5 of
    its largest value), which measured 1.9e-3-3.1e-3 here (the int8 round trip, the
    Q4_1 file), so 1e-2; greedy ids still equal transformers' at every step."""
    from flowengine import _cpu_ops

    return 1e-2 if _cpu_ops.linear_path(4) == "avx2-int16-panels" else 1e-4


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def _compare(llm: LLM, hf, prompt_ids, near_tie: float, logprob_tol: float) -> dict:
    """Run the engine; check every step against teacher-forced transformers. Returns
    counts (steps, near_ties) and the largest logprob difference."""
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY,
                        use_tqdm=False)
    steps = ties = 0
    worst = 0.0
    for ids, out in zip(prompt_ids, outs, strict=True):
        gen = out.outputs[0].token_ids
        assert len(gen) == MAX_TOKENS
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + gen[:-1]])).logits[0, len(ids) - 1:].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(gen):
            steps += 1
            top = logits[step].topk(2)
            if token != int(top.indices[0]):
                gap = float(top.values[0] - logits[step, token])
                assert gap < near_tie, (
                    f"prompt {PROMPTS[prompt_ids.index(ids)][:30]!r} step {step}: engine chose "
                    f"{token}, transformers {int(top.indices[0])} (logit gap {gap:.2e})")
                ties += 1
            mine = out.outputs[0].logprobs[step][token].logprob
            worst = max(worst, abs(mine - float(logprobs[step, token])))
    assert worst <= logprob_tol, f"logprob differs by {worst:.2e} > {logprob_tol}"
    return {"steps": steps, "near_ties": ties, "worst_logprob_diff": worst}


def test_gguf_q4_1_equals_transformers_on_dequantized_weights(default_model_path, hf_model,
                                                               prompt_ids):
    """The defaults (`--dtype auto`): float32 activations over a float16 KV cache (vLLM's
    GGUF dtype, llama.cpp's cache type): every K/V value rounded to float16 (11
    significant bits: within 2^-12 of itself) as it is written, widened exactly as
    attention reads it. Greedy ids equal transformers' at every step with no near-tie
    needed; logprobs measured within 6.9e-3 with the int16 body (3.1e-3 over a float32
    cache), so 2e-2."""
    gguf = conversion_source(default_model_path)
    assert gguf is not None and gguf.endswith(".gguf")
    llm = LLM(gguf, quantization="gguf", enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    assert runner.kv_caches[0].dtype == torch.float16
    heads = [m.weight for m in runner.model.modules() if hasattr(m, "weight_qs")]
    assert len(heads) == 30 * 4 + 1  # qkv, o, gate_up, down per layer; tied embedding
    assert all(isinstance(w, QuantizedWeight) for w in heads)
    stats = _compare(llm, hf_model, prompt_ids, near_tie=1e-3, logprob_tol=2e-2)
    assert stats["steps"] == 16 * MAX_TOKENS
    # Prompt logprobs (every prompt token, unlikely ones included): measured up to
    # 8.0e-3 here (median 5e-6; 1.47e-2 over a float32 cache with the int16 body).
    tol = 3e-2
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    worst = 0.0
    for ids, out in zip(prompt_ids, outs, strict=True):
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            mine = out.prompt_logprobs[pos][ids[pos]].logprob
            worst = max(worst, abs(mine - float(ref[pos - 1, ids[pos]])))
    assert worst <= tol, f"prompt logprob differs by {worst:.2e} > {tol}"


def test_int8_equals_transformers_on_round_tripped_weights(default_model_path, hf_model,
                                                           prompt_ids):
    llm = LLM(default_model_path, quantization="int8", enable_prefix_caching=False)
    hf = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) or name.endswith("embed_tokens"):
                packed = quantize_q8_0(module.weight)
                module.weight.copy_(QuantizedWeight("q8_0", packed.qs, packed.scales).dequantize())
    stats = _compare(llm, hf, prompt_ids[:8], near_tie=1e-3, logprob_tol=_quantized_logprob_tol())
    assert stats["steps"] == 8 * MAX_TOKENS


def test_bfloat16_tracks_float32_transformers(default_model_path, hf_model, prompt_ids):
    # bfloat16 rounds every activation to 8 bits of mantissa: greedy ids follow
    # float32 transformers except where its top two logits are within 0.25, and
    # logprobs within 0.5. One bf16 step of a logit between 16 and 32 is 0.125, so 0.5 is
    # four steps after 30 layers of rounding. torch's bf16 kernels differ by CPU: the
    # worst logprob difference measured 0.42 on an AMD EPYC host (avx512_bf16) with the
    # same engine code that measured under 0.25 on an earlier host (docs/benchmarks.md).
    llm = LLM(default_model_path, dtype="bfloat16", enable_prefix_caching=False)
    stats = _compare(llm, hf_model, prompt_ids[:8], near_tie=0.25, logprob_tol=0.5)
    assert stats["steps"] == 8 * MAX_TOKENS


def test_gguf_bfloat16_float32_activations_bf16_products_and_kv(default_model_path, hf_model,
                                                              prompt_ids):
    """`--dtype bfloat16` with GGUF weights on the CPU: activations stay float32 (the
    fused decode kernels are float32); on a CPU with native bf16 GEMMs (AMX or
    AVX512-BF16) the KV cache is bf16, the quantized matmuls of a prefill take one bf16
    GEMM, and with AMX those of a batched decode (8 prompts: 8 rows) the AMX body, in
    the fused decode layers. K/V and products then carry bf16 rounding (one bf16 ulp of
    a logit between 16 and 32 is 0.125): greedy ids follow float32 transformers except
    within 0.25 (the bf16 model's bound above), logprobs within 0.2 (measured 0.048
    with bf16 prefill GEMMs alone). Without native bf16 it is the float32 path (or the
    int16 body), with its bounds."""
    from flowengine.executor.cpu_threads import bf16_matmul_path

    native = bf16_matmul_path()[0]
    gguf = conversion_source(default_model_path)
    llm = LLM(gguf, quantization="gguf", dtype="bfloat16", enable_prefix_caching=False,
              placement="inproc")
    assert (llm.resolved.dtype, llm.resolved.bf16_gemm) == ("float32", native)
    runner = llm.engine.executor.runner
    weights = [m.weight for m in runner.model.modules()
               if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    assert len(weights) == 30 * 4 + 1
    assert {w.fmt for w in weights} == {"q4_1", "q8_0"}
    assert all(w.bf16_rows == (ql.bf16_rows(w.fmt) if native else None) for w in weights)
    if native:  # batched decode on AMX tiles where the CPU has them, prefill GEMMs
        assert ql.bf16_rows("q4_1") == (ql.amx_rows("q4_1") if ql._has_amx()
                                        else (0, ql.BF16_GEMM_MIN_ROWS["q4_1"]))
    # the KV cache in bf16 where the products are (half the bytes decode attention reads)
    assert runner.kv_caches[0].dtype == (torch.bfloat16 if native else torch.float32)
    if native:
        stats = _compare(llm, hf_model, prompt_ids[:8], near_tie=0.25, logprob_tol=0.2)
    else:
        stats = _compare(llm, hf_model, prompt_ids[:8], near_tie=1e-3,
                         logprob_tol=_quantized_logprob_tol())
    assert stats["steps"] == 8 * MAX_TOKENS
    # the decode steps ran the fused layers, over the bf16 cache, with the AMX body
    plan = runner.model.model._cpu_fused_plan[1]
    assert plan and plan["kv_fmt"] == (KV_FORMATS[torch.bfloat16] if native
                                       else KV_FORMATS[torch.float32])
    amx = ql.bf16_rows("q4_1")[0] if native else 0
    assert (0 if plan["amx"] is None else int(plan["amx"][1])) == amx




def test_gguf_float32_dtype_keeps_a_float32_kv_cache(default_model_path, hf_model, prompt_ids):
    """`--dtype float32` with GGUF weights: the KV cache float32 too, so only the
    matmuls' activation rounding (the int16 body) separates it from transformers."""
    gguf = conversion_source(default_model_path)
    llm = LLM(gguf, quantization="gguf", dtype="float32", enable_prefix_caching=False,
              placement="inproc")
    assert llm.engine.executor.runner.kv_caches[0].dtype == torch.float32
    stats = _compare(llm, hf_model, prompt_ids[:8], near_tie=1e-3,
                     logprob_tol=_quantized_logprob_tol())
    assert stats["steps"] == 8 * MAX_TOKENS
