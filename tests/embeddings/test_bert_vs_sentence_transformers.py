"""all-MiniLM-L6-v2 through FlowEngine's BERT encoder and pooling runner equals
sentence-transformers' own embeddings (issue 17 item 4 acceptance: cosine >= 0.9999)."""

from __future__ import annotations

import numpy as np
import pytest

from flowengine import LLM
from flowengine.pooling import PoolingParams


@pytest.fixture(scope="module")
def llm(minilm_path):
    return LLM(minilm_path)


@pytest.fixture(scope="module")
def st_model(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm_path, device="cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_resolves_to_pooling_runner_with_st_config(llm):
    resolved = llm.resolved
    assert resolved.runner == "pooling"
    # modules.json: Pooling (mean) + Normalize; sentence_bert_config.json: 256 tokens.
    assert resolved.pooler_config.pooling_type == "MEAN"
    assert resolved.pooler_config.normalize is True
    assert resolved.max_model_len == 256
    assert resolved.args.enable_chunked_prefill is False
    assert resolved.args.enable_prefix_caching is False


def test_64_sentences_equal_sentence_transformers(llm, st_model, sentences):
    outs = llm.embed(sentences, use_tqdm=False)
    ours = np.array([o.outputs.embedding for o in outs], dtype=np.float64)
    ref = st_model.encode(sentences, batch_size=16, convert_to_numpy=True).astype(np.float64)
    assert ours.shape == ref.shape == (64, 384)
    cos = _cosines(ours, ref)
    assert cos.min() >= 0.9999, (cos.argmin(), cos.min())
    # Normalize module: unit vectors, as sentence-transformers returns.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    # vLLM's output shape and request bookkeeping.
    assert [o.prompt for o in outs] == sentences
    assert all(o.finished and o.error is None for o in outs)
    assert outs[0].prompt_token_ids == st_model.tokenizer(sentences[0])["input_ids"]


def test_token_ids_and_batch_composition_do_not_change_vectors(llm, sentences):
    alone = llm.embed(sentences[9], use_tqdm=False)[0].outputs.embedding
    ids = llm.get_tokenizer().encode(sentences[9])
    by_ids = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    batched = llm.embed(sentences[:20], use_tqdm=False)[9].outputs.embedding
    np.testing.assert_allclose(by_ids, alone, atol=1e-6)
    np.testing.assert_allclose(batched, alone, atol=1e-5)


def test_normalize_off_gives_the_raw_mean(llm, st_model, sentences):
    raw = llm.embed(sentences[:4], PoolingParams(normalize=False), use_tqdm=False)
    ours = np.array([o.outputs.embedding for o in raw])
    # sentence-transformers without its Normalize module: the Transformer + Pooling
    # modules only.
    import torch

    feats = st_model.tokenize(sentences[:4])
    with torch.inference_mode():
        out = st_model[1](st_model[0](feats))["sentence_embedding"].numpy()
    np.testing.assert_allclose(ours, out, atol=1e-4)
    assert not np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-3)


def test_bad_inputs_raise_and_the_engine_keeps_serving(llm, sentences):
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hi", PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.embed(" ".join(["word"] * 400), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.embed("", use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[101, 10**6, 102]], use_tqdm=False)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate("hello", use_tqdm=False)
    # truncate_prompt_tokens keeps the last tokens (vLLM's rule): a long input fits.
    long = llm.embed(" ".join(["word"] * 400), truncate_prompt_tokens=256, use_tqdm=False)
    assert len(long[0].prompt_token_ids) == 256
    # Still serving, exactly as before.
    again = llm.embed(sentences[:2], use_tqdm=False)
    first = llm.embed(sentences[0], use_tqdm=False)[0]
    np.testing.assert_allclose(again[0].outputs.embedding, first.outputs.embedding, atol=1e-6)
    # No block is kept after a request (prefill-only: blocks freed when it finishes).
    scheduler = llm.engine.scheduler
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


def test_dimensions_on_a_matryoshka_model(minilm_path, tmp_path, sentences):
    # The same weights, declared Matryoshka in config.json (as such models' configs do).
    import json
    import os

    for name in os.listdir(minilm_path):
        if name != "config.json":
            os.symlink(os.path.join(minilm_path, name), tmp_path / name)
    config = json.loads(open(os.path.join(minilm_path, "config.json")).read())
    config["matryoshka_dimensions"] = [64, 128, 384]
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path))
    full = llm.embed(sentences[:3], PoolingParams(normalize=False), use_tqdm=False)
    short = llm.embed(sentences[:3], PoolingParams(dimensions=128), use_tqdm=False)
    for f, s in zip(full, short, strict=True):
        raw = np.array(f.outputs.embedding)[:128]
        assert s.outputs.hidden_size == 128
        np.testing.assert_allclose(s.outputs.embedding, raw / np.linalg.norm(raw), atol=1e-6)
    with pytest.raises(ValueError, match=r"supports dimensions \[64, 128, 384\] only"):
        llm.embed("hi", PoolingParams(dimensions=100), use_tqdm=False)
