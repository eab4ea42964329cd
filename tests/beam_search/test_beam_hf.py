"""Acceptance: `LLM.beam_search` equals transformers' `generate(num_beams=...)` on the
default model in float32, sequences and scores.

Tolerance of scores: 2e-4 absolute (sums of up to max_tokens float32 log-probabilities
from two implementations of the same forward; the observed gap is ~1e-6).

CI runs a covering subset (widths 2 and 4, length penalties 0, 1 and 2, early
stopping True and False, a plain and a chat prompt). The whole sweep (every width x
penalty x early_stopping, three prompts, "never" too):

    FLOWENGINE_BEAM_SWEEP=1 python3 -m pytest -q tests/beam_search/test_beam_hf.py
"""

from __future__ import annotations

import itertools
import os

import pytest

from flowengine.beam_search import BeamSearchParams

SWEEP = os.environ.get("FLOWENGINE_BEAM_SWEEP", "") not in ("", "0")
MAX_TOKENS = 8
SCORE_ATOL = 2e-4
EOS = 2  # <|im_end|>, the default model's eos_token_id (generation_config.json)

if SWEEP:
    CONFIGS = list(itertools.product((2, 4), (0.0, 1.0, 2.0), (True, False, "never")))
else:
    CONFIGS = [(2, 0.0, True), (4, 1.0, False), (2, 2.0, False)]


@pytest.fixture(scope="module")
def llm(beam_llm):
    return beam_llm


@pytest.fixture(scope="module")
def prompts(beam_llm, tokenizer) -> list[list[int]]:
    # The chat template's rendering, so the answer ends with <|im_end|> (EOS).
    _, chat = beam_llm.input_processor.chat_prompt(
        [{"role": "user", "content": "What is 2+2? Answer with one number."}],
        add_generation_prompt=True)
    plain = [tokenizer.encode("The capital of France is")]
    if SWEEP:
        plain.append(tokenizer.encode("def fibonacci(n):"))
    return [chat, *plain]


def hf_beam_search(model, prompt_ids, width, length_penalty, early_stopping):
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
            num_return_sequences=width, length_penalty=length_penalty,
            early_stopping=early_stopping, max_new_tokens=MAX_TOKENS, eos_token_id=EOS,
            pad_token_id=EOS, output_scores=True, return_dict_in_generate=True,
        )
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt_ids):]
        if EOS in gen:  # padding (pad = EOS) follows the first EOS
            gen = gen[: gen.index(EOS) + 1]
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"), CONFIGS)
def test_beam_search_equals_transformers(llm, hf_model, prompts, tokenizer, width,
                                         length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    # Early stopping only matters once hypotheses end with EOS: the chat prompt's do.
    assert any(s.finish_reason == "stop" for s in outs[0].sequences)
    for prompt, out in zip(prompts, outs, strict=True):
        ref_seqs, ref_scores = hf_beam_search(hf_model, prompt, width, length_penalty,
                                              early_stopping)
        assert [s.output_token_ids for s in out.sequences] == ref_seqs
        assert [s.score for s in out.sequences] == pytest.approx(ref_scores, abs=SCORE_ATOL)
        for s in out.sequences:
            gen = s.output_token_ids
            assert s.tokens == prompt + gen
            ended = gen[-1] == EOS
            assert s.finish_reason == ("stop" if ended else "length")
            assert s.text == tokenizer.decode(gen[:-1] if ended else gen,
                                              skip_special_tokens=False)
            # cum_logprob is the sum of the chosen tokens' log-probabilities, and the
            # score its length-normalised value.
            chosen = sum(step[t].logprob for step, t in zip(s.logprobs, gen, strict=True))
            assert s.cum_logprob == pytest.approx(chosen, abs=1e-9)
            assert s.score == pytest.approx(s.cum_logprob / len(gen) ** length_penalty)
