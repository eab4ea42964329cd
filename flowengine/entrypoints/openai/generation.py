"""One engine request as the HTTP handlers use it: admitted, primed, timed, aborted.

`EngineStream.open` submits a prompt and waits for the first output before the HTTP
response starts, so that bad input (the engine raises before any output) is answered
with a status code rather than an error event in a 200 stream. Closing a stream that
has not finished aborts the request in the engine, which frees its KV blocks; the
handlers close streams in `finally` blocks, so a client that disconnects (its task is
cancelled) aborts its request within one engine step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from flowengine.engine.protocol import EngineClient, EngineDeadError, EngineOverloadedError
from flowengine.entrypoints.openai.errors import APIError, internal_error
from flowengine.errors import RequestValidationError
from flowengine.messages import REQUEST_ERROR_PREFIX, is_request_error
from flowengine.outputs import RequestOutput
from flowengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class Admission:
    """Server-side queue limit: requests submitted but still without a first output.

    Args:
        max_queue_len: most such requests at once; None for no limit (the engine's own
            limit, `EngineOverloadedError`, still applies).
    """

    def __init__(self, max_queue_len: int | None) -> None:
        self.max_queue_len = max_queue_len
        self.num_pending = 0

    def enter(self) -> None:
        """Count one more pending request. Raises APIError(429) when the queue is full."""
        if self.max_queue_len is not None and self.num_pending >= self.max_queue_len:
            raise APIError(
                429,
                f"the server queue is full ({self.max_queue_len} requests waiting for their "
                "first token); retry later",
                type="rate_limit_error",
                code="queue_full",
                retry_after_s=1.0,
            )
        self.num_pending += 1

    def leave(self) -> None:
        self.num_pending -= 1


def output_error(error: str) -> APIError:
    """The client-facing error for a RequestOutput's `error`: 400 when the request caused
    it (`is_request_error`: its constraints left no token to sample), else 500."""
    if is_request_error(error):
        return APIError(400, error.removeprefix(REQUEST_ERROR_PREFIX))
    return APIError(500, error, type="server_error", code="engine_error")


def engine_error(err: BaseException) -> APIError:
    """The client-facing error for an exception raised by `EngineClient.submit`.

    400 for the request's own fault: a RequestValidationError (its message and
    `param`), or an exception whose message starts with REQUEST_ERROR_PREFIX; 429 for
    EngineOverloadedError, 503 for EngineDeadError; any other exception (a TypeError
    or ValueError of a bug included) is 500 with a generic message, its traceback
    logged."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, EngineOverloadedError):
        return APIError(
            429,
            str(err),
            type="rate_limit_error",
            code="queue_full",
            retry_after_s=err.retry_after_s,
        )
    if isinstance(err, EngineDeadError):
        return APIError(
            503,
            f"the engine is not running: {err}",
            type="service_unavailable_error",
            code="engine_dead",
            retry_after_s=1.0,
        )
    if isinstance(err, RequestValidationError):
        # A RequestFieldError (input_processor.py) names the field it refuses.
        return APIError(400, str(err), param=err.param)
    if is_request_error(str(err)):
        return APIError(400, str(err).removeprefix(REQUEST_ERROR_PREFIX))
    # Any other exception is the server's fault (vLLM's InternalServerError): the
    # traceback goes to the log, the client gets no internal text.
    logger.error("engine request failed", exc_info=err)
    return internal_error()


