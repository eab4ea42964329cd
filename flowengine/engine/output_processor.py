"""Frontend side of results: token-id deltas → text, stop strings, `RequestOutput`s.

Runs in the frontend (DESIGN.md §7): the Detokenizer actor wraps it, and the
in-process `LLM` calls it directly. Stop strings are matched here on characters; a
match finishes the sample and reports its id so the engine can free its blocks.

This is where engine deltas become what the caller asked for: each request's
`SamplingParams.output_kind` (`RequestOutputKind`) picks cumulative outputs, deltas or
one final output. Nothing downstream re-accumulates; a stream its caller has not read
yet only folds pending outputs with `RequestOutput.add`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from flowengine.engine.input_processor import ProcessedPrompt
from flowengine.messages import NewRequest, RequestDelta, TokenLogprobs
from flowengine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from flowengine.pooling.params import EmbeddingOutput, EmbeddingRequestOutput, finish_embedding
from flowengine.sampling_params import RequestOutputKind
from flowengine.tokenize.text_state import IncrementalTextState

# Placeholder of a sample's new_token_ids between outputs; never mutated (see below).
_NO_TOKENS: list[int] = []


def _no_text(token_ids: list[int]) -> None:
    return None


@dataclass(slots=True)
class _SampleState:
    """Text state of one sample (one child request)."""

    index: int
    text_state: IncrementalTextState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What changed since the last RequestOutput (streaming deltas). NOTE: new_token_ids
    # is rebound, never mutated: it may be a delta's own list, handed on to the caller.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    dirty: bool = False
    # SamplingParams.detokenize: False leaves text "" and logprob tokens undecoded.
    detokenize: bool = True
    # The request's output kind is DELTA: collect new_* for the next output.
    delta: bool = False
    # Tokens applied since the last output that carried this sample (stream_interval).
    unsent: int = 0


@dataclass(slots=True)
class _RequestState:
    prompt: ProcessedPrompt
    samples: list[_SampleState]
    num_unfinished: int
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # streaming: they go out once
    pooled: bytes | None = None  # embedding requests: the raw pooled vector
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    sent_any: bool = False  # an output of this request went out (stream_interval)


class OutputProcessor:
    """Turns engine deltas into `RequestOutput`s, per user request.

    Each request gets the outputs its `SamplingParams.output_kind` asks for:
    CUMULATIVE (every step, everything so far), DELTA (every step that changed it,
    only what is new) or FINAL_ONLY (one output when it finished; a cumulative output
    of every running request on every step costs O(length) each).

    Args:
        tokenizer: the Hugging Face tokenizer, for detokenization and logprob texts.
        stream: True → DELTA for every request, whatever its params say.
        final_only: True → FINAL_ONLY for every request (the offline `LLM` keeps
            nothing else). Neither: each request's own `output_kind`.
        stream_interval: DELTA and CUMULATIVE requests get an output when a sample
            has this many tokens not yet sent, and at once for the request's first
            output, a finished sample or an error (vLLM's and SGLang's
            `--stream-interval`; 1: every step that changed the request). Text and
            stop strings are still processed token by token.

    Raises ValueError for stream and final_only together, or stream_interval < 1.
    """

    def __init__(self, tokenizer: Any, *, stream: bool = False, final_only: bool = False,
                 stream_interval: int = 1) -> None:
        if stream and final_only:
            raise ValueError("final_only applies to cumulative outputs; pass stream=False")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.stream = stream
        self.final_only = final_only
        self._forced_kind: RequestOutputKind | None = (
            RequestOutputKind.DELTA if stream
            else RequestOutputKind.FINAL_ONLY if final_only else None
        )
        self._requests: dict[str, _RequestState] = {}
        # Child (engine-side) request id -> (parent id, its state, the child's sample).
        self._children: dict[str, tuple[str, _RequestState, _SampleState]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, processed: ProcessedPrompt) -> None:
        """Know `processed` from now on. Raises ValueError when its id, or the engine-side
        id of one of its samples (`child_request_id`: "R-i" for n > 1), is in use by a
        live request or sample: the engine and this processor key samples by those ids,
        so two of them would share (and lose) each other's outputs."""
        if processed.request_id in self._requests:
            raise ValueError(f"request id {processed.request_id!r} is already in use")
        children = self._children
        for child in processed.children:
            if child.request_id in children:
                raise ValueError(
                    f"request id {processed.request_id!r}: its sample id {child.request_id!r} "
                    f"is already in use by request {children[child.request_id][0]!r}")
        params = processed.sampling_params
        kind = self._forced_kind
        if kind is None:
            kind = params.output_kind
        delta = kind == RequestOutputKind.DELTA
        samples = [
            _SampleState(
                index=i,
                text_state=IncrementalTextState(self.tokenizer, processed.prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                detokenize=params.detokenize,
                delta=delta,
            )
            for i in range(params.n)
        ]
        state = _RequestState(processed, samples, len(samples), kind=kind)
        self._requests[processed.request_id] = state
        for child, sample in zip(processed.children, samples, strict=True):
            self._children[child.request_id] = (processed.request_id, state, sample)

    def child_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return [] if state is None else [c.request_id for c in state.prompt.children]

    def process(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[str]]:
        """Apply deltas. Returns (outputs of requests that changed, child ids to stop).

        The ids to stop are samples finished here by a stop string; the caller tells the
        engine (as an abort) so their KV blocks are freed.
        """
        # NOTE: hot path, run for every request on every step; keep it lean.
        children = self._children
        interval = self.stream_interval
        touched: dict[str, _RequestState] = {}
        to_stop: list[str] = []
        for delta in deltas:
            where = children.get(delta.req_id)
            if where is None:
                continue  # aborted by the caller, or finished by a stop string already
            parent_id, state, sample = where
            if sample.finish_reason is not None:
                continue
            if delta.num_cached_tokens and sample.index == 0:
                state.num_cached_tokens = delta.num_cached_tokens
            if delta.error:
                state.error = delta.error
            if delta.pooled is not None:
                state.pooled = delta.pooled
            if delta.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = self._prompt_logprobs(state, delta.prompt_logprobs)
            if self._apply(sample, delta):
                to_stop.append(delta.req_id)
            if sample.finish_reason is not None:
                state.num_unfinished -= 1
            if state.num_unfinished == 0:
                touched[parent_id] = state
            elif state.kind != RequestOutputKind.FINAL_ONLY:
                if interval == 1:
                    touched[parent_id] = state
                else:
                    sample.unsent += len(delta.new_token_ids)
                    if (sample.unsent >= interval or not state.sent_any
                            or sample.finish_reason is not None or delta.error):
                        touched[parent_id] = state
        outputs = []
        for rid, st in touched.items():
            out = self._make_output(rid, st)
            outputs.append(out)
            if out.finished:
                self._forget(rid)
        return outputs, to_stop

    def _apply(self, sample: _SampleState, delta: RequestDelta) -> bool:
        """Update one sample; True if a stop string finished it here."""
        stream = sample.delta
        new_token_ids = delta.new_token_ids
        if len(new_token_ids) > 1 and sample.text_state.stop_checker is not None:
            return self._apply_one_by_one(sample, delta)
        sample.token_ids += new_token_ids
        if stream:
            # Usually one delta per output: pass its list on rather than copy it.
            if sample.dirty:
                sample.new_token_ids = sample.new_token_ids + new_token_ids
            else:
                sample.new_token_ids = new_token_ids
        sample.dirty = True
        if delta.new_logprobs and sample.logprobs is not None:
            for lp, tok in zip(delta.new_logprobs, new_token_ids, strict=False):
                entry = self._logprob_entry(lp, tok, sample.detokenize)
                sample.logprobs.append(entry)
                if stream:
                    sample.new_logprobs.append(entry)
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp.sampled_logprob
        finish_reason = delta.finish_reason
        if not sample.detokenize:  # token ids only (no stop strings: SamplingParams says so)
            if finish_reason is not None:
                sample.finish_reason, sample.stop_reason = finish_reason, delta.stop_reason
            return False
        text, matched = sample.text_state.process(
            new_token_ids, finish_reason is not None, stopped_by_token=finish_reason == "stop"
        )
        if text and stream:
            sample.new_text += text
        if matched is not None:
            sample.finish_reason, sample.stop_reason = "stop", matched
            return finish_reason is None
        if finish_reason is not None:
            sample.finish_reason, sample.stop_reason = finish_reason, delta.stop_reason
        return False

    def _apply_one_by_one(self, sample: _SampleState, delta: RequestDelta) -> bool:
        """Several tokens in one delta (speculative decoding) for a sample with stop
        strings: apply them one at a time, so a stop string that ends inside the run
        drops the tokens after it, exactly as when they come one per step."""
        ids, lps = delta.new_token_ids, delta.new_logprobs
        last = len(ids) - 1
        for j, token_id in enumerate(ids):
            part = msgspec.structs.replace(
                delta, new_token_ids=[token_id],
                new_logprobs=None if lps is None else lps[j:j + 1],
                finish_reason=delta.finish_reason if j == last else None,
                stop_reason=delta.stop_reason if j == last else None)
            stopped = self._apply(sample, part)
            if sample.finish_reason is not None:
                return stopped and delta.finish_reason is None
        return False

    def _logprob_entry(
        self, lp: TokenLogprobs, sampled: int, detokenize: bool = True
    ) -> dict[int, Logprob]:
        decode = self.tokenizer.decode if detokenize else _no_text
        entry: dict[int, Logprob] = {}
        for rank, (tok, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True)):
            entry[tok] = Logprob(value, rank + 1, decode([tok]))
        if sampled not in entry:
            entry[sampled] = Logprob(lp.sampled_logprob, lp.sampled_rank, decode([sampled]))
        return entry

    def _prompt_logprobs(self, state: _RequestState, lps: list[TokenLogprobs]) -> PromptLogprobs:
        """vLLM's form: None for the first prompt token, then one dict per token."""
        ids = state.prompt.prompt_token_ids
        detokenize = state.prompt.sampling_params.detokenize
        out: PromptLogprobs = [None]
        out.extend(self._logprob_entry(lp, tok, detokenize)
                   for lp, tok in zip(lps, ids[1:], strict=True))
        return out

    def _make_output(self, request_id: str, state: _RequestState) -> RequestOutput:
        if state.prompt.pooling_params is not None:
            return self._make_embedding_output(request_id, state)  # type: ignore[return-value]
        completions = []
        kind = state.kind
        if kind == RequestOutputKind.DELTA:
            for s in state.samples:
                if not s.dirty:
                    continue
                completions.append(
                    CompletionOutput(
                        s.index,
                        s.new_text,
                        s.new_token_ids,
                        s.cumulative_logprob,
                        s.new_logprobs if s.logprobs is not None else None,
                        s.finish_reason,
                        s.stop_reason,
                    )
                )
                # The delta's lists change hands: fresh ones collect the next delta.
                s.new_token_ids = _NO_TOKENS
                if s.logprobs is not None:
                    s.new_logprobs = []
                s.new_text = ""
                s.dirty = False
        else:
            # CUMULATIVE outputs are snapshots (the lists keep growing here); the one
            # FINAL_ONLY output takes the request's own lists, which are done.
            final = kind == RequestOutputKind.FINAL_ONLY
            for s in state.samples:
                logprobs = s.logprobs
                completions.append(
                    CompletionOutput(
                        s.index,
                        s.text_state.output_text,
                        s.token_ids if final else list(s.token_ids),
                        s.cumulative_logprob,
                        logprobs if final or logprobs is None else list(logprobs),
                        s.finish_reason,
                        s.stop_reason,
                    )
                )
                s.new_text = ""
                s.dirty = False
        if self.stream_interval > 1:
            state.sent_any = True
            for s in state.samples:
                s.unsent = 0
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA and prompt_logprobs is not None:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id,
            state.prompt.prompt,
            state.prompt.prompt_token_ids,
            completions,
            state.num_unfinished == 0,
            state.num_cached_tokens,
            state.error,
            prompt_logprobs,
        )

    def _make_embedding_output(self, request_id: str, state: _RequestState
                               ) -> EmbeddingRequestOutput:
        """An embedding request's one output (it finishes in its only step): the vector
        with the request's dimensions and normalisation, or the error."""
        params = state.prompt.pooling_params
        assert params is not None
        outputs = None
        error = state.error
        if state.pooled is not None:
            outputs = EmbeddingOutput(finish_embedding(state.pooled, params, True))
        elif error is None:
            # Aborted (the caller went away) or ended without a vector.
            error = f"the request ended ({state.samples[0].finish_reason}) without an embedding"
        return EmbeddingRequestOutput(request_id, outputs, state.prompt.prompt_token_ids,
                                      state.num_unfinished == 0, state.prompt.prompt, error)

    def resubmit_requests(self) -> list[NewRequest]:
        """`NewRequest`s that recompute every unfinished sample after an engine restart.

        Each carries the tokens already delivered (`output_token_ids`), so the engine
        continues after them and the caller receives no token twice.
        """
        msgs = []
        for state in self._requests.values():
            for child, sample in zip(state.prompt.children, state.samples, strict=True):
                if sample.finish_reason is None:
                    msgs.append(
                        msgspec.structs.replace(child, output_token_ids=list(sample.token_ids))
                    )
        return msgs

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids (to abort in the engine)."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        children = [c.request_id for c in state.prompt.children]
        self._forget(request_id)
        return children

    def _forget(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            for child in state.prompt.children:
                self._children.pop(child.request_id, None)
