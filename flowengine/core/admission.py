"""Checks at the scheduler's door: limits that a config or a request must respect.

Each error says which number is too large and what to change (CONVENTIONS.md habit 3).

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.request import Request


def check_scheduler_config(config: SchedulerConfig) -> None:
    """Raise ValueError for limits below 1, or for chunked prefill off with
    max_num_batched_tokens < max_model_len (a long prompt could never be scheduled)."""
    if min(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) < 1:
        raise ValueError(
            f"max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1: {config}"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({config.max_num_batched_tokens}) is below "
            f"max_model_len ({config.max_model_len}) with chunked prefill off, so a long "
            "prompt could never be scheduled; raise max_num_batched_tokens to "
            f"{config.max_model_len} or enable chunked prefill"
        )


def check_request_fits(
    request: Request, scheduler_config: SchedulerConfig, cache_config: CacheConfig
) -> None:
    """Raise ValueError for an empty prompt, a prompt (plus any outputs carried over from
    an engine restart) longer than max_model_len, or one larger than the whole KV cache
    (num_blocks * block_size tokens)."""
    num_tokens = request.num_tokens
    max_model_len = scheduler_config.max_model_len
    capacity_tokens = cache_config.num_usable_blocks * cache_config.block_size
    if request.num_prompt_tokens == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if num_tokens > max_model_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens, but max_model_len is {max_model_len} "
            "(prompt + max_tokens must fit); shorten the prompt or raise max_model_len"
        )
    if num_tokens > capacity_tokens:
        raise ValueError(
            f"prompt has {num_tokens} tokens, but the whole KV cache holds {capacity_tokens} "
            f"({cache_config.num_usable_blocks} blocks of {cache_config.block_size}); shorten the "
            "prompt or give the KV cache more memory (num_kv_blocks, kv_cache_memory_bytes "
            "or gpu_memory_utilization)"
        )


# How many batches' worth of requests may wait for their first token (see below).
QUEUE_BATCHES = 2


def default_max_queue_len(max_num_seqs: int, num_kv_blocks: int) -> int:
    """The server's default `--max-queue-len`: requests that may wait for their first
    token at once before new ones get 429 (issue 21 item 4).

    Rule: `QUEUE_BATCHES x seats`, where seats = min(max_num_seqs, num_kv_blocks) is
    how many sequences can run at once (each running sequence holds at least one KV
    block; `num_kv_blocks` <= 0 means unknown, then max_num_seqs alone). A burst of
    one full batch is admitted whole, one more batch waits behind it, and a request
    beyond that would wait more than two generations' time, so it is better told to
    retry (or go to another replica) at once. At least 1.
    """
    seats = max_num_seqs if num_kv_blocks <= 0 else min(max_num_seqs, num_kv_blocks)
    return max(1, QUEUE_BATCHES * seats)
