"""Expert parallelism (`--enable-expert-parallel`): whole experts placed on the
tensor-parallel ranks (expert e on rank e // (E / N)), tokens computed on their
experts' rank, the ranks' weighted outputs summed by the layer's all-reduce.

Checked: the placement and its errors; each rank loads exactly its experts, whole
(safetensors and dummy weights); the ranks' partial outputs add up to the unsplit layer;
and through the engine (gloo, tensor_parallel_size 2, random-weight Qwen3-MoE and
Mixtral models with few layers) greedy ids equal transformers' (TP = 1's reference, see
tests/executor/test_model_runner_moe.py) and the default TP split's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

# The MoE families' tiny configs (their structure is the real models').
from test_model_runner_moe import FAMILIES, PROMPTS, save_random_moe

from flowengine.distributed.expert_parallel import check_expert_parallel, place_experts
from flowengine.distributed.tp_group import TensorParallelGroup
from flowengine.model.layers.moe import FusedMoE, fused_moe_torch, select_experts
from flowengine.model.model_config import ModelConfig


def test_placement_is_contiguous_groups_of_e_over_n() -> None:
    owners = {}
    for rank in range(4):
        p = place_experts(128, TensorParallelGroup(rank, 4))
        assert (p.start, p.count) == (32 * rank, 32)
        emap = p.expert_map("cpu")
        assert emap.dtype == torch.int32 and emap.shape == (128,)
        for e in range(128):
            if emap[e] >= 0:
                owners.setdefault(e, []).append(rank)
                assert emap[e] == e - 32 * rank and p.is_local(e)
    assert owners == {e: [e // 32] for e in range(128)}  # every expert on exactly one rank


def test_indivisible_experts_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_experts \(60\) is not divisible by "
                                         r"tensor_parallel_size 8.*\[1, 2, 3, 4, 5, 6, 10"):
        check_expert_parallel(60, 8)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_expert_parallel(0, 2)
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by "
                                         "tensor_parallel_size 3"):
        FusedMoE(8, 2, 16, 8, True, TensorParallelGroup(0, 3), expert_parallel=True)
    check_expert_parallel(60, 4)


def test_engine_args_refuse_expert_parallel_the_model_cannot_take(tmp_path) -> None:
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    # 6 experts, 4 query and 4 KV heads: tensor_parallel_size 4 splits the attention
    # but cannot place 6 experts whole.
    cfg = FAMILIES["mixtral"].to_dict()
    cfg.update(num_local_experts=6, num_key_value_heads=4)
    save_random_moe(type(FAMILIES["mixtral"]).from_dict(cfg), str(tmp_path))
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by "
                                         r"tensor_parallel_size 4; pick a tensor_parallel_size "
                                         r"among \[1, 2, 3, 6\]"):
        resolve(EngineArgs(model=str(tmp_path), tensor_parallel_size=4,
                           enable_expert_parallel=True, device="cpu"))
    # the default split still works at 4, and expert parallelism at 2
    assert not resolve(EngineArgs(model=str(tmp_path), tensor_parallel_size=4, device="cpu")
                       ).model_config.enable_expert_parallel
    assert resolve(EngineArgs(model=str(tmp_path), tensor_parallel_size=2, device="cpu",
                              enable_expert_parallel=True)).model_config.enable_expert_parallel


def test_cli_flag_sets_the_engine_argument() -> None:
    import argparse

    from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    on = engine_args_from(parser.parse_args(["m", "-tp", "2", "--enable-expert-parallel"]))
    assert on.enable_expert_parallel and on.tensor_parallel_size == 2
    assert not engine_args_from(parser.parse_args(["m"])).enable_expert_parallel


@pytest.mark.parametrize("fmt", ["safetensors", "dummy"])
def test_each_rank_loads_its_experts_whole(tmp_path, fmt: str) -> None:
    from flowengine.model.loader import load_model

    save_random_moe(FAMILIES["qwen3-moe"], str(tmp_path))  # 128 experts of width 24
    config = ModelConfig.from_pretrained(str(tmp_path))
    ep = dataclasses.replace(config, enable_expert_parallel=True)
    full = dict(load_model(config, fmt).named_parameters())
    ranks = [dict(load_model(ep, fmt, tp=TensorParallelGroup(r, 2)).named_parameters())
             for r in range(2)]
    for layer in (1, 3):  # decoder_sparse_step 2: layers 1 and 3 are sparse
        base = f"model.layers.{layer}.mlp"
        for name, shape in (("w13_weight", (64, 48, 64)), ("w2_weight", (64, 64, 24))):
            key = f"{base}.experts.{name}"
            assert all(p[key].shape == shape for p in ranks)
            assert torch.equal(torch.cat([p[key] for p in ranks]), full[key])
        assert all(torch.equal(p[f"{base}.gate.weight"], full[f"{base}.gate.weight"])
                   for p in ranks)  # the router is whole on every rank
    # attention stays split by heads
    q = "model.layers.0.self_attn.qkv_proj.weight"
    assert ranks[0][q].shape[0] * 2 == full[q].shape[0]


def test_rank_partial_outputs_sum_to_the_unsplit_layer() -> None:
    torch.manual_seed(3)
    t, e, k, h, i = 11, 8, 3, 16, 12
    x = torch.randn(t, h, dtype=torch.float64)
    w13 = torch.randn(e, 2 * i, h, dtype=torch.float64)
    w2 = torch.randn(e, h, i, dtype=torch.float64)
    weights, ids = select_experts(torch.randn(t, e), k, True)
    weights = weights.double()
    whole = fused_moe_torch(x, w13, w2, weights, ids)
    parts = []
    for rank in range(4):
        p = place_experts(e, TensorParallelGroup(rank, 4))
        sl = slice(p.start, p.start + p.count)
        parts.append(fused_moe_torch(x, w13[sl], w2[sl], weights, ids, p.expert_map("cpu")))
    torch.testing.assert_close(sum(parts), whole, atol=1e-12, rtol=1e-12)
    # a rank none of whose experts is chosen contributes exactly zero
    p = place_experts(e, TensorParallelGroup(1, 4))
    only0 = torch.zeros_like(ids)  # every pair routed to expert 0 (rank 0)
    got = fused_moe_torch(x, w13[2:4], w2[2:4], weights, only0, p.expert_map("cpu"))
    assert torch.equal(got, torch.zeros_like(x))


# ------------------------------------------------ two gloo ranks, greedy through ModelRunner
# Four of the MoE tests' prompts (the 30- and 45-token ones prefill in chunks) and 8
# new tokens each: CI time.
_RANK_PROMPTS = {rid: PROMPTS[rid] for rid in ("short", "medium", "one", "long")}
_RANK_NEW = 8


class _RankRunner:
    """A tensor-parallel rank's ModelRunner as GreedyDriver sees it: rank 0's logits
    broadcast to every rank, so each rank's driver picks the same tokens and builds the
    same plans (what the engine does with rank 0's sampled tokens)."""

    def __init__(self, runner, tp: TensorParallelGroup) -> None:
        self.runner, self.tp = runner, tp

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute_model(self, plan):
        out = self.runner.execute_model(plan)
        logits = out.logits
        if logits is None:
            logits = torch.empty(len(out.req_ids), self.runner.model_config.vocab_size)
        return dataclasses.replace(out, logits=self.tp.broadcast_from_first(logits))


def _greedy(config: ModelConfig, tp: TensorParallelGroup) -> dict[str, list[int]]:
    from runner_driver import GreedyDriver

    from flowengine.config import CacheConfig
    from flowengine.executor.model_runner import ModelRunner

    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=128),
                         torch.device("cpu"), torch.float32, tp=tp)
    # 16-token budget: chunked prefill; "short" preempted and recomputed once.
    driver = GreedyDriver(_RankRunner(runner, tp), token_budget=16, seed=1,
                          preempt={"short": 5})
    seqs = driver.generate(_RANK_PROMPTS, _RANK_NEW)
    return {rid: seq.outputs for rid, seq in seqs.items()}


