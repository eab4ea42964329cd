"""4-bit GPTQ and AWQ checkpoints on the CPU against a float32 dequantized reference.

A random transformers Llama with the default model's layer shapes (SmolLM2-135M:
hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64; two layers, a small
vocabulary since embeddings stay float) is quantized by scripts/quantize_int4.py into
each format; FlowEngine loads the packed checkpoint and the reference is transformers
with every projection replaced by its dequantized (q - z) * s in float32.

Tolerance. The CPU runs the repacked Q4_1 blocks (d = s, m = -s * z rounded to
float16) plus the per-group correction of that rounding (flowengine/model/layers/int4.py),
or for groups that are not 32-aligned the tile-dequantizing fallback: both compute the
reference's weights exactly in float32 and differ only in summation order (blocks of
32, then groups, against one dot product). Measured: max |delta logit| 0.9e-4 .. 2.2e-4 (five cases, two runs)
with |logits| up to ~20; bounded at 1e-3 (5e-5 of the largest logit), and greedy ids
must be equal. On a CPU with AVX2 and no AVX-512 the Q4_1 matmuls of 4 or more rows
take the int16 body (each 32-value block of the activations rounded to multiples of
its largest value / 32767): measured 1.9e-2 .. 4.0e-2 on this random model (its
activations are not normalised the way a trained model's are), bounded at 0.1; greedy
ids still equal.

CI runs two cases (act-order GPTQ and AWQ, ~10 s); FLOWENGINE_INT4_ALL_CASES=1 runs all
five.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.layers.int4 import Int4Linear
from flowengine.model.model_config import ModelConfig

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).parents[1] / "executor"))
from quantize_int4 import quantize_checkpoint  # noqa: E402
from runner_driver import GreedyDriver  # noqa: E402

SMOL_SHAPES = dict(vocab_size=512, hidden_size=576, intermediate_size=1536,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                   num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=100000.0,
                   tie_word_embeddings=True, max_position_embeddings=256,
                   eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROMPTS = {"short": [5, 17, 3], "medium": list(range(40, 70)), "one": [9]}
NUM_NEW = 8

ATOL = 1e-3
ATOL_INT16 = 0.1


def _int16_body() -> bool:
    """Whether batched Q4_1 matmuls take the AVX2 int16 body on this CPU."""
    from flowengine.model.layers.quant_linear import kernels_available

    if not kernels_available():
        return False
    from flowengine import _cpu_ops

    return _cpu_ops.linear_path(4) == "avx2-int16-panels"


CASES = {
    # name: (quantize_checkpoint kwargs, CPU path)
    "gptq-asym-actorder": (dict(method="gptq", sym=False, desc_act=True), "q4_1"),
    "awq-g128": (dict(method="awq", sym=False), "q4_1"),
    "gptq-sym-g128": (dict(method="gptq", sym=True), "q4_1"),
    "gptq_v2-asym-g64": (dict(method="gptq", sym=False, group_size=64,
                              checkpoint_format="gptq_v2"), "q4_1"),
    # K = 576 in groups of 48 (not 32-aligned): the tile-dequantizing fallback.
    "gptq-actorder-g48": (dict(method="gptq", sym=False, desc_act=True, group_size=48),
                          "tiled"),
}
CI_CASES = ("gptq-asym-actorder", "awq-g128")
RUN_CASES = list(CASES) if os.environ.get("FLOWENGINE_INT4_ALL_CASES") == "1" else CI_CASES


def save_float_model(path: Path) -> str:
    """The random float32 model (SMOL_SHAPES), saved as safetensors in `path`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOL_SHAPES), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise * 2)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_float_model(tmp_path_factory.mktemp("float"))


def _reference(float_dir: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied
    return model.eval()


@pytest.mark.parametrize("case", RUN_CASES)
def test_int4_checkpoint_matches_dequantized_reference(case: str, float_dir: str,
                                                       tmp_path: Path) -> None:
    kwargs, cpu_path = CASES[case]
    state = quantize_checkpoint(float_dir, str(tmp_path), **kwargs)
    config = ModelConfig.from_pretrained(str(tmp_path))
    assert config.quantization_config is not None
    assert config.quantization_config.method == kwargs["method"]
    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=64),
                         torch.device("cpu"), torch.float32)
    layers = [m for m in runner.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down per layer
    for layer in layers:
        assert (layer._cpu is not None) == (cpu_path == "q4_1"), case
        # packed, never a float matrix: 4 bits + the group's scale and zero (GPTQ
        # layout), or Q4_1's 5 bits + a float32 correction per group of >= 64
        assert layer.packed_bytes() * 8 <= 5.5 * layer.in_features * layer.out_features
    driver = GreedyDriver(runner, token_budget=16, seed=1, preempt={"short": 3})
    seqs = driver.generate(PROMPTS, NUM_NEW)
    assert driver.partial_chunks > 0 and driver.num_preemptions == 1
    ref = _reference(float_dir, state)
    worst = 0.0
    for rid, prompt in PROMPTS.items():
        # Teacher-forced: one reference forward over prompt + our tokens. Each of our
        # tokens being the reference's argmax after our own prefix is, by induction,
        # the reference's greedy sequence.
        seq = prompt + seqs[rid].outputs
        with torch.no_grad():
            logits = ref(torch.tensor([seq])).logits[0, len(prompt) - 1:len(seq) - 1]
        assert logits.argmax(-1).tolist() == seqs[rid].outputs, (case, rid)
        worst = max(worst, (torch.stack(seqs[rid].logits) - logits).abs().max().item())
    atol = ATOL_INT16 if cpu_path == "q4_1" and _int16_body() else ATOL
    print(f"{case}: max |delta logit| {worst:.2e} (atol {atol})")
    assert worst <= atol, case
