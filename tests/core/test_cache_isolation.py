"""Prefix-cache isolation (issue #11 item 5): a secret hash seed per engine run, and
`cache_salt`, so one tenant's cached prefixes neither hit nor can be probed by another."""

from __future__ import annotations

import pytest

from flowengine.config import EngineArgs
from flowengine.core.kv_cache_manager import KVCacheManager
from flowengine.core.kv_cache_utils import hash_token_blocks, new_hash_seed, root_block_hash
from flowengine.engine.builder import ResolvedEngine, build_scheduler
from flowengine.engine.input_processor import InputProcessor
from flowengine.request import Request
from flowengine.sampling_params import SamplingParams

TOKENS = list(range(100, 114))  # 3 full blocks of 4 + 2 tokens


def _resolved() -> ResolvedEngine:
    return ResolvedEngine(EngineArgs(block_size=16), "/m", None, 256, 256, "cpu", "float32",
                          ("m",))


def _req(rid: str, salt: str | None) -> Request:
    return Request(rid, TOKENS, SamplingParams(), eos_token_id=None, max_tokens=4,
                   cache_salt=salt)


def _run(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    manager.free(request)


def test_new_hash_seed_is_fresh_and_secret_sized() -> None:
    seeds = {new_hash_seed() for _ in range(8)}
    assert len(seeds) == 8
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in seeds)


def test_each_engine_scheduler_gets_its_own_seed() -> None:
    a = build_scheduler(_resolved(), 16).kv_cache_manager
    b = build_scheduler(_resolved(), 16).kv_cache_manager
    assert a.root_hash != b.root_hash
    assert root_block_hash("") not in (a.root_hash, b.root_hash)
    # The same prompt hashes differently in the two runs: hashes seen in one run tell
    # nothing about another's, and cannot be precomputed without the seed.
    ra, rb = _req("a", None), _req("b", None)
    for manager, request in ((a, ra), (b, rb)):
        request.prompt_token_ids = list(range(48))
        manager.get_computed_blocks(request)
    assert len(ra.block_hashes) == len(rb.block_hashes) == 3
    assert ra.block_hashes == hash_token_blocks(list(range(48)), 16, a.root_hash)
    assert rb.block_hashes == hash_token_blocks(list(range(48)), 16, b.root_hash)
    assert all(x != y for x, y in zip(ra.block_hashes, rb.block_hashes, strict=True))


@pytest.mark.parametrize(
    ("first", "second", "expected_hit_ids"),
    [
        ("tenant-a", "tenant-a", [0, 1, 2]),  # same salt: the whole cached prefix hits
        ("tenant-a", "tenant-b", []),  # another tenant's salt: nothing
        ("tenant-a", None, []),  # unsalted requests do not see salted blocks
        (None, "tenant-a", []),  # nor salted ones unsalted blocks
        (None, None, [0, 1, 2]),
    ],
)
def test_salt_decides_prefix_hits(first, second, expected_hit_ids) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, hash_seed=new_hash_seed())
    a = _req("a", first)
    _run(manager, a)
    assert a.block_hashes == hash_token_blocks(TOKENS, 4, manager.root_hash, first)
    b = _req("b", second)
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == expected_hit_ids
    assert num_hit == 4 * len(expected_hit_ids)
    assert b.block_hashes == hash_token_blocks(TOKENS, 4, manager.root_hash, second)


def test_input_processor_carries_cache_salt() -> None:
    ip = InputProcessor(None, max_model_len=64, vocab_size=1000, eos_token_id=None)
    params = SamplingParams(n=2, max_tokens=4)
    out = ip.process("r", {"prompt_token_ids": [1, 2, 3], "cache_salt": "t1"}, params)
    assert out.cache_salt == "t1"
    assert [c.cache_salt for c in out.children] == ["t1", "t1"]
    out = ip.process("r", [1, 2, 3], params, cache_salt="t2")
    assert [c.cache_salt for c in out.children] == ["t2", "t2"]
    assert ip.process("r", [1, 2, 3], params).children[0].cache_salt is None
    for bad in ("", 5, b"x"):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            ip.process("r", {"prompt_token_ids": [1, 2, 3], "cache_salt": bad}, params)


@pytest.mark.slow
def test_llm_cache_salt_hits_and_misses(default_model_path) -> None:
    """Through LLM.generate: exact prefix-cache hit counts per salt, same tokens out."""
    from flowengine import LLM

    llm = LLM(default_model_path, max_model_len=256, num_kv_blocks=64)
    stats = llm.engine.scheduler.prefix_cache_stats
    prompt = list(range(1000, 1064))  # 64 tokens: 3 blocks of 16 can hit (last recomputed)
    greedy = SamplingParams(temperature=0, max_tokens=4)

    def hits_of(salt: str | None) -> tuple[int, list[int]]:
        before = stats.num_hit_tokens
        item = {"prompt_token_ids": prompt} | ({} if salt is None else {"cache_salt": salt})
        out = llm.generate([item], greedy, use_tqdm=False)[0]
        return stats.num_hit_tokens - before, list(out.outputs[0].token_ids)

    first_hits, tokens = hits_of("alice")
    assert first_hits == 0
    assert hits_of("alice") == (48, tokens)
    assert hits_of("bob") == (0, tokens)
    assert hits_of(None) == (0, tokens)
    assert hits_of("bob") == (48, tokens)


@pytest.mark.slow
def test_conversation_with_cache_salt(tokenizer) -> None:
    """submit({"messages": [...], "cache_salt": ...}): the chat routes' form."""
    from flowengine.actors.tokenizer import TokenizeJob, TokenizerActor

    ip = InputProcessor(tokenizer, max_model_len=512, vocab_size=len(tokenizer),
                        eos_token_id=None)
    actor = TokenizerActor(ip, None, None)
    conv = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=4)
    salted = actor._process(TokenizeJob("r", {"messages": conv, "cache_salt": "t"}, params, 0,
                                        None))
    plain = actor._process(TokenizeJob("r", conv, params, 0, None))
    assert salted.prompt_token_ids == plain.prompt_token_ids == ip.chat_prompt(conv)[1]
    assert salted.children[0].cache_salt == "t" and plain.children[0].cache_salt is None
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        actor._process(TokenizeJob("r", {"messages": conv, "cache_salt": ""}, params, 0, None))
    with pytest.raises(ValueError, match="'messages' must be a non-empty list"):
        actor._process(TokenizeJob("r", {"messages": [], "cache_salt": "t"}, params, 0, None))