def _rank_main(rank: int, init_method: str, paths: dict[str, str], results) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))  # runner_driver for the spawned child
    from flowengine.distributed.tp_group import init_tensor_parallel

    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, init_method, torch.device("cpu"))
    out = {}
    for family, path in paths.items():
        config = ModelConfig.from_pretrained(path)
        out[family] = {
            "split": _greedy(config, tp),
            "ep": _greedy(dataclasses.replace(config, enable_expert_parallel=True), tp)}
    if rank == 0:
        results.put(out)
    torch.distributed.destroy_process_group()


def test_expert_parallel_2_equals_tp_1_and_the_tp_split(tmp_path) -> None:
    # Qwen3-MoE (128 experts top-8, 64 per rank) and Mixtral (8 experts top-2, 4 per
    # rank) in the same two gloo ranks (one process start for both).
    import socket

    import torch.multiprocessing as mp

    paths = {}
    for family in ("qwen3-moe", "mixtral"):
        paths[family] = str(tmp_path / family)
        save_random_moe(FAMILIES[family], paths[family])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, f"tcp://127.0.0.1:{port}", paths,
                                                  results))
             for r in range(2)]
    for p in procs:
        p.start()
    reference = {family: _greedy(ModelConfig.from_pretrained(path), TensorParallelGroup())
                 for family, path in paths.items()}
    got = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for family in paths:
        assert len({tuple(ids) for ids in reference[family].values()}) == 4  # not degenerate
        assert got[family]["ep"] == reference[family], family
        assert got[family]["split"] == reference[family], family


# ---------------------------------------------------------------- through the engine
_VOCAB = 49152  # the default model's tokenizer, copied beside the weights
_ENGINE_PROMPTS = [[(i * 131 + 7 * j) % _VOCAB for i in range(n)]
                   for j, n in enumerate((3, 60, 1, 17, 33, 8, 45, 24))]


def _save_with_tokenizer(family: str, path: str, default_model_path: str):
    cfg = FAMILIES[family].to_dict()
    cfg.update(vocab_size=_VOCAB, max_position_embeddings=512)
    hf_model = save_random_moe(type(FAMILIES[family]).from_dict(cfg), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path, name), path)
    return hf_model


def _engine_greedy(path: str, **kwargs) -> list[list[int]]:
    from flowengine import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=2, max_model_len=256, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in _ENGINE_PROMPTS], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FLOWENGINE_EP_ENGINE"),
                    reason="the engine-level run takes minutes (FLOWENGINE_EP_ENGINE=1)")
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_engine_expert_parallel_equals_transformers_and_the_tp_split(
        family, tmp_path, default_model_path, hf_greedy):
    # LLM(tensor_parallel_size=2, enable_expert_parallel=True): the flag through
    # EngineArgs, resolve() and the executor processes.
    path = str(tmp_path)
    hf_model = _save_with_tokenizer(family, path, default_model_path)
    reference = [hf_greedy(hf_model, p, 8) for p in _ENGINE_PROMPTS]
    assert len({tuple(s) for s in reference}) == len(_ENGINE_PROMPTS)  # not degenerate
    assert _engine_greedy(path, enable_expert_parallel=True) == reference
    assert _engine_greedy(path) == reference
