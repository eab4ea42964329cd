"""Engine flags vLLM users set (issue #11 item 7): each parsed, and each one reaching the
code it controls."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging

import pytest

from flowengine import SamplingParams
from flowengine.config import EngineArgs
from flowengine.engine.protocol import EngineStats
from flowengine.engine.stat_logger import StatLoggerActor, StatLogLine, log_stats_interval_s
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from


def _args(*flags: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from(parser.parse_args(list(flags)))


def test_every_engine_arg_has_a_flag() -> None:
    """Every EngineArgs field is settable from the command line (and so is read: the
    tests below and the rest of the suite cover what each one changes)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    dests = {a.dest for a in parser._actions}
    assert sorted(f.name for f in dataclasses.fields(EngineArgs) if f.name not in dests) == []


# ------------------------------------------------------------------ chunked prefill
def test_enable_chunked_prefill_flag() -> None:
    assert _args().enable_chunked_prefill is True
    assert _args("--enable-chunked-prefill").enable_chunked_prefill is True
    assert _args("--no-enable-chunked-prefill").enable_chunked_prefill is False


@pytest.mark.slow
def test_no_chunked_prefill_reaches_the_scheduler(default_model_path) -> None:
    from flowengine.engine.builder import build_scheduler, resolve

    on = resolve(_args(default_model_path, "--max-model-len", "512",
                       "--max-num-batched-tokens", "64", "--device", "cpu"))
    off = resolve(_args(default_model_path, "--max-model-len", "512",
                        "--max-num-batched-tokens", "64", "--device", "cpu",
                        "--no-enable-chunked-prefill"))
    assert on.max_num_batched_tokens == 64
    # Without chunking a whole prompt must fit one step: the budget becomes max_model_len.
    assert off.max_num_batched_tokens == 512
    scheduler = build_scheduler(off, 64)
    assert scheduler.config.enable_chunked_prefill is False
    assert build_scheduler(on, 64).config.enable_chunked_prefill is True


# ------------------------------------------------------------------ KV blocks
def test_num_gpu_blocks_override_is_num_kv_blocks() -> None:
    assert _args("--num-gpu-blocks-override", "37").num_kv_blocks == 37
    assert _args("--num-kv-blocks", "41").num_kv_blocks == 41
    assert EngineArgs.from_kwargs(num_gpu_blocks_override=37).num_kv_blocks == 37
    with pytest.raises(TypeError, match="not both"):
        EngineArgs.from_kwargs(num_gpu_blocks_override=37, num_kv_blocks=37)
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 1"):
        EngineArgs.from_kwargs(num_gpu_blocks_override=0)


@pytest.mark.slow
def test_num_gpu_blocks_override_sizes_the_cache(default_model_path) -> None:
    from flowengine.engine.builder import num_kv_blocks_for, resolve

    resolved = resolve(_args(default_model_path, "--num-gpu-blocks-override", "37",
                             "--kv-cache-memory-bytes", str(1 << 30), "--device", "cpu"))
    assert num_kv_blocks_for(resolved, bytes_per_block=4096) == 37


def test_kv_cache_dtype_flag_choices() -> None:
    """vLLM's --kv-cache-dtype values this engine has: float16 / bfloat16 name the cache's
    dtype outright; an unknown one is argparse's error."""
    for value in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"):
        assert _args("--kv-cache-dtype", value).kv_cache_dtype == value
    with pytest.raises(SystemExit):
        _args("--kv-cache-dtype", "fp8_e5m2")


