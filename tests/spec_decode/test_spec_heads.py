"""EAGLE / EAGLE-3 / Medusa proposers in the executor, against a dense reference.

A tiny random Llama target (float32) and tiny heads saved in the public layouts
(head_checkpoints.py). The executor runs hand-made StepPlans: a prompt in two prefill
chunks (the first one partial, whose head KV is written at once), then verification
steps whose drafts are all rejected, partly accepted or all accepted, so the heads'
KV cache sees rollbacks. After every step the proposed drafts must equal a dense
re-computation of the head (plain torch, HF-style RoPE and attention over the whole
verified sequence, from transformers' hidden states of the target), i.e. the paged
head KV holds exactly the verified positions' values. The CudaModelRunner variant pads
verification steps as their CUDA graphs do (eagerly on the CPU). Loading errors name the missing
or unexpected tensor.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import LlamaForCausalLM

from flowengine.config import CacheConfig
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.eagle_heads import load_medusa_heads
from flowengine.executor.eagle_runner import attach_head_runner
from flowengine.executor.executor import Executor
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.model.model_config import ModelConfig
from flowengine.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from head_checkpoints import (  # noqa: E402
    HEADS,
    HIDDEN,
    KV_HEADS,
    write_eagle,
    write_eagle3,
    write_medusa,
)

VOCAB = 256
BLOCK = 4
K = 3
EPS = 1e-6


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[str, LlamaForCausalLM]:
    from transformers import LlamaConfig

    path = str(tmp_path_factory.mktemp("target"))
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                      num_hidden_layers=8, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                      tie_word_embeddings=False, initializer_range=0.2, rms_norm_eps=EPS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return path, model.eval()


# ------------------------------------------------------------------ dense reference
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    hd = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    rot = torch.cat((-x2, x1), -1)
    return x * cos[:, None].to(x.dtype) + rot * sin[:, None].to(x.dtype)


def _layer(t: dict, prefix: str, attn_in: torch.Tensor, residual: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer over the whole sequence (causal): (mlp out, residual)."""
    n, hd = attn_in.shape[0], HIDDEN // HEADS
    pos = torch.arange(n)
    q = (attn_in @ t[f"{prefix}.self_attn.q_proj.weight"].T).view(n, HEADS, hd)
    k = (attn_in @ t[f"{prefix}.self_attn.k_proj.weight"].T).view(n, KV_HEADS, hd)
    v = (attn_in @ t[f"{prefix}.self_attn.v_proj.weight"].T).view(n, KV_HEADS, hd)
    q, k = _rope(q, pos), _rope(k, pos)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HIDDEN)
    residual = o @ t[f"{prefix}.self_attn.o_proj.weight"].T + residual
    x = _rms(residual, t[f"{prefix}.post_attention_layernorm.weight"])
    gate = x @ t[f"{prefix}.mlp.gate_proj.weight"].T
    up = x @ t[f"{prefix}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{prefix}.mlp.down_proj.weight"].T, residual


