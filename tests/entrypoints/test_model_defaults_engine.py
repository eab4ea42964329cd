"""The model's generation_config.json defaults and chat-template options on the real
engine: LLM.generate/chat with no SamplingParams, AsyncEngine.submit(params=None),
--generation-config vllm|DIR, LLM.chat's template options (exact token ids)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flowengine import LLM, SamplingParams
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "device": "cpu"}


@pytest.fixture(scope="module")
def model_dir(default_model_path, tmp_path_factory) -> str:
    """The default model with a generation_config.json that recommends greedy, 4 tokens."""
    folder = tmp_path_factory.mktemp("model")
    for f in Path(default_model_path).iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 4})
    )
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **ENGINE)


def test_llm_uses_the_model_defaults(llm) -> None:
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=4)
    [default] = llm.generate(PROMPT, use_tqdm=False)
    [explicit] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4),
                              use_tqdm=False)
    assert len(default.outputs[0].token_ids) == 4
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
    # Given SamplingParams are taken as they are (vLLM's LLM does the same).
    [given] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert given.outputs[0].token_ids == explicit.outputs[0].token_ids[:2]


def test_llm_chat_template_options(llm) -> None:
    tok = llm.get_tokenizer()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if style is defined %}({{ style }}) {% endif %}{% endif %}")
    messages = [{"role": "user", "content": "Name a colour."}]
    [out] = llm.chat(messages, chat_template=template, chat_template_kwargs={"style": "terse"},
                     use_tqdm=False)
    text = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n(terse) "
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) <= 4  # the model's max_new_tokens
    go_on = [*messages, {"role": "assistant", "content": "Blue and"}]
    [cont] = llm.chat(go_on, chat_template=template, add_generation_prompt=False,
                      continue_final_message=True, use_tqdm=False)
    text = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue and"
    assert cont.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="Cannot set both"):
        llm.chat(go_on, continue_final_message=True, use_tqdm=False)


def test_generation_config_vllm_and_dir(model_dir, tmp_path) -> None:
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import load_engine_tokenizer, make_input_processor, resolve

    def defaults(**kw):
        resolved = resolve(EngineArgs(model=model_dir, **ENGINE, **kw))
        return make_input_processor(load_engine_tokenizer(resolved), resolved).default_params()

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    assert defaults() == SamplingParams(temperature=0.0, max_tokens=4)
    assert defaults(generation_config="vllm") == SamplingParams()
    assert defaults(generation_config=str(tmp_path)) == SamplingParams(top_k=3)
    assert defaults(override_generation_config={"max_new_tokens": 9}) == SamplingParams(
        temperature=0.0, max_tokens=9
    )


def test_submit_without_params_uses_the_model_defaults(model_dir, llm) -> None:
    from flowengine.entrypoints.async_engine import AsyncEngine

    async def run() -> list[int]:
        engine = AsyncEngine(model_dir, **ENGINE)
        try:
            ids: list[int] = []
            async for out in engine.submit(PROMPT, output_kind=RequestOutputKind.DELTA):
                ids.extend(out.outputs[0].token_ids)
            assert engine.default_sampling_params == {"temperature": 0.0, "max_tokens": 4}
            return ids
        finally:
            await engine.shutdown()

    [expected] = llm.generate(PROMPT, use_tqdm=False)
    assert asyncio.run(run()) == expected.outputs[0].token_ids