def test_dtype_takes_vllms_half_and_float() -> None:
    """vLLM's --dtype choices include "half" (float16) and "float" (float32); they name
    the same dtypes here, from the command line and from LLM(dtype=...) alike."""
    assert _args("--dtype", "half").dtype == "float16"
    assert _args("--dtype", "float").dtype == "float32"
    for value in ("auto", "float32", "bfloat16", "float16"):
        assert _args("--dtype", value).dtype == value
    assert EngineArgs.from_kwargs(dtype="half").dtype == "float16"
    assert EngineArgs(dtype="float").dtype == "float32"
    with pytest.raises(SystemExit):
        _args("--dtype", "fp16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="fp16")


def test_serve_takes_the_model_as_a_flag_too(tmp_path) -> None:
    """`vllm serve --model MODEL` works as `vllm serve MODEL`; so does flowengine's, and
    two different models are refused by name."""
    from flowengine.entrypoints.openai.server import make_parser

    def model(*argv: str) -> str | None:
        return engine_args_from(make_parser().parse_args(list(argv))).model

    assert model("--model", "org/name") == "org/name"
    assert model("org/name") == "org/name"
    assert model("org/name", "--model", "org/name") == "org/name"
    assert model() is None
    with pytest.raises(ValueError, match="two models given: 'a/b'.*'c/d'"):
        model("a/b", "--model", "c/d")


def test_half_kv_cache_of_another_dtype_refused_on_cuda(default_model_path, monkeypatch) -> None:
    """On CUDA the attention kernels read a cache of the model dtype or fp8: a float16
    cache under bf16 activations is refused at start-up with what to change."""
    import torch

    from flowengine.engine.builder import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 with --dtype bfloat16 on "
                                         "CUDA.*use auto, fp8, or --dtype float16"):
        resolve(_args(default_model_path, "--device", "cuda", "--kv-cache-dtype", "float16"))


def test_gguf_on_the_cpu_defaults_to_a_float16_kv_cache(default_model_path) -> None:
    """GGUF weights on the CPU with --dtype auto: float32 activations, a float16 KV cache
    (vLLM's GGUF dtype, llama.cpp's cache type); --dtype float32 or an explicit
    --kv-cache-dtype keeps what was asked."""
    from flowengine.engine.builder import resolve
    from flowengine.model.gguf_convert import conversion_source

    gguf = conversion_source(default_model_path)
    for flags, dtype, kv in ([(), "float32", "float16"],
                             [("--dtype", "float32"), "float32", "auto"],
                             [("--kv-cache-dtype", "fp8"), "float32", "fp8"]):
        resolved = resolve(_args(gguf, "--device", "cpu", *flags))
        assert resolved.args.quantization == "gguf"
        assert (resolved.dtype, resolved.args.kv_cache_dtype) == (dtype, kv), flags
    # float weights keep auto (the model dtype)
    assert resolve(_args(default_model_path, "--device", "cpu")).args.kv_cache_dtype == "auto"


@pytest.mark.slow
def test_float16_kv_cache_on_the_cpu_holds_twice_the_blocks(default_model_path) -> None:
    """`--kv-cache-dtype float16` under float32 activations (CPU): the cache is float16,
    so the same byte budget holds twice the blocks of the float32 (auto) cache."""
    import torch

    from flowengine import LLM

    blocks = {}
    for kv in ("auto", "float16"):
        llm = LLM(default_model_path, kv_cache_dtype=kv, kv_cache_memory_bytes=64 << 20,
                  max_model_len=512, placement="inproc")
        try:
            runner = llm.engine.executor.runner
            assert runner.kv_caches[0].dtype == (torch.float16 if kv == "float16"
                                                 else torch.float32)
            blocks[kv] = llm.engine.scheduler.make_stats().num_total_blocks
            out = llm.generate(["The capital of France is"],
                               SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()
    assert blocks["float16"] == 2 * blocks["auto"]


# ------------------------------------------------------------------ trust_remote_code
def _custom_config_model(tmp_path) -> str:
    """A model directory whose config class is the repository's own code (auto_map)."""
    (tmp_path / "configuration_flowtest.py").write_text(
        "from transformers import LlamaConfig\n\n"
        "class FlowTestConfig(LlamaConfig):\n"
        "    model_type = 'flowtest_llama'\n"
    )
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "flowtest_llama",
        "architectures": ["LlamaForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_flowtest.FlowTestConfig"},
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "hidden_act": "silu",
    }))
    return str(tmp_path)


