"""During a beam search the beams of a prompt hold its full KV blocks once, each with
reference count = beam width (prefix-cache hits, vLLM v1's way); each beam's partial
last block is its own (recomputed each step)."""

from __future__ import annotations

from flowengine.beam_search import BeamSearchParams

BLOCK_SIZE = 16
PROMPT_LEN = 40  # 2 full blocks + 8 tokens of a third
WIDTH = 4


def test_beams_share_the_prompt_blocks(beam_llm, tokenizer):
    llm = beam_llm
    # A prompt no other test sends, so none of its blocks is in the prefix cache.
    text = "Sharing test: the quick brown fox jumps over the lazy dog. " * 8
    prompt = tokenizer.encode(text)[:PROMPT_LEN]
    assert len(prompt) == PROMPT_LEN
    core = llm.engine
    kv = core.scheduler.kv_cache_manager
    pool = kv.block_pool
    assert kv.block_size == BLOCK_SIZE
    assert pool.ref_counts() == {}
    # New blocks come from the free queue's head (prefix-cache entries there are
    # evicted), and blocks a step frees go to its tail.
    free = pool.free_block_queue.block_ids()
    snapshots: list[tuple[dict[int, int], list[list[int]]]] = []
    execute = core.execute

    def execute_and_look(plan):
        # Blocks are allocated once the step is planned and freed when its one-token
        # requests finish: look while the step runs.
        ids = [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]
        tables = [kv.get_block_ids(rid) for rid in ids]
        snapshots.append((pool.ref_counts(), tables))
        return execute(plan)

    core.execute = execute_and_look
    try:
        out = llm.beam_search([{"prompt_token_ids": prompt}],
                              BeamSearchParams(beam_width=WIDTH, max_tokens=5,
                                               ignore_eos=True))
    finally:
        del core.execute
    assert len(out[0].sequences) == WIDTH
    assert len(snapshots) == 5  # one engine step per generated token
    # Step 1: the prompt alone (one beam): the queue's first three blocks a, b, c.
    a, b, c = free[:3]
    refs, tables = snapshots[0]
    assert tables == [[a, b, c]] and refs == {a: 1, b: 1, c: 1}
    # Step 1's full blocks a and b are now prefix-cache entries; its partial block c
    # went back to the free queue's tail. Every later step: the WIDTH beams hit a and b
    # (ref count WIDTH) and each takes one fresh block for its partial third block.
    for refs, tables in snapshots[1:]:
        assert len(tables) == WIDTH
        assert all(t[:2] == [a, b] and len(t) == 3 for t in tables)
        tails = sorted(t[2] for t in tables)
        assert len(set(tails)) == WIDTH and not {a, b} & set(tails)
        assert refs == {a: WIDTH, b: WIDTH, **{t: 1 for t in tails}}
    # The first such step takes the next WIDTH blocks of the queue's head.
    assert [t[2] for t in snapshots[1][1]] == free[3:3 + WIDTH]
    assert pool.ref_counts() == {}  # all freed at the end


def test_a_salted_search_keeps_its_blocks_under_its_salt(beam_llm, tokenizer):
    # Every step runs under the prompt's cache_salt: a request with another salt, or
    # none, gets no prefix-cache hit on the searched prompt (found by a fresh tester:
    # only the first step was salted, so an unsalted request hit the tenant's blocks).
    from flowengine.sampling_params import SamplingParams

    text = "Salted search: a tenant's private prompt that no other test sends. " * 8
    prompt = tokenizer.encode(text)[:PROMPT_LEN]
    beam_llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}],
                         BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    one = SamplingParams(max_tokens=1)
    other, unsalted, same = beam_llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, {"prompt_token_ids": prompt},
         {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], one, use_tqdm=False)
    assert (other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 2 * BLOCK_SIZE  # the search's own salt does hit
