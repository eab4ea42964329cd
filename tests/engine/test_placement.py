"""placement "auto" and async_scheduling None (the defaults): multiproc with async
scheduling on CUDA for a caller that can start the engine processes (the server,
`AsyncEngine`, the offline `LLM`), inproc without it on the CPU and where the core is
built in process; explicit values are kept (config.settle_defaults)."""

from __future__ import annotations

import argparse

import pytest

from flowengine.config import EngineArgs, settle_defaults
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from


@pytest.mark.parametrize(("device", "frontend", "want", "want_async"), [
    ("cuda", True, "multiproc", True),
    ("cpu", True, "inproc", False),
    ("cuda", False, "inproc", False),
    ("cpu", False, "inproc", False),
])
def test_auto_settles_by_device_and_caller(device: str, frontend: bool, want: str,
                                           want_async: bool) -> None:
    args = EngineArgs(model="m", max_num_seqs=7)
    assert (args.placement, args.async_scheduling) == ("auto", None)
    settled = settle_defaults(args, device, frontend=frontend)
    assert (settled.placement, settled.async_scheduling) == (want, want_async)
    assert (settled.model, settled.max_num_seqs) == ("m", 7)  # nothing else changes


@pytest.mark.parametrize("placement", ["inproc", "multiproc"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_explicit_values_are_kept(placement: str, async_scheduling: bool) -> None:
    args = EngineArgs(placement=placement, async_scheduling=async_scheduling)
    for device in ("cuda", "cpu"):
        assert settle_defaults(args, device, frontend=True) is args


def test_pipeline_parallel_keeps_async_scheduling_off() -> None:
    args = EngineArgs(pipeline_parallel_size=2)
    settled = settle_defaults(args, "cuda", frontend=True)
    assert (settled.placement, settled.async_scheduling) == ("multiproc", False)
    with pytest.raises(ValueError, match="turn async_scheduling off"):
        EngineArgs(pipeline_parallel_size=2, async_scheduling=True)


def test_parallel_sizes_still_force_multiproc_and_cli_default_is_auto() -> None:
    assert EngineArgs(tensor_parallel_size=2).placement == "multiproc"
    assert EngineArgs(tensor_parallel_size=2, placement="inproc").placement == "multiproc"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).placement == "auto"
    assert engine_args_from(parser.parse_args([])).async_scheduling is None
    for flag, want in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        assert engine_args_from(parser.parse_args([flag])).async_scheduling is want
    assert engine_args_from(parser.parse_args(["--placement", "inproc"])).placement == "inproc"
    with pytest.raises(SystemExit):
        parser.parse_args(["--placement", "nowhere"])
    with pytest.raises(ValueError, match="placement must be one of"):
        EngineArgs(placement="nowhere")


def test_settling_keeps_what_resolve_decided(default_model_path) -> None:
    """LLM and AsyncEngine settle the defaults on top of resolve()'s args, which carry
    resolve's own decisions: the pinned model and GGUF weights kept quantized on the CPU.
    (Settling the caller's args instead once lost the quantization: the default model
    ran dequantized in float32, 5x slower per token.)"""
    import asyncio

    from flowengine import LLM
    from flowengine.entrypoints.async_engine import AsyncEngine
    from flowengine.model.layers.quant_linear import QuantizedWeight

    llm = LLM(max_model_len=256)
    args = llm.resolved.args
    assert (args.placement, args.async_scheduling) == ("inproc", False)
    assert (args.quantization, args.load_format, args.model) == ("gguf", "gguf",
                                                                 default_model_path)
    model = llm.engine.executor.runner.model
    assert any(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in model.modules())

    async def started() -> tuple:
        engine = AsyncEngine(max_model_len=256)
        await engine.start()
        try:
            a = engine.resolved.args
            return (engine.args.placement, a.placement, a.async_scheduling, a.quantization,
                    a.model)
        finally:
            await engine.shutdown()

    assert asyncio.run(started()) == ("inproc", "inproc", False, "gguf", default_model_path)


def test_offline_llm_settles_as_a_caller_that_starts_the_engine(monkeypatch) -> None:
    """`LLM` resolves with frontend=True, so on CUDA its "auto" placement is the engine
    processes with async scheduling, as the server's (and vLLM's LLM) is; on the CPU the
    same call still settles in process (the first parametrised case above)."""
    import flowengine.engine.builder as builder
    from flowengine import LLM

    seen: list[bool] = []

    class Stop(Exception):
        pass

    def fake_resolve(args: EngineArgs, *, frontend: bool = False):
        seen.append(frontend)
        settled = settle_defaults(args, "cuda", frontend=frontend)
        assert (settled.placement, settled.async_scheduling) == ("multiproc", True)
        raise Stop

    monkeypatch.setattr(builder, "resolve", fake_resolve)
    with pytest.raises(Stop):
        LLM("some-model")
    assert seen == [True]
