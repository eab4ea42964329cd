"""FP8 on Hopper: E4M3 weights (W8A8, `--quantization fp8`) and an E4M3 KV cache
(`--kv-cache-dtype fp8`) against bf16, on the random-weight Llama-3 and Qwen3 models
of gpu_models.py (32 prompts of 5..700 tokens, shared prefixes, chunked prefill).

What is measured, per model and mode: the fraction of greedy tokens identical to
transformers' bf16 reference, and the teacher-forced logits error of the first output
token of every prompt (gpu_models.logits_error) — printed, and bounded:

- FP8 rounds each GEMM operand with a relative error of at most 2**-4 (E4M3's 3
  mantissa bits; ~2**-4 / sqrt(3) RMS), so a GEMM's output moves by a few percent where
  bf16 moves it by ~0.3%. Published FP8-dynamic checkpoints (per-channel weights,
  per-token activations, the recipe here) recover >= 99% of bf16 accuracy on Llama 3
  evaluations; the reference margins here are >= MIN_MARGIN (1 std of the logits), far
  above that noise, so >= 97% of greedy tokens must equal the bf16 reference, and the
  logits' relative L2 error must stay below FP8_L2_TOL.
Run: pytest -s tests/gpu/test_fp8_gpu.py
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need compute capability >= 8.9", allow_module_level=True)

from gpu_models import hf_greedy, logits_error, save_model, shared_prefix_prompts  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from flowengine import LLM, SamplingParams  # noqa: E402
from flowengine.model.layers.fp8 import Fp8Linear, reference_fp8_linear  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("FLOWENGINE_TEST_SEED", "1234"))
MAX_TOKENS = 16
MIN_IDENTICAL = 0.97
FP8_L2_TOL = 0.15
ENGINE_ARGS = dict(dtype="bfloat16", device="cuda", max_model_len=1024,
                   max_num_batched_tokens=256, max_num_seqs=64, num_kv_blocks=4096, seed=0,
                   max_logprobs=-1)
MODES = {"fp8 weights": dict(quantization="fp8"), "fp8 kv cache": dict(kv_cache_dtype="fp8"),
         "fp8 weights + kv": dict(quantization="fp8", kv_cache_dtype="fp8")}


@pytest.mark.parametrize(("m", "k", "n"), [(1, 4096, 6144), (7, 4096, 28672), (256, 14336, 4096),
                                           (33, 1024, 2816)])
def test_fp8_gemm_matches_reference(m: int, k: int, n: int) -> None:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    layer = Fp8Linear(w, torch.randn(n, device="cuda", dtype=torch.bfloat16), row_parallel=False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    want = reference_fp8_linear(x.float(), layer)
    # Same E4M3 operands; the FP8 tensor cores accumulate in float32 and round once to bf16.
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    path = str(tmp_path_factory.mktemp(f"fp8-{family}"))
    save_model(family, path, SEED)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    prompts = shared_prefix_prompts(SEED)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    with torch.inference_mode():
        logits = [hf(torch.tensor([p], device="cuda")).logits[0, -1].float() for p in prompts]
    yield family, path, prompts, refs, logits
    del hf
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_against_bf16_reference(case, mode: str) -> None:
    family, path, prompts, refs, ref_logits = case
    llm = LLM(path, **ENGINE_ARGS, **MODES[mode])
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        same = total = 0
        for out, ref in zip(outs, refs, strict=True):
            got = list(out.outputs[0].token_ids)
            total += len(ref.token_ids)
            same += sum(a == b for a, b in zip(got, ref.token_ids, strict=True))
        # First-token logits through the engine (full-vocabulary logprobs of step 0).
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
        errs = []
        for out, want in zip(outs, ref_logits, strict=True):
            lp = out.outputs[0].logprobs[0]
            got = torch.full_like(want, float("-inf"))
            for tok, entry in lp.items():
                got[tok] = entry.logprob
            # logprobs are logits minus their logsumexp: compare centred vectors.
            want_lp = torch.log_softmax(want, -1)
            errs.append(logits_error(got - got.mean(), want_lp - want_lp.mean())[1])
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    frac = same / total
    print(f"{family} {mode}: {frac:.4f} of {total} greedy tokens equal bf16 transformers; "
          f"first-token logprob L2 error mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
    assert frac >= MIN_IDENTICAL
    assert max(errs) <= FP8_L2_TOL


@pytest.mark.parametrize("layout", ["ct-channel", "fp8-tensor-static", "fp8-block"])
def test_fp8_checkpoint_layers_on_cuda_hold_its_bytes_and_match_the_reference(
        layout: str, tmp_path) -> None:
    # FP8 checkpoints (scripts/save_fp8_checkpoint.py) loaded on the GPU: the E4M3 bytes
    # as written, and each layer's CUDA GEMM (W8A16 at 7 rows; W8A8 at 200 rows, with the
    # checkpoint's static input scale where it has one) against its float32 reference,
    # with test_fp8_gemm_matches_reference's tolerance. Block scales: a clear error.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from save_fp8_checkpoint import save_fp8_checkpoint

    from flowengine.model.loader import load_model
    from flowengine.model.model_config import ModelConfig

    tensors = save_fp8_checkpoint(str(tmp_path), layout, layers=1)
    config = ModelConfig.from_pretrained(str(tmp_path))
    if layout == "fp8-block":
        with pytest.raises(ValueError, match="no block-scaled FP8 GEMM on cuda"):
            load_model(config, dtype=torch.bfloat16, device="cuda")
        return
    model = load_model(config, dtype=torch.bfloat16, device="cuda")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(layers) == 4
    down = layers["model.layers.0.mlp.down_proj"]
    assert torch.equal(down.weight.view(torch.uint8).cpu(),
                       tensors["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))
    assert (down.input_scale is not None) == layout.endswith("static")
    for layer in layers.values():
        for rows in (7, 200):
            x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
            want = reference_fp8_linear(x.float(), layer)
            torch.testing.assert_close(layer(x).float(), want, rtol=1.6e-2,
                                       atol=1e-2 * want.abs().max().item())
