"""Careless GPTQ / AWQ checkpoints: every bad quantization_config value or packed tensor
is a ValueError naming it, raised while loading, never a TypeError / NotImplementedError
and never a model that loads with silently wrong weights (a float32 qweight used to be
copied into the int32 buffer by value, which changes the packed bits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from flowengine.model.layers.int4 import Int4QuantConfig, to_canonical

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
       "version": "gemm"}


@pytest.mark.parametrize(("qc", "message"), [
    ({**GPTQ, "bits": 4.5}, "bits must be an integer, got 4.5"),
    ({**GPTQ, "bits": None}, "bits must be an integer, got None"),
    ({**GPTQ, "bits": "4"}, "bits must be an integer, got '4'"),
    ({**GPTQ, "group_size": 32.5}, "group_size must be an integer, got 32.5"),
    ({**GPTQ, "group_size": None}, "group_size must be an integer, got None"),
    ({**GPTQ, "desc_act": "false"}, "desc_act must be true or false, got 'false'"),
    ({**GPTQ, "sym": 0}, "sym must be true or false, got 0"),
    ({"quant_method": "awq", "w_bit": 4.0}, "w_bit must be an integer, got 4.0"),
    ({**AWQ, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({**AWQ, "modules_to_not_convert": [1]}, "modules_to_not_convert must be a list"),
])  # fmt: skip
def test_config_values_of_the_wrong_type(qc: dict, message: str) -> None:
    with pytest.raises(ValueError, match="quantization_config " + message.replace("(", r"\(")):
        Int4QuantConfig.from_hf(qc)


def test_config_values_that_parse() -> None:
    c = Int4QuantConfig.from_hf({**GPTQ, "desc_act": None, "sym": False})
    assert (c.group_size, c.desc_act, c.sym, c.zero_offset) == (32, False, False, 1)
    c = Int4QuantConfig.from_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                 "modules_to_not_convert": ["lm_head"]})  # fmt: skip
    assert (c.group_size, c.modules_to_not_convert) == (64, ("lm_head",))


def _tensors(k: int = 64, n: int = 16) -> dict[str, torch.Tensor]:
    """A GPTQ layer's tensors, K = 64 in groups of 32, N = 16, random packed words."""
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32),
            "qzeros": torch.randint(-2**31, 2**31 - 1, (k // 32, n // 8), dtype=torch.int32),
            "scales": torch.rand(k // 32, n, dtype=torch.float16)}  # fmt: skip


@pytest.mark.parametrize(("leaf", "bad", "message"), [
    ("qweight", lambda t: t.float(), "qweight must be a 2-D int32 tensor"),
    ("qweight", lambda t: t.long(), "qweight must be a 2-D int32 tensor"),
    ("qweight", lambda t: t.flatten(), r"qweight must be a 2-D int32 tensor .* \(128,\)"),
    ("qzeros", lambda t: t.float(), "qzeros must be a 2-D int32 tensor"),
    ("scales", lambda t: t.to(torch.int32), "scales must be floating point"),
    ("g_idx", lambda t: torch.arange(64) / 32.0, "g_idx must be integer group indices"),
])  # fmt: skip
def test_packed_tensors_of_the_wrong_dtype(leaf, bad, message) -> None:
    cfg = Int4QuantConfig.from_hf({**GPTQ, "desc_act": True})
    tensors = _tensors()
    tensors["g_idx"] = torch.arange(64, dtype=torch.int32) // 32
    q, z, s, g = to_canonical(cfg, dict(tensors), 64)  # the good ones convert
    assert torch.equal(q, tensors["qweight"]) and g is None
    tensors[leaf] = bad(tensors[leaf])
    with pytest.raises(ValueError, match=message):
        to_canonical(cfg, tensors, 64)


def _float_checkpoint(path: Path) -> None:
    """A one-layer random float Llama (hidden 64) as config.json + safetensors, written
    directly (importing transformers would cost more than the test)."""
    from safetensors.torch import save_file

    hidden, inter, kv = 64, 128, 32
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": 64, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "torch_dtype": "float32"}  # fmt: skip
    shapes = {"model.embed_tokens.weight": (64, hidden), "model.norm.weight": (hidden,),
              "model.layers.0.input_layernorm.weight": (hidden,),
              "model.layers.0.post_attention_layernorm.weight": (hidden,),
              "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
              "model.layers.0.self_attn.k_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.v_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
              "model.layers.0.mlp.gate_proj.weight": (inter, hidden),
              "model.layers.0.mlp.up_proj.weight": (inter, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, inter)}  # fmt: skip
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({n: torch.randn(shape) * 0.1 for n, shape in shapes.items()},
              str(path / "model.safetensors"))


def test_a_float_qweight_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from flowengine.model.layers.int4 import Int4Linear
    from flowengine.model.loader import load_model
    from flowengine.model.model_config import ModelConfig

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from quantize_int4 import quantize_checkpoint

    _float_checkpoint(tmp_path / "float")
    out = tmp_path / "gptq"
    quantize_checkpoint(str(tmp_path / "float"), str(out), method="gptq", group_size=32)
    model = load_model(ModelConfig.from_pretrained(str(out)), "auto")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 4
    (file,) = out.glob("*.safetensors")
    state = load_file(str(file))
    name = "model.layers.0.self_attn.q_proj.qweight"
    state[name] = state[name].float()  # a careless conversion of the checkpoint
    save_file(state, str(file))
    with pytest.raises(ValueError, match="qweight must be a 2-D int32 tensor"):
        load_model(ModelConfig.from_pretrained(str(out)), "auto")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["bits"] = 4.5
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="bits must be an integer, got 4.5"):
        load_model(ModelConfig.from_pretrained(str(out)), "auto")
