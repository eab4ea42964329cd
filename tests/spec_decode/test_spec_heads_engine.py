"""EAGLE / EAGLE-3 / Medusa speculation through the whole engine (`LLM`): greedy
tokens equal transformers' greedy output of the tiny random target, drafts are
accepted (each head is made to favour the target's most frequent output token, so
acceptance is not left to chance), and every KV block is free at the end."""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import pytest
import torch

from flowengine import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from head_checkpoints import write_eagle, write_eagle3, write_medusa, write_target  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 1024
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_path: str):
    root = tmp_path_factory.mktemp("heads-engine")
    hf = write_target(str(root / "target"), default_model_path, VOCAB, num_layers=8).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 13, 21)]
    with torch.inference_mode():
        truth = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    favour = Counter(t for out in truth for t in out[1:]).most_common(1)[0][0]
    return root, hf, prompts, truth, favour


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_greedy_equals_transformers_with_accepted_drafts(setup, method) -> None:
    root, hf, prompts, truth, favour = setup
    head = str(root / method)
    if method == "eagle":
        write_eagle(head, hf, favour=favour)
    elif method == "eagle3":  # draft vocabulary: the favoured token only (via d2t)
        write_eagle3(head, hf, [favour])
    else:
        write_medusa(head, VOCAB, num_heads=3, favour=favour)
    llm = LLM(str(root / "target"), max_model_len=128, enable_prefix_caching=True,
              speculative_config={"method": method, "model": head,
                                  "num_speculative_tokens": 3})
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == truth
        stats = llm.engine.scheduler.make_stats()
        # Every step proposes k drafts from the favoured token; some are accepted.
        assert stats.spec_decode_num_drafts_total > 0
        assert 0 < stats.spec_decode_num_accepted_tokens_total <= \
            stats.spec_decode_num_draft_tokens_total
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
