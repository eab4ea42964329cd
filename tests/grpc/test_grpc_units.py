"""The gRPC servicer over the deterministic fake engine, in process: the shared
admission limit, cancellation aborting the engine request, a dead engine and a
draining server, health status, and the proto -> SamplingParams mapping."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from flowengine.entrypoints.grpc import generate_pb2 as pb  # noqa: E402
from flowengine.entrypoints.grpc import generate_pb2_grpc as pb_grpc  # noqa: E402
from flowengine.entrypoints.grpc.server import GrpcServer, sampling_params_from  # noqa: E402
from flowengine.entrypoints.openai.generation import Admission  # noqa: E402
from flowengine.entrypoints.openai.sampling import RequestLimits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
from openai_fake_engine import FakeEngine  # noqa: E402


def _run(scenario, limits=None, health_interval_s=0.05, api_key=None, **engine_kwargs):
    async def main():
        engine = FakeEngine(**engine_kwargs)
        admission = Admission(max_queue_len=1)
        server = GrpcServer(engine, ("fake-model",), admission,
                            health_interval_s=health_interval_s, limits=limits,
                            api_key=api_key)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(engine, admission, server, channel)
        finally:
            await server.stop(grace_s=1.0)

    asyncio.run(main())


def _request(text: str = "abc", **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling_params=pb.SamplingParams(temperature=0.0, **params))


def test_unary_and_stream_over_the_fake_engine():
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        out = await stub.Generate(_request("abc", max_tokens=5))
        # The fake engine echoes the prompt cyclically: a b c a b.
        assert out.text == "abcab" and list(out.token_ids) == [97, 98, 99, 97, 98]
        assert out.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
        chunks = [c async for c in stub.GenerateStream(_request("xy", max_tokens=3))]
        assert [c.text for c in chunks] == ["x", "y", "x"]
        assert [c.finish_reason for c in chunks] == ["", "", "length"]
        assert not chunks[0].HasField("usage") and chunks[-1].usage.completion_tokens == 3
        ids = await stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[65, 66]),
                                                     sampling_params=pb.SamplingParams(
                                                         temperature=0.0, max_tokens=2)))
        assert ids.text == "AB"
        assert admission.num_pending == 0

    _run(scenario)


def test_admission_is_shared_with_http():
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        admission.enter()  # an HTTP request waiting for its first token fills the queue
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(_request(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        admission.leave()
        assert (await stub.Generate(_request(max_tokens=2))).text == "ab"
        assert admission.num_pending == 0

    _run(scenario)


def test_max_request_tokens_is_checked_as_on_http():
    """--max-request-tokens holds for gRPC calls too (it did not: a call could ask for
    more tokens than the server lets an HTTP request ask for)."""
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        for request in (_request(max_tokens=9), _request()):  # unset: 16
            for call in (stub.Generate, lambda r: stub.GenerateStream(r).read()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "over this server's limit of 8 (--max-request-tokens)" in err.value.details()
        assert (await stub.Generate(_request(max_tokens=8))).text == "abcabcab"
        assert not engine.running and admission.num_pending == 0

    _run(scenario, limits=RequestLimits(max_request_tokens=8))


def test_cancelling_a_call_aborts_its_engine_request():
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        call = stub.GenerateStream(pb.GenerateRequest(
            text="abc", request_id="to-cancel",
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=400)))
        for _ in range(2):
            await call.read()
        assert "to-cancel" in engine.running
        call.cancel()
        for _ in range(200):
            if "to-cancel" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["to-cancel"] and not engine.running
        assert admission.num_pending == 0

    _run(scenario, step_s=0.01)


def test_dead_engine_and_draining_server():
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == serving
        engine.dead = True
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(_request(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(100):
            resp = await health.Check(health_pb2.HealthCheckRequest(service="flowengine.v1.Generate"))
            if resp.status != serving:
                break
            await asyncio.sleep(0.02)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        engine.dead = False
        server.servicer.draining = True
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(_request(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in err.value.details()

    _run(scenario)


def test_start_draining_refuses_new_calls_and_running_ones_finish():
    """When the HTTP server starts its drain (SIGTERM), gRPC refuses new calls and
    reports NOT_SERVING at once, while running calls finish (it went on admitting calls
    and reporting SERVING until the HTTP drain had ended)."""
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        running = stub.GenerateStream(_request("abc", max_tokens=30))
        first = await running.read()
        server.start_draining()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(_request(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for service in ("", "flowengine.v1.Generate"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        texts = [first.text]
        while (chunk := await running.read()) is not grpc.aio.EOF:
            texts.append(chunk.text)
            finish_reason = chunk.finish_reason
        assert "".join(texts) == "abc" * 10 and finish_reason == "length"

    # A refresh interval longer than the test: NOT_SERVING comes from start_draining.
    _run(scenario, health_interval_s=60.0, step_s=0.005)


def test_engine_failure_is_internal_and_its_cause_stays_in_the_log(caplog):
    """An exception of the server's own mid-call is INTERNAL with HTTP's 500 message,
    logged with its traceback (it was UNKNOWN with the exception's text sent to the
    client)."""
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        engine.fail_after_tokens = 2
        async def read_all(request):
            return [c async for c in stub.GenerateStream(request)]

        for call in (stub.Generate, read_all):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(_request(max_tokens=5))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert err.value.details() == "internal server error; see the server log"
        engine.fail_after_tokens = None
        assert (await stub.Generate(_request(max_tokens=2))).text == "ab"
        assert not engine.running and admission.num_pending == 0

    _run(scenario)
    assert "fake engine failure" in caplog.text


def test_api_key_is_required_as_on_http():
    """With --api-key, a call needs the metadata `authorization: Bearer <key>` (gRPC
    served anyone: the key that guards HTTP did not guard this door); health needs none."""
    async def scenario(engine, admission, server, channel):
        stub = pb_grpc.GenerateStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sekrit"),),
                         (("x-api-key", "sekrit"),)):
            for call in (stub.Generate, lambda r, **kw: stub.GenerateStream(r, **kw).read()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(_request(max_tokens=2), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <key>" in err.value.details()
        assert not engine.submitted
        ok = (("authorization", "Bearer sekrit"),)
        assert (await stub.Generate(_request(max_tokens=2), metadata=ok)).text == "ab"
        chunks = [c async for c in stub.GenerateStream(_request(max_tokens=2), metadata=ok)]
        assert "".join(c.text for c in chunks) == "ab"
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert admission.num_pending == 0

    _run(scenario, api_key="sekrit")


def test_sampling_params_mapping():
    msg = pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=7, stop=["\n"],
                            stop_token_ids=[2], seed=3, ignore_eos=True)
    params = sampling_params_from(msg, {"temperature": 0.2, "repetition_penalty": 1.1})
    # float32 on the wire, the client's decimal back (0.7, not 0.699999988).
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 5)
    assert params.max_tokens == 7 and params.stop == ["\n"] and params.stop_token_ids == [2]
    assert params.seed == 3 and params.ignore_eos is True
    assert params.repetition_penalty == 1.1  # the model's default fills an unset field
    assert sampling_params_from(pb.SamplingParams(), {}).max_tokens == 16
    # temperature 0 is set (greedy), not "unset".
    assert sampling_params_from(pb.SamplingParams(temperature=0.0), {"temperature": 0.6}
                                ).temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_from(pb.SamplingParams(top_p=1.5), {})


def test_grpc_calls_get_what_is_left_of_the_graceful_timeout():
    """After SIGTERM, running gRPC calls may take what is left of --graceful-timeout
    since the drain began, as HTTP's streams do (they had only 10 s once the HTTP
    drain ended, however long --graceful-timeout was); a dead engine or a stop
    without a drain keeps the short engine timeout, a second stop request none."""
    from flowengine.entrypoints.openai.server import ENGINE_SHUTDOWN_TIMEOUT_S, grpc_grace_s

    assert grpc_grace_s(120.0, 1000.0, 1002.5, engine_died=False) == 117.5
    assert grpc_grace_s(120.0, 1000.0, 1200.0, engine_died=False) == 0.0
    assert grpc_grace_s(120.0, 1000.0, 1002.5, engine_died=True) == ENGINE_SHUTDOWN_TIMEOUT_S
    assert grpc_grace_s(120.0, None, 1002.5, engine_died=False) == ENGINE_SHUTDOWN_TIMEOUT_S
    # a second SIGTERM cancels HTTP's requests at once, and gRPC's
    assert grpc_grace_s(120.0, 1000.0, 1002.5, engine_died=False, forced=True) == 0.0


@pytest.mark.parametrize(("model_max_tokens", "asked", "expected"), [
    (None, None, 16), (None, 500, 500),  # no max_new_tokens: the request's, else 16
    (8, None, 8), (8, 5, 5), (8, 500, 8),  # max_new_tokens 8 caps the request's
    (300, None, 16), (300, 500, 300),
])
def test_max_tokens_follows_the_completions_route(model_max_tokens, asked, expected):
    """The model's max_new_tokens (generation_config.json, defaults' "max_tokens") caps
    max_tokens as on /v1/completions (vLLM's get_max_tokens); it used to replace an
    unset one (300, not 16) and to be ignored when set (500, not 300 or 8)."""
    from flowengine.entrypoints.openai.protocol import CompletionRequest
    from flowengine.entrypoints.openai.sampling import completion_params

    defaults = {} if model_max_tokens is None else {"max_tokens": model_max_tokens}
    msg = pb.SamplingParams() if asked is None else pb.SamplingParams(max_tokens=asked)
    assert sampling_params_from(msg, defaults).max_tokens == expected
    http = CompletionRequest(prompt="abc") if asked is None else CompletionRequest(
        prompt="abc", max_tokens=asked)
    assert completion_params(http, defaults).max_tokens == expected