def test_trust_remote_code_flag() -> None:
    assert _args().trust_remote_code is False
    assert _args("--trust-remote-code").trust_remote_code is True


def test_remote_code_model_refused_without_trust_remote_code(tmp_path) -> None:
    from flowengine.engine.builder import resolve

    model = _custom_config_model(tmp_path)
    with pytest.raises(ValueError, match="--trust-remote-code"):
        resolve(_args(model, "--device", "cpu"))


def test_remote_code_model_loads_with_trust_remote_code(tmp_path) -> None:
    from flowengine.engine.builder import resolve

    model = _custom_config_model(tmp_path)
    resolved = resolve(_args(model, "--device", "cpu", "--trust-remote-code"))
    assert resolved.model_config.hidden_size == 64
    assert resolved.model_config.num_kv_heads == 2
    assert resolved.max_model_len == 512


def test_tokenizer_gets_trust_remote_code(monkeypatch, tmp_path) -> None:
    from flowengine.engine import builder

    seen = {}

    def fake_load(path, revision=None, *, trust_remote_code=False):
        seen.update(path=path, trust_remote_code=trust_remote_code)
        return "tok"

    monkeypatch.setattr("flowengine.tokenize.tokenizer.load_tokenizer", fake_load)
    args = EngineArgs(tokenizer=str(tmp_path), trust_remote_code=True)
    resolved = builder.ResolvedEngine(args, "/m", None, 16, 16, "cpu", "float32", ("m",))
    assert builder.load_engine_tokenizer(resolved) == "tok"
    assert seen == {"path": str(tmp_path), "trust_remote_code": True}
    resolved = dataclasses.replace(resolved, args=EngineArgs())
    builder.load_engine_tokenizer(resolved)
    assert seen == {"path": "/m", "trust_remote_code": False}


@pytest.mark.slow
def test_remote_code_tokenizer_refused_then_loaded(default_model_path, tmp_path) -> None:
    """A tokenizer class from the repository's own code (auto_map), for real."""
    import shutil

    from flowengine.engine import builder

    shutil.copy(f"{default_model_path}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenization_flowtest.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n"
        "class FlowTestTokenizerFast(PreTrainedTokenizerFast):\n    pass\n"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "FlowTestTokenizerFast",
        "auto_map": {"AutoTokenizer": [None, "tokenization_flowtest.FlowTestTokenizerFast"]},
    }))

    def resolved(**kwargs):
        args = EngineArgs(tokenizer=str(tmp_path), **kwargs)
        return builder.ResolvedEngine(args, "/m", None, 16, 16, "cpu", "float32", ("m",))

    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        builder.load_engine_tokenizer(resolved())
    tok = builder.load_engine_tokenizer(resolved(trust_remote_code=True))
    assert type(tok).__name__ == "FlowTestTokenizerFast"
    assert tok.encode("Hello") == builder.load_engine_tokenizer(
        dataclasses.replace(resolved(), args=EngineArgs(tokenizer=default_model_path))
    ).encode("Hello")


# ------------------------------------------------------------------ log stats
def test_disable_log_stats_flag_and_defaults() -> None:
    assert _args().disable_log_stats is False
    assert _args("--disable-log-stats").disable_log_stats is True


def test_stat_log_line_exact_numbers() -> None:
    prev = EngineStats(prompt_tokens_total=100, generation_tokens_total=50,
                       prefix_cache_queries_total=64, prefix_cache_hits_total=16)
    now = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                      prompt_tokens_total=300, generation_tokens_total=90,
                      prefix_cache_queries_total=144, prefix_cache_hits_total=76)
    line = StatLogLine.between(prev, now, 4.0)
    assert line == StatLogLine(50.0, 10.0, 3, 2, 25.0, 75.0)
    assert line.format() == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 75.0%"
    )
    assert StatLogLine.between(now, now, 1.0).prefix_cache_hit_rate_pct == 0.0


