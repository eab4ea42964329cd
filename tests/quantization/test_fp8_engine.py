"""--quantization fp8 and --kv-cache-dtype fp8 end to end on the default model (CPU).

Teacher-forced: the long engine prompt (1,265 tokens) is prefilled in chunks of 256
with prompt_logprobs=1, so every position's top-1 token and the logprob of the actual
next token come out of one request; with an FP8 KV cache, chunks 2..5 attend over K/V
read back from the E4M3 cache. Against the float32 engine:

- FP8 weights (W8A8 here: 256-row chunks): measured 97.1% identical top-1 tokens and
  mean |delta logprob| 0.057 over the 16 engine prompts. SmolLM2-135M is a small model
  with outlier-heavy hidden states (per-token scales lose its small channels) and many
  near-ties; bounded at >= 94% and <= 0.1.
- FP8 KV cache (E4M3, scale 1.0): only K/V are rounded (<= 2**-4 relative), bounded at
  >= 97% and <= 0.05.
Also: the same byte budget holds 4x the KV blocks of a float32 cache (1 byte per
element against 4): exactly 800 blocks against 200.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flowengine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_prompts import PROMPTS  # noqa: E402

pytestmark = pytest.mark.slow

LONG = max(PROMPTS, key=len)
# SmolLM2-135M: one float32 KV block of 16 tokens is 2 x 30 layers x 16 x 3 KV heads x
# 64 x 4 bytes = 737,280 bytes; an E4M3 block a quarter of that.
F32_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4
BUDGET = 200 * F32_BLOCK_BYTES


def _teacher_forced(default_model_path: str, **kw) -> tuple[list[tuple[int, float]], int]:
    llm = LLM(default_model_path, max_model_len=2048, max_num_batched_tokens=256,
              kv_cache_memory_bytes=BUDGET, **kw)
    try:
        out = llm.generate([LONG], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        blocks = llm.engine.scheduler.make_stats().num_total_blocks
    finally:
        llm.shutdown()
    rows = []
    for pos, entry in enumerate(out.prompt_logprobs):
        if entry:
            top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
            rows.append((top, entry[out.prompt_token_ids[pos]].logprob))
    return rows, blocks


@pytest.fixture(scope="module")
def reference(default_model_path: str):
    return _teacher_forced(default_model_path)


@pytest.mark.parametrize(("kw", "min_agree", "max_mean_err"), [
    ({"quantization": "fp8"}, 0.94, 0.1),
    ({"kv_cache_dtype": "fp8"}, 0.97, 0.05),
])
def test_fp8_close_to_float32(default_model_path: str, reference, kw: dict, min_agree: float,
                              max_mean_err: float) -> None:
    want, ref_blocks = reference
    got, blocks = _teacher_forced(default_model_path, **kw)
    assert len(got) == len(want) > 1000
    agree = sum(a[0] == b[0] for a, b in zip(got, want, strict=True)) / len(want)
    err = sum(abs(a[1] - b[1]) for a, b in zip(got, want, strict=True)) / len(want)
    print(f"{kw}: top-1 agreement {agree:.4f}, mean |delta logprob| {err:.4f}")
    assert agree >= min_agree and err <= max_mean_err
    assert err > 0, "FP8 changed nothing: the option did not take effect"
    assert ref_blocks == 200
    assert blocks == (800 if "kv_cache_dtype" in kw else 200)
