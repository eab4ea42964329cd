"""The pooling module's pure parts: pooler arithmetic, config resolution from
sentence-transformers files, per-request params and their application."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flowengine.pooling.config import (
    PoolerConfig,
    resolve_pooler_config,
    resolve_runner,
    sentence_transformers_max_seq_length,
)
from flowengine.pooling.params import PoolingParams, finish_embedding
from flowengine.pooling.pooler import pool


def test_pool_cls_mean_last_exact():
    lens = [3, 1, 5]
    hidden = torch.randn(sum(lens), 7, dtype=torch.float64)
    qsl = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    rows = [hidden[0:3], hidden[3:4], hidden[4:9]]
    torch.testing.assert_close(pool(hidden, qsl, "CLS"), torch.stack([r[0] for r in rows]).float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(pool(hidden, qsl, "LAST"),
                               torch.stack([r[-1] for r in rows]).float(), rtol=0, atol=0)
    mean = pool(hidden, qsl, "MEAN")
    assert mean.dtype == torch.float32 and mean.shape == (3, 7)
    torch.testing.assert_close(mean, torch.stack([r.mean(0) for r in rows]).float(),
                               rtol=1e-6, atol=1e-6)


def test_pool_ignores_padding_rows_and_rejects_empty_requests():
    hidden = torch.randn(6, 4)
    qsl = torch.tensor([0, 2, 4])  # rows 4, 5 are padding
    torch.testing.assert_close(pool(hidden, qsl, "MEAN"),
                               torch.stack([hidden[:2].mean(0), hidden[2:4].mean(0)]))
    with pytest.raises(ValueError, match="no tokens"):
        pool(hidden, torch.tensor([0, 2, 2]), "CLS")
    with pytest.raises(ValueError, match="unknown pooling type"):
        pool(hidden, qsl, "MAX")  # type: ignore[arg-type]


def _st_dir(tmp_path, modes: dict, normalize: bool, config: dict | None = None):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, **modes}))
    (tmp_path / "config.json").write_text(json.dumps(config or {}))
    return str(tmp_path)


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    path = _st_dir(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)
    assert resolve_pooler_config(path, True) == PoolerConfig("CLS", False)
    # The user's --pooler-config wins field by field.
    assert resolve_pooler_config(path, True, {"normalize": True}) == PoolerConfig("CLS", True)
    assert resolve_pooler_config(path, True, {"pooling_type": "last"}) == PoolerConfig("LAST", False)


@pytest.mark.parametrize("key,expected", [("pooling_mode_mean_tokens", "MEAN"),
                                          ("pooling_mode_lasttoken", "LAST")])
def test_pooler_config_modes(tmp_path, key, expected):
    path = _st_dir(tmp_path, {key: True}, normalize=True)
    assert resolve_pooler_config(path, False) == PoolerConfig(expected, True)


def test_pooler_config_defaults_without_st_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_pooler_config(str(tmp_path), True) == PoolerConfig("CLS", True)
    assert resolve_pooler_config(str(tmp_path), False) == PoolerConfig("LAST", True)
    assert sentence_transformers_max_seq_length(str(tmp_path)) is None


def test_pooler_config_errors(tmp_path):
    path = _st_dir(tmp_path, {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match="not supported"):
        resolve_pooler_config(path, True)
    # A pooling type of the user's replaces the unsupported one; Normalize still applies.
    assert resolve_pooler_config(path, True, {"pooling_type": "MEAN"}) == PoolerConfig("MEAN", True)
    with pytest.raises(ValueError, match="unknown pooler_config field"):
        resolve_pooler_config(str(tmp_path), True, {"pooling_type": "CLS", "softmax": True})
    (tmp_path / "modules.json").unlink()
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        resolve_pooler_config(str(tmp_path), True, {"pooling_type": "MAX"})


def test_matryoshka_dimensions(tmp_path):
    path = _st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True,
                   config={"matryoshka_dimensions": [64, 128, 256]})
    cfg = resolve_pooler_config(path, True)
    assert cfg.is_matryoshka and cfg.matryoshka_dimensions == (64, 128, 256)
    cfg.check_dimensions(128, 256)
    with pytest.raises(ValueError, match=r"supports dimensions \[64, 128, 256\] only"):
        cfg.check_dimensions(100, 256)
    with pytest.raises(ValueError, match=r"must be in \[1, 256\]"):
        cfg.check_dimensions(512, 256)
    with pytest.raises(ValueError, match="matryoshka"):
        PoolerConfig("MEAN").check_dimensions(64, 256)
    PoolerConfig("MEAN").check_dimensions(None, 256)


def test_runner_resolution():
    assert resolve_runner("auto", True, "BertModel") == "pooling"
    assert resolve_runner("auto", False, "LlamaForCausalLM") == "generate"
    assert resolve_runner("pooling", False, "LlamaForCausalLM") == "pooling"
    with pytest.raises(ValueError, match="encoder-only"):
        resolve_runner("generate", True, "BertModel")
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", False, "LlamaForCausalLM")


def test_finish_embedding_truncates_then_normalizes():
    vec = np.random.default_rng().standard_normal(16).astype("<f4")
    raw = vec.tobytes()
    np.testing.assert_array_equal(finish_embedding(raw, PoolingParams(normalize=False), True), vec)
    unit = finish_embedding(raw, PoolingParams(), True)
    np.testing.assert_allclose(unit, vec / np.linalg.norm(vec), rtol=1e-6)
    short = finish_embedding(raw, PoolingParams(dimensions=4, normalize=True), False)
    np.testing.assert_allclose(short, vec[:4] / np.linalg.norm(vec[:4]), rtol=1e-6)
    assert short.dtype == np.float32
    zero = finish_embedding(np.zeros(4, "<f4").tobytes(), PoolingParams(normalize=True), True)
    np.testing.assert_array_equal(zero, np.zeros(4))  # no NaN


@pytest.mark.parametrize("kwargs", [{"dimensions": 0}, {"dimensions": True},
                                    {"normalize": 1}, {"truncate_prompt_tokens": 0},
                                    {"truncate_prompt_tokens": -2}])
def test_pooling_params_validation(kwargs):
    with pytest.raises(ValueError):
        PoolingParams(**kwargs)