def test_stat_logger_levels(caplog) -> None:
    t = [0.0]
    snapshots = [EngineStats()] + [EngineStats(prompt_tokens_total=20)] * 3
    actor = StatLoggerActor(lambda: snapshots.pop(0), interval_s=10.0, clock=lambda: t[0])
    caplog.set_level(logging.DEBUG, logger="flowengine.stats")
    assert actor.log_once() is None  # the first snapshot only starts the interval
    levels = []
    for _ in range(3):
        t[0] += 10.0
        actor.log_once()
        levels.append(caplog.records[-1].levelno)
    # busy interval INFO, the first idle one still INFO, later idle ones DEBUG
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG]
    assert caplog.records[0].getMessage().startswith("Avg prompt throughput: 2.0 tokens/s")


def test_log_stats_interval_env(monkeypatch) -> None:
    monkeypatch.delenv("FLOWENGINE_LOG_STATS_INTERVAL", raising=False)
    assert log_stats_interval_s() == 10.0
    monkeypatch.setenv("FLOWENGINE_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval_s() == 0.5
    monkeypatch.setenv("FLOWENGINE_LOG_STATS_INTERVAL", "0")
    with pytest.raises(ValueError, match="must be > 0"):
        log_stats_interval_s()


def test_log_stats_interval_env_not_a_number_is_named(monkeypatch) -> None:
    # Was float()'s "could not convert string to float: 'abc'", naming no variable,
    # as `flowengine serve`'s start-up error after the model had loaded.
    monkeypatch.setenv("FLOWENGINE_LOG_STATS_INTERVAL", "abc")
    with pytest.raises(ValueError) as info:
        log_stats_interval_s()
    assert str(info.value) == "FLOWENGINE_LOG_STATS_INTERVAL must be a number of seconds, got 'abc'"


@pytest.mark.slow
@pytest.mark.parametrize("disable_log_stats", [False, True])
def test_async_engine_logs_stats_unless_disabled(default_model_path, monkeypatch, caplog,
                                                 disable_log_stats) -> None:
    from flowengine.entrypoints.async_engine import AsyncEngine

    monkeypatch.setenv("FLOWENGINE_LOG_STATS_INTERVAL", "0.05")
    caplog.set_level(logging.DEBUG, logger="flowengine.stats")

    async def main() -> None:
        engine = AsyncEngine(default_model_path, max_model_len=256, num_kv_blocks=64,
                             disable_log_stats=disable_log_stats)
        await engine.start()
        try:
            async for _ in engine.submit("Hello", SamplingParams(max_tokens=4, temperature=0)):
                pass
            await asyncio.sleep(0.3)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "flowengine.stats"]
    if disable_log_stats:
        assert lines == []
    else:
        assert lines and all(m.startswith("Avg prompt throughput: ") for m in lines)
        # The request's tokens were counted in some interval.
        assert any("Avg generation throughput: 0.0 tokens/s" not in m for m in lines)


def test_llm_defaults_to_disable_log_stats(monkeypatch) -> None:
    """LLM() passes disable_log_stats=True unless told otherwise (vLLM's LLM default)."""
    from flowengine.entrypoints import llm as llm_module

    captured = {}

    def stop(args, **_):
        captured["args"] = args
        raise RuntimeError("stop after the arguments")

    monkeypatch.setattr("flowengine.engine.builder.resolve", stop)
    for kwargs, expected in (({}, True), ({"disable_log_stats": False}, False)):
        with pytest.raises(RuntimeError, match="stop after"):
            llm_module.LLM(**kwargs)
        assert captured["args"].disable_log_stats is expected