def _eagle_step(method: str, t: dict, embed: torch.Tensor, tokens: list[int],
                feats: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Head over positions 0..n-1 (token p+1's embedding, feature p): the last
    position's draft token and next feature."""
    e = embed[torch.tensor(tokens)]
    if method == "eagle":
        x = torch.cat((e, feats), -1) @ t["fc.weight"].T + t["fc.bias"]
        out, residual = _layer(t, "layers.0", x, x)
        out = out + residual
        return int((out[-1] @ LM_HEAD.T).argmax()), out[-1]
    attn_in = torch.cat((_rms(e, t["midlayer.input_layernorm.weight"]),
                         _rms(feats, t["midlayer.hidden_norm.weight"])), -1)
    out, residual = _layer(t, "midlayer", attn_in, feats)
    pre = out + residual
    draft = int((_rms(pre[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
    return draft + int(t["d2t"][draft]), pre[-1]


LM_HEAD: torch.Tensor


def _reference_drafts(method: str, t: dict, hf: LlamaForCausalLM, seq: list[int],
                      aux_ids: tuple[int, ...]) -> list[int]:
    """K greedy drafts after `seq` (its last token just sampled), recomputed densely."""
    with torch.inference_mode():
        out = hf(torch.tensor([seq[:-1]]), output_hidden_states=True)
    states = out.hidden_states
    if method == "eagle":
        feats = states[-1][0]
    else:
        feats = torch.cat([states[i][0] for i in aux_ids], -1) @ t["fc.weight"].T
    embed = hf.model.embed_tokens.weight.detach()
    tokens = list(seq[1:])
    drafts: list[int] = []
    for _ in range(K):
        d, f = _eagle_step(method, t, embed, tokens, feats)
        drafts.append(d)
        tokens.append(d)
        feats = torch.cat((feats, f[None]), 0)
    return drafts


def _greedy(hf: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(ids):].tolist()


# ------------------------------------------------------------------ the executor run
class _Driver:
    """Hand-made plans for one request on an Executor (blocks 0, 1, ... in order)."""

    def __init__(self, executor: Executor, prompt: list[int]) -> None:
        self.ex = executor
        self.step = 0
        self.prompt = prompt

    def _blocks(self, upto: int) -> list[int]:
        state = self.ex.runner.requests.get("r")
        have = 0 if state is None else len(state.block_ids)
        return list(range(have, -(-upto // BLOCK)))

    def run(self, plan_args) -> list:
        plan = StepPlan(self.step, *plan_args)
        self.step += 1
        return self.ex.execute_model(plan).sampled

    def prefill(self, first_chunk: int) -> tuple[int, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=64)
        new = NewRequestData("r", self.prompt, len(self.prompt), params,
                             self._blocks(first_chunk), 0, None)
        assert self.run(([new], [], [first_chunk])) == []
        cached = CachedRequestData("r", self._blocks(len(self.prompt)), first_chunk)
        (s,) = self.run(([], [cached], [len(self.prompt) - first_chunk]))
        return s.token_ids[0], s.draft_token_ids

    def verify(self, drafts: list[int]) -> tuple[list[int], list[int]]:
        state = self.ex.runner.requests["r"]
        nc = state.num_computed_tokens
        cached = CachedRequestData("r", self._blocks(nc + 1 + len(drafts)), nc, drafts)
        (s,) = self.run(([], [cached], [1 + len(drafts)]))
        return s.token_ids, s.draft_token_ids


@pytest.mark.parametrize(("method", "runner_cls"), [("eagle", ModelRunner),
                                                   ("eagle3", CudaModelRunner)])
def test_eagle_drafts_equal_dense_reference(target, tmp_path, method, runner_cls) -> None:
    global LM_HEAD
    path, hf = target
    LM_HEAD = hf.lm_head.weight.detach()
    head_dir = str(tmp_path / method)
    if method == "eagle":
        tensors = write_eagle(head_dir, hf)
        aux_ids: tuple[int, ...] = ()
    else:  # a draft vocabulary of 64 of the target's tokens; vLLM's default layers
        tensors = write_eagle3(head_dir, hf, list(range(VOCAB - 64, VOCAB)))
        aux_ids = (2, 4, 5)
    runner = runner_cls(ModelConfig.from_pretrained(path), CacheConfig(BLOCK, 40),
                        torch.device("cpu"), torch.float32)
    attach_head_runner(runner, method, head_dir, K, num_blocks=40, block_size=BLOCK,
                       max_num_seqs=4)
    assert runner.draft_runner.aux_hidden_state_layers == aux_ids
    if runner_cls is CudaModelRunner:
        # Verification steps padded as for their CUDA graphs (here run eagerly): one
        # request of 4 tokens -> 2 requests x 4 token rows.
        runner.verify_query_len, runner.verify_batch_sizes = K + 1, [2, 4]
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (11,)).tolist()
    truth = _greedy(hf, prompt, 24)
    driver = _Driver(Executor(runner), prompt)
    token, drafts = driver.prefill(first_chunk=6)
    seq = prompt + [token]
    assert token == truth[0]
    assert drafts == _reference_drafts(method, tensors, hf, seq, aux_ids)
    # Drafts sent: the head's own (mostly rejected), 2 right + 1 wrong, all 3 right.
    for kind in ("own", "partial", "right", "own", "partial"):
        n_out = len(seq) - len(prompt)
        right = truth[n_out:n_out + K]
        sent = {"own": drafts, "right": right,
                "partial": right[:2] + [(right[2] + 1) % VOCAB]}[kind]
        tokens, drafts = driver.verify(sent)
        a = 0
        while a < K and sent[a] == right[a]:
            a += 1
        assert tokens == truth[n_out:n_out + a + 1], kind
        seq += tokens
        assert drafts == _reference_drafts(method, tensors, hf, seq, aux_ids), kind
    assert len(seq) - len(prompt) >= 10


def test_medusa_drafts_both_layouts(target, tmp_path) -> None:
    path, hf = target
    runner = ModelRunner(ModelConfig.from_pretrained(path), CacheConfig(BLOCK, 40),
                         torch.device("cpu"), torch.float32)
    prompt = torch.randint(0, VOCAB, (9,)).tolist()
    truth = _greedy(hf, prompt, 8)
    for layout in ("vllm", "fasterdecoding"):
        head_dir = str(tmp_path / layout)
        t = write_medusa(head_dir, VOCAB, num_heads=4, num_layers=2, layout=layout)
        attach_head_runner(runner, "medusa", head_dir, K, num_blocks=40, block_size=BLOCK,
                           max_num_seqs=4)
        runner.requests.clear()
        driver = _Driver(Executor(runner), prompt)
        token, drafts = driver.prefill(first_chunk=5)
        tokens, drafts2 = driver.verify(truth[1:2] + [0, 0])
        assert [token] + tokens[:2] == truth[:3]
        seq = prompt + [token] + tokens
        for got, s in ((drafts, prompt + [token]), (drafts2, seq)):
            with torch.inference_mode():
                h = hf(torch.tensor([s[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            want = []
            for i in range(K):
                x = h
                for j in range(2):
                    lin = x @ t[f"blocks.{i}.layers.{j}.linear.weight"].T
                    x = x + torch.nn.functional.silu(lin + t[f"blocks.{i}.layers.{j}.linear.bias"])
                want.append(int((x @ t[f"lm_heads.{i}.weight"].T).argmax()))
            assert got == want, layout


def test_wrong_layouts_name_the_tensor(target, tmp_path) -> None:
    path, hf = target
    config = ModelConfig.from_pretrained(path)
    runner = ModelRunner(config, CacheConfig(BLOCK, 8), torch.device("cpu"), torch.float32)
    eagle3_dir = str(tmp_path / "e3")
    write_eagle3(eagle3_dir, hf, list(range(32)))
    with pytest.raises(ValueError, match=r"EAGLE checkpoint .* lacks tensor\(s\) \['layers\.0\."):
        attach_head_runner(runner, "eagle", eagle3_dir, K, num_blocks=8, block_size=BLOCK,
                           max_num_seqs=2)
    eagle_dir = str(tmp_path / "e1")
    write_eagle(eagle_dir, hf)
    with pytest.raises(ValueError, match=r"EAGLE-3 checkpoint .* lacks tensor\(s\) \['lm_head.weight', 'midlayer\."):
        attach_head_runner(runner, "eagle3", eagle_dir, K, num_blocks=8, block_size=BLOCK,
                           max_num_seqs=2)
    medusa_dir = str(tmp_path / "m")
    t = write_medusa(medusa_dir, VOCAB, num_heads=3)
    del t["lm_heads.1.weight"]
    from safetensors.torch import save_file

    save_file(t, os.path.join(medusa_dir, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['lm_heads.1.weight'\]"):
        load_medusa_heads(medusa_dir, config, 2, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        load_medusa_heads(medusa_dir, config, 4, torch.device("cpu"), torch.float32)


def test_verification_padding_layout() -> None:
    """InputBatch.prepare(pad_to=b * (k + 1), pad_reqs_to=b): the rows a verification
    CUDA graph reads (exact values)."""
    from flowengine.executor.input_batch import InputBatch, RequestState

    batch = InputBatch(BLOCK, 4, torch.device("cpu"), 16, 4)
    state = RequestState("a", list(range(7)), 5, SamplingParams(), None, [3, 1], 4)
    inputs = batch.prepare([state], [3], pad_to=8, pad_reqs_to=2)
    meta = inputs.attn_metadata
    assert meta.query_start_loc.tolist() == [0, 3, 3]
    assert meta.seq_lens.tolist() == [7, 0]
    assert meta.block_tables.shape == (2, 4) and meta.block_tables[0, :2].tolist() == [3, 1]
    assert inputs.input_ids.tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [4, 5, 6, -1, -1, -1, -1, -1]
    assert inputs.logits_indices.tolist() == [2] and meta.max_query_len == 3
    with pytest.raises(ValueError, match="pad_reqs_to 0 is below"):
        batch.prepare([state], [3], pad_to=8, pad_reqs_to=0)
