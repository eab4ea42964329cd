"""Tensor-parallel weight shards: every rank's slices put back together equal the
unsplit model, exactly; vocabulary padding is zero; bad sizes give clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.distributed.tp_group import TensorParallelGroup, check_tensor_parallel
from flowengine.model.loader import load_model
from flowengine.model.model_config import ModelConfig


def _save_tiny(path: str, vocab: int, tie: bool, bias: bool) -> ModelConfig:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=tie,
                      attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return ModelConfig.from_pretrained(path)


def _rank_models(config: ModelConfig, n: int, fmt: str):
    return [load_model(config, fmt, tp=TensorParallelGroup(r, n)) for r in range(n)]


def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes))


@pytest.mark.parametrize("fmt", ["safetensors", "dummy"])
@pytest.mark.parametrize("n", [2, 4])
def test_rank_shards_reassemble_the_full_model(tmp_path, fmt: str, n: int) -> None:
    config = _save_tiny(str(tmp_path), vocab=66, tie=False, bias=True)  # 66 % 4 != 0
    full = load_model(config, fmt)
    ranks = _rank_models(config, n, fmt)
    q, kv, i = 4 * 8, 4 * 8, 48  # heads * head_dim, kv heads * head_dim, intermediate
    for layer in range(2):
        name = f"model.layers.{layer}"
        whole = dict(full.named_parameters())
        parts = [dict(m.named_parameters()) for m in ranks]
        for leaf in ("weight", "bias"):
            wq, wk, wv = _split(whole[f"{name}.self_attn.qkv_proj.{leaf}"], [q, kv, kv])
            pieces = [_split(p[f"{name}.self_attn.qkv_proj.{leaf}"], [q // n, kv // n, kv // n])
                      for p in parts]
            for j, w in enumerate((wq, wk, wv)):
                assert torch.equal(torch.cat([pc[j] for pc in pieces]), w)
            gate, up = _split(whole[f"{name}.mlp.gate_up_proj.{leaf}"], [i, i])
            pieces = [_split(p[f"{name}.mlp.gate_up_proj.{leaf}"], [i // n, i // n])
                      for p in parts]
            assert torch.equal(torch.cat([pc[0] for pc in pieces]), gate)
            assert torch.equal(torch.cat([pc[1] for pc in pieces]), up)
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert torch.equal(torch.cat([p[f"{name}.{proj}.weight"] for p in parts], dim=1),
                               whole[f"{name}.{proj}.weight"])
            for p in parts:  # the bias is added once, after the all-reduce: whole everywhere
                assert torch.equal(p[f"{name}.{proj}.bias"], whole[f"{name}.{proj}.bias"])
    per_rank = -(-66 // n)
    for pname in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = torch.cat([dict(m.named_parameters())[pname] for m in ranks])
        assert rows.shape == (per_rank * n, 32)
        assert torch.equal(rows[:66], dict(full.named_parameters())[pname])
        assert not rows[66:].any()  # padding rows of the last rank are zero


def test_tied_model_splits_the_embedding_it_reads_logits_from(tmp_path) -> None:
    config = _save_tiny(str(tmp_path), vocab=64, tie=True, bias=False)
    full = load_model(config, "safetensors")
    ranks = _rank_models(config, 2, "safetensors")
    assert all(m.lm_head is None for m in ranks)
    assert torch.equal(torch.cat([m.model.embed_tokens.weight for m in ranks]),
                       full.model.embed_tokens.weight)


def test_dummy_weights_do_not_depend_on_seeds_of_other_tensors(tmp_path) -> None:
    config = _save_tiny(str(tmp_path), vocab=64, tie=False, bias=False)
    a, b, c = (load_model(config, "dummy", seed=s) for s in (3, 3, 4))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc)
            assert pa.abs().max() <= 1e-3


def test_indivisible_sizes_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads = 9, num_key_value_heads = 3"):
        check_tensor_parallel(9, 3, 1536, 2)
    with pytest.raises(ValueError, match=r"intermediate_size = 1536"):
        check_tensor_parallel(7, 7, 1536, 7)
    check_tensor_parallel(9, 3, 1536, 3)


def test_engine_args_refuse_a_split_the_model_cannot_take(default_model_path) -> None:
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    args = EngineArgs(model=default_model_path, tensor_parallel_size=2)
    assert args.placement == "multiproc"  # one process per rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide"):
        resolve(args)