class EngineStream:
    """The outputs of one submitted request; iterate it once, then `aclose()` it.

    Attributes:
        request_id: the engine request id.
        num_prompt_tokens: prompt length in tokens.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finished: True once the output with `finished=True` was yielded.
    """

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        iterator: AsyncIterator[RequestOutput],
        first: RequestOutput,
        arrival_s: float,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self._iterator = iterator
        self._first: RequestOutput | None = first
        self._arrival_s = arrival_s
        self._first_token_s: float | None = None
        # FINAL_ONLY: one output at the end, so no first-token time is seen here (the
        # engine's RequestStats has it, for /metrics).
        self._sees_first_token = output_kind != RequestOutputKind.FINAL_ONLY
        self.first_output = first
        self.num_prompt_tokens = len(first.prompt_token_ids)
        self.num_cached_tokens = first.num_cached_tokens  # prefix-cache hit tokens
        self.num_generated_tokens = 0
        self.finished = False
        self._closed = False
        self._observe(first)  # the first token time (for the request log) is now

    @classmethod
    async def open(
        cls,
        engine: EngineClient,
        prompt: str | list[int] | list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        admission: Admission | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> EngineStream:
        """Submit and wait for the first output. Raises APIError (400/429/500/503).

        output_kind: DELTA for routes that format each output as it comes (SSE
        chunks); FINAL_ONLY for non-streaming routes, whose one output is the whole
        result (then "the first output" is the last one, and `admission` counts the
        request until it). TTFT, inter-token and end-to-end latencies are taken by the
        engine (`RequestStats`) whatever the kind."""
        if admission is not None:
            admission.enter()
        arrival_s = time.monotonic()
        iterator: AsyncIterator[RequestOutput] | None = None
        try:
            iterator = engine.submit(prompt, params, request_id, priority=priority,
                                     output_kind=output_kind)
            first = await anext(iterator)
        except StopAsyncIteration:
            await _close(engine, iterator, request_id, abort=False)
            logger.error("request %s: the engine ended the stream without output", request_id)
            raise internal_error() from None
        except BaseException as err:
            # Cancelled (client gone) or failed: nothing may keep running for it.
            bad_input = isinstance(err, RequestValidationError)
            await _close(engine, iterator, request_id, abort=not bad_input)
            if isinstance(err, Exception):
                raise engine_error(err) from err
            raise
        finally:
            if admission is not None:
                admission.leave()
        stream = cls(engine, request_id, iterator, first, arrival_s, output_kind)
        if first.error is not None:
            # Failed before any output reached the client: answer with a status code.
            await stream.aclose()
            raise output_error(first.error)
        return stream

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs up to the finished one. Raises APIError for engine errors."""
        if self._first is not None:
            out, self._first = self._first, None
            yield out
        while not self.finished:
            try:
                out = await anext(self._iterator)
            except StopAsyncIteration:
                logger.error("request %s: the engine stream ended unfinished", self.request_id)
                raise internal_error() from None
            except Exception as err:
                raise engine_error(err) from err
            self._observe(out)
            if out.error is not None:
                raise output_error(out.error)
            yield out

    def _observe(self, out: RequestOutput) -> None:
        num_new = sum(len(c.token_ids) for c in out.outputs)
        now = time.monotonic()
        if num_new:
            self.num_generated_tokens += num_new
            if self._first_token_s is None and self._sees_first_token:
                self._first_token_s = now
        if out.finished:
            self.finished = True

    @property
    def ttft_s(self) -> float | None:
        """Seconds from submit to the first generated token; None before it, and for a
        FINAL_ONLY stream (it sees the tokens only at the end)."""
        return None if self._first_token_s is None else self._first_token_s - self._arrival_s

    @property
    def elapsed_s(self) -> float:
        """Seconds since submit."""
        return time.monotonic() - self._arrival_s

    async def aclose(self) -> None:
        """Release the engine iterator; aborts the request unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await _close(self.engine, self._iterator, self.request_id, abort=not self.finished)


async def _close(
    engine: EngineClient,
    iterator: AsyncIterator[RequestOutput] | None,
    request_id: str,
    *,
    abort: bool,
) -> None:
    aclose = getattr(iterator, "aclose", None)
    try:
        if aclose is not None:
            await aclose()
        if abort:
            # NOTE: closing the iterator already aborts in a conforming engine; the
            # explicit abort makes the release immediate for any EngineClient and is a
            # no-op for an id the engine no longer knows.
            await engine.abort(request_id)
    except Exception:
        logger.exception("request %s: abort failed", request_id)
