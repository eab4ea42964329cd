"""What rounding the activations to integers per 32-value block would do to the default
model's greedy decoding (issue #20: why the CPU matmuls keep float32 activations).

    python benchmarks/activation_rounding.py                  # 16, 12, 8 bits; 8 + 16
    python benchmarks/activation_rounding.py --bits 16,8 --tokens 24

An integer dot product (llama.cpp's AVX2 kernels multiply Q4/Q8 weights by activations
rounded to int8 per 32-value block, Q8_0/Q8_1) does 2-4x the multiply-adds per
instruction of a float32 FMA, so on a CPU without AVX512-VNNI it is the way to a
faster matmul; the question is what it costs in accuracy. This emulates it in
transformers, float32, on the default model: every nn.Linear's input is rounded, per
block of 32 values along the features, to multiples of max|x_block| / (2^(bits-1) - 1)
(`8+16`: that, plus the remainder rounded again to 16 bits: 24-bit accuracy, the
VNNI body's three int8 levels). For the 16 engine-core prompts
(tests/engine/engine_prompts.py) the float model's greedy continuation (--tokens) is
scored teacher-forced with and without the rounding; prints, per setting, the largest
difference of the chosen token's logprob and the steps whose argmax changed, each with
the float model's top-two logit gap there (tests/cpu/test_quantized_greedy.py allows a
changed token only where that gap is below 1e-3, and 1e-4 of logprob).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch


def rounder(bits: int, residual_bits: int = 0):
    """x [..., K] -> x rounded per 32-value block (K a multiple of 32)."""
    top = 2 ** (bits - 1) - 1

    def apply(x: torch.Tensor) -> torch.Tensor:
        v = x.reshape(-1, 32)
        step = v.abs().amax(-1, keepdim=True) / top
        step = torch.where(step == 0, torch.ones_like(step), step)
        q = torch.round(v / step) * step
        if residual_bits:
            step2 = step / (2 ** (residual_bits - 1) - 1) / 2
            q = q + torch.round((v - q) / step2) * step2
        return q.reshape(x.shape)

    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="16,12,8,8+16")
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve
    from flowengine.tokenize.tokenizer import load_tokenizer

    path = resolve(EngineArgs()).model_path
    spec = importlib.util.spec_from_file_location(
        "engine_prompts", Path(__file__).parents[1] / "tests" / "engine" / "engine_prompts.py")
    prompts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prompts)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tok.encode(p) for p in prompts.PROMPTS]

    state = {"round": None}
    forward = torch.nn.Linear.forward

    def rounded_forward(self, x):
        return forward(self, state["round"](x) if state["round"] else x)

    torch.nn.Linear.forward = rounded_forward
    with torch.inference_mode():
        seqs = [model.generate(torch.tensor([p]), max_new_tokens=a.tokens, do_sample=False)[0]
                .tolist() for p in ids]
        base = [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1) for s in seqs]
        print(f"model {path}; {len(ids)} prompts x {a.tokens} greedy tokens")
        print("| activations | largest logprob difference | argmax changed (top-two gap there) |")
        print("|---|---:|---|")
        for spec_ in a.bits.split(","):
            bits, _, res = spec_.partition("+")
            state["round"] = rounder(int(bits), int(res or 0))
            worst, changed = 0.0, []
            for p, s, lp0 in zip(ids, seqs, base, strict=True):
                lp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
                for t in range(len(p) - 1, len(s) - 1):
                    chosen = s[t + 1]
                    worst = max(worst, abs(float(lp[t, chosen] - lp0[t, chosen])))
                    if int(lp[t].argmax()) != chosen:
                        top = lp0[t].topk(2).values
                        changed.append(f"{float(top[0] - top[1]):.3g}")
            print(f"| {spec_} bits | {worst:.2e} | {len(changed)}: {', '.join(changed)} |")
            state["round"] = None


if __name__ == "__main__":
    main()
