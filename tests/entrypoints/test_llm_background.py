"""The multiproc `LLM`'s BackgroundEngine: a batch larger than the engine's queue."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from flowengine.engine.protocol import EngineOverloadedError
from flowengine.entrypoints.llm_multiproc import BackgroundEngine


class _QueueLimitedEngine:
    """Stands in for AsyncEngine: refuses a request while `max_queue_len` are in
    flight, as its IngressActor does."""

    max_queue_len = 3

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.max_in_flight = 0

    async def start(self) -> None:
        pass

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        pass

    async def _outputs(self, request_id: str):
        if self.num_in_flight >= self.max_queue_len:
            raise EngineOverloadedError(f"{self.num_in_flight} requests in flight")
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await asyncio.sleep(0.01)
            yield f"out-{request_id}"
        finally:
            self.num_in_flight -= 1

    def submit(self, prompt, params, request_id, *, priority=0, output_kind=None):
        return self._outputs(request_id)

    def encode(self, prompt, params, request_id):
        return self._outputs(request_id)


def _press_ctrl_c_after(started: threading.Event) -> None:
    """SIGINT to this process from a thread, once `started` is set and 0.2 s more have
    passed (the caller waits in generate() by then)."""

    def press() -> None:
        started.wait(5)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press).start()


@pytest.mark.parametrize("method", ["generate", "embed"])
def test_batch_larger_than_the_queue_waits_for_room_instead_of_failing(method):
    """vLLM's LLM takes any number of prompts; the multiproc LLM (the CUDA default)
    used to submit them all at once, so prompt 4097 raised EngineOverloadedError and
    the 4096 before it kept running unseen."""
    engine = _QueueLimitedEngine()
    background = BackgroundEngine(engine)
    try:
        done: list[int] = []
        if method == "generate":
            jobs = [([1, 2], None, f"r{i}", 0) for i in range(10)]
        else:
            jobs = [([1, 2], None, f"r{i}") for i in range(10)]
        outs = getattr(background, method)(jobs, lambda: done.append(1))
    finally:
        background.close()
    assert outs == [f"out-r{i}" for i in range(10)] and len(done) == 10
    assert engine.max_in_flight == engine.max_queue_len


def test_interrupting_a_batch_aborts_its_requests(recwarn):
    """Ctrl-C in `LLM.generate` (a KeyboardInterrupt in the caller's thread) aborts
    the batch's requests, as the in-process LLM does; they used to keep running in
    the engine, unseen, delaying the next batch. The jobs still waiting for room in
    the queue are dropped quietly (not one never-awaited coroutine warning each)."""
    import gc
    import threading

    started = threading.Event()
    ended: list[str] = []

    class EndlessEngine(_QueueLimitedEngine):
        async def _outputs(self, request_id: str):
            started.set()
            try:
                await asyncio.sleep(60)
                yield f"out-{request_id}"
            finally:
                ended.append(request_id)

    background = BackgroundEngine(EndlessEngine())
    try:

        _press_ctrl_c_after(started)
        with pytest.raises(KeyboardInterrupt):
            background.generate([([1], None, f"r{i}", 0) for i in range(5)], lambda: None)
        background.call(asyncio.sleep(0.1))
        assert sorted(ended) == ["r0", "r1", "r2"]  # max_queue_len 3 had started
    finally:
        background.close()
    gc.collect()
    assert not [w for w in recwarn.list if "never awaited" in str(w.message)]


def test_generate_after_shutdown_is_an_engine_dead_error():
    """The multiproc LLM after `shutdown()`: its processes are gone, so generate/embed
    raise EngineDeadError; they used to reach the in-process path and fail with
    "AttributeError: 'LLM' object has no attribute 'engine'"."""
    import itertools
    from types import SimpleNamespace

    from flowengine import LLM, SamplingParams
    from flowengine.engine.protocol import EngineDeadError
    from flowengine.pooling import PoolingParams

    class _Processor:
        def process(self, request_id, prompt, params, **kwargs):
            return SimpleNamespace(request_id=request_id, prompt=prompt, children=[])

    llm = LLM.__new__(LLM)  # no model: what runs after shutdown() is all that matters
    llm.engine_args = SimpleNamespace(placement="multiproc", disable_log_stats=True)
    llm.input_processor = _Processor()
    llm._ids = itertools.count()
    llm._background = BackgroundEngine(_QueueLimitedEngine())
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(["a"], SamplingParams(), use_tqdm=False)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.embed(["a"], PoolingParams(), use_tqdm=False)



def test_ctrl_c_in_llm_generate_is_a_plain_keyboard_interrupt_and_the_llm_stays_usable():
    """Ctrl-C (SIGINT) during the multiproc `LLM.generate`: the caller gets a
    KeyboardInterrupt whose traceback ends in `LLM._run`, with no chained exception,
    and the next generate works. It used to show the frames where the signal landed
    (BackgroundEngine.call, concurrent.futures, threading's lock)."""
    import itertools
    import threading
    import traceback
    from types import SimpleNamespace

    from flowengine import LLM, SamplingParams

    started = threading.Event()

    class SlowFirstBatchEngine(_QueueLimitedEngine):
        async def _outputs(self, request_id: str):
            if request_id == "0":  # the first batch's only request: runs until Ctrl-C
                started.set()
                await asyncio.sleep(60)
            yield SimpleNamespace(request_id=request_id, prompt=None)

    class _Processor:
        def process(self, request_id, prompt, params, **kwargs):
            return SimpleNamespace(request_id=request_id, prompt=prompt, children=[],
                                   prompt_token_ids=[1], cache_salt=None, sampling_params=params)

    llm = LLM.__new__(LLM)  # no model: the frontend's handling is what is tested
    llm.engine_args = SimpleNamespace(placement="multiproc", disable_log_stats=True)
    llm.input_processor = _Processor()
    llm._ids = itertools.count()
    llm._background = BackgroundEngine(SlowFirstBatchEngine())
    try:

        _press_ctrl_c_after(started)
        with pytest.raises(KeyboardInterrupt) as info:
            llm.generate(["a"], SamplingParams(), use_tqdm=False)
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert frames[-2:] == ["generate", "_run"]
        assert info.value.__cause__ is None and info.value.__suppress_context__
        (out,) = llm.generate(["b"], SamplingParams(), use_tqdm=False)
        assert (out.request_id, out.prompt) == ("1", "b")
    finally:
        llm.shutdown()


def test_a_background_engine_never_closed_is_shut_down_at_exit(tmp_path):
    """A script that ends (or ends in Ctrl-C) without `llm.shutdown()`: the engine is
    shut down at exit and the process ends. It used to hang forever: `LLM.__del__`
    waited for the loop thread, which the interpreter had already frozen."""
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "shut_down"
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_llm_background import _QueueLimitedEngine
from flowengine.entrypoints.llm_multiproc import BackgroundEngine

class Engine(_QueueLimitedEngine):
    async def shutdown(self, drain_timeout_s=0.0):
        await asyncio.sleep(0.05)  # needs the loop thread
        open({str(marker)!r}, "w").write(str(drain_timeout_s))

class Holder:  # as LLM: closes its engine in __del__
    def __init__(self):
        self.background = BackgroundEngine(Engine())
    def __del__(self):
        self.background.close()

holder = Holder()
print(holder.background.generate([([1], None, "r0", 0)], lambda: None))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "['out-r0']\n"
    assert marker.read_text() == "5.0"