# ------------------------------------------------------------------ request logs
def test_enable_log_requests_and_max_log_len_flags() -> None:
    args = _args()
    assert (args.enable_log_requests, args.max_log_len) == (False, None)
    args = _args("--enable-log-requests", "--max-log-len", "12")
    assert (args.enable_log_requests, args.max_log_len) == (True, 12)
    with pytest.raises(ValueError, match="max_log_len must be >= 0"):
        _args("--max-log-len", "-1")


def test_stream_interval_flag() -> None:
    assert _args().stream_interval == 1
    assert _args("--stream-interval", "8").stream_interval == 8
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        _args("--stream-interval", "0")


def test_request_log_line_keeps_prompts_out_unless_asked() -> None:
    from flowengine.engine.input_processor import ProcessedPrompt
    from flowengine.engine.request_logger import RequestLogger

    params = SamplingParams(max_tokens=3, temperature=0)
    p = ProcessedPrompt("r1", "secret prompt text", [5, 6, 7, 8], params, [], "tenant")
    line = RequestLogger().format("r1", p)
    assert line == f"Received request r1: prompt_tokens=4, params={params!r}, cache_salt=<set>"
    assert "secret" not in line and "tenant" not in line
    line = RequestLogger(max_log_len=6).format("r1", p)
    assert line.endswith(", cache_salt=<set>, prompt='secret', prompt_token_ids=[5, 6, 7, 8]")
    line = RequestLogger(max_log_len=2).format("r1", p)
    assert line.endswith("prompt='se', prompt_token_ids=[5, 6]")


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "expected"), [
    ({}, []),
    ({"enable_log_requests": True}, ["Received request q1: prompt_tokens="]),
    ({"enable_log_requests": True, "max_log_len": 5}, ["Received request q1: prompt_tokens="]),
])
def test_async_engine_request_log(default_model_path, caplog, flags, expected) -> None:
    from flowengine.entrypoints.async_engine import AsyncEngine

    caplog.set_level(logging.INFO, logger="flowengine.requests")

    async def main() -> None:
        engine = AsyncEngine(default_model_path, max_model_len=256, num_kv_blocks=64,
                             disable_log_stats=True, **flags)
        await engine.start()
        try:
            async for _ in engine.submit("Hello there", SamplingParams(max_tokens=2), "q1"):
                pass
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "flowengine.requests"
             and r.levelno == logging.INFO]
    assert [m[: len(e)] for m, e in zip(lines, expected, strict=True)] == expected
    for m in lines:
        assert ("prompt='Hello'" in m) is ("max_log_len" in flags)
        assert "Hello there" not in m


def test_version_flag_and_single_version_source(capsys) -> None:
    import importlib.metadata

    import flowengine
    from flowengine.entrypoints.cli import main
    from flowengine.version import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"flowengine {__version__}\n"
    assert flowengine.__version__ is __version__
    assert importlib.metadata.version("flowengine") == __version__
    assert "AsyncEngine" in flowengine.__all__


@pytest.mark.slow
def test_in_process_llm_logs_stats_when_asked(default_model_path, monkeypatch, caplog) -> None:
    from flowengine import LLM

    monkeypatch.setenv("FLOWENGINE_LOG_STATS_INTERVAL", "0.000001")  # every step
    caplog.set_level(logging.DEBUG, logger="flowengine.stats")
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    quiet = LLM(default_model_path, max_model_len=256, num_kv_blocks=64)
    quiet.generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert quiet._stats is None and caplog.records == []

    llm = LLM(default_model_path, max_model_len=256, num_kv_blocks=64, disable_log_stats=False)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], greedy, use_tqdm=False)
    stats = llm._stats.get_stats()
    assert stats.prompt_tokens_total == 7
    assert stats.generation_tokens_total == sum(len(o.outputs[0].token_ids) for o in outs) == 10
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(m.startswith("Avg prompt throughput: ") for m in lines)
