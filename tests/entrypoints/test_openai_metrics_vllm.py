"""vLLM v1's per-request metrics on /metrics after known requests on the real engine
(exact counts), prompt_tokens_total as prefill tokens computed, and
usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details), through
the `openai` SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 blocks of 16


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=256, num_kv_blocks=64, device="cpu")
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


def _scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
         + ((("le", s.labels["le"]),) if "le" in s.labels else ())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_after_known_requests(live, tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
    name = client.models.list().data[0].id
    labels = (("engine", "0"), ("model_name", name))
    num_prompt = len(tokenizer.encode(PROMPT))
    hit = (num_prompt - 1) // 16 * 16  # full blocks before the last prompt token
    live.server.context.enable_prompt_tokens_details = True
    try:
        first = client.completions.create(model=name, prompt=PROMPT, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
        second = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, n=2,
                                           temperature=0, extra_body={"ignore_eos": True})
    finally:
        live.server.context.enable_prompt_tokens_details = False
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens == num_prompt and first.usage.completion_tokens == 3
    # n=2: usage counts the prompt once (OpenAI's), and so its cached tokens
    assert second.usage.prompt_tokens == num_prompt
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    plain = client.completions.create(model=name, prompt="Hi", max_tokens=1)
    assert plain.usage.prompt_tokens_details is None  # without the flag: no details
    s = _scrape(live)

    computed = num_prompt + 2 * (num_prompt - hit) + len(tokenizer.encode("Hi"))
    assert s[("flowengine:prompt_tokens_total", labels)] == computed
    num_gen = 3 + 4 + 4 + 1
    assert s[("flowengine:request_prompt_tokens_count", labels)] == 4  # engine requests
    assert s[("flowengine:request_prompt_tokens_sum", labels)] == (
        3 * num_prompt + len(tokenizer.encode("Hi"))
    )
    assert s[("flowengine:request_generation_tokens_sum", labels)] == num_gen
    assert s[("flowengine:request_params_n_count", labels)] == 3  # user requests
    assert s[("flowengine:request_params_n_sum", labels)] == 1 + 2 + 1
    assert s[("flowengine:request_params_max_tokens_sum", labels)] == 3 + 4 + 4 + 1
    assert s[("flowengine:iteration_tokens_total_sum", labels)] == computed + num_gen
    for metric in ("queue", "prefill", "decode", "inference"):
        assert s[(f"flowengine:request_{metric}_time_seconds_count", labels)] == 4
        assert s[(f"flowengine:request_{metric}_time_seconds_sum", labels)] >= 0
    tpot = "flowengine:request_time_per_output_token_seconds"
    assert s[(f"{tpot}_count", labels)] == 4
    assert s[(f"{tpot}_bucket", (*labels, ("le", "+Inf")))] == 4
    info = [k for k in s if k[0] == "flowengine:cache_config_info"]
    assert len(info) == 1 and s[info[0]] == 1.0
    assert dict(info[0][1])["block_size"] == "16" and dict(info[0][1])["num_gpu_blocks"] == "64"


def test_tokenize_chat_options_on_the_real_template(live, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue and"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    got = httpx.post(f"{live.base_url}/tokenize", json=body, timeout=30).json()["tokens"]
    # Hugging Face's rendering of the same options (SmolLM2's ChatML template)
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nBlue and")
    assert got == tokenizer.encode(text, add_special_tokens=False)
