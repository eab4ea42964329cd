"""Grammars of the engine's requests: compiled off the step loop, matched per sequence.

The `StructuredOutputManager` lives with the scheduler (vLLM v1's
`StructuredOutputManager`): the scheduler sees every accepted token, so it advances
each request's matcher and fills the token bitmask of the next step's constrained
rows while the executor runs the current step.

- Compiling runs in a thread pool (`compile_threads` workers), never in the step loop;
  a request whose grammar is compiling waits in WAITING (vLLM's WAITING_FOR_FSM) and
  the scheduler admits others meanwhile. Compiled grammars are cached by (backend,
  kind, spec, options), so n samples, and every later request with the same schema,
  compile once.
- Backends (the tokenizer's token table) are built once, on the first constrained
  request, from `tokenizer_loader()`; the tokenizer is loaded in a worker thread too.
- One matcher per `Request` (each of n samples), created when its grammar is ready;
  the tokens the request already has (an engine restart resubmits the delivered
  tokens) are replayed into it first. Preemption keeps the matcher: recompute rebuilds
  KV, not the output.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from flowengine.request import Request
from flowengine.structured_outputs.backend import (
    BACKEND_NAMES,
    CompiledGrammar,
    GrammarMatcher,
    GrammarOptions,
    StructuredOutputBackend,
    bitmask_words,
    select_backend,
)
from flowengine.structured_outputs.validate import grammar_options

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 512


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed int32 value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class StructuredOutputManager:
    """Compiles grammars and keeps one matcher per constrained request.

    Args:
        backend: "auto", "xgrammar" or "guidance" (--structured-outputs-backend).
        vocab_size: the model's vocabulary size (logits width); bitmask rows have
            ceil(vocab_size / 32) int32 words.
        tokenizer_loader: returns the Hugging Face tokenizer (called once, in a
            worker thread); or pass `tokenizer` directly.
        compile_threads: worker threads for compiling.

    Raises ValueError for an unknown backend name.
    """

    def __init__(self, backend: str = "auto", *, vocab_size: int,
                 tokenizer_loader: Callable[[], Any] | None = None, tokenizer: Any = None,
                 compile_threads: int = 2) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(f"structured_outputs_backend must be one of {BACKEND_NAMES}, "
                             f"got {backend!r}")
        if tokenizer is None and tokenizer_loader is None:
            raise ValueError("give tokenizer or tokenizer_loader")
        self.backend = backend
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)
        self._tokenizer = tokenizer
        self._tokenizer_loader = tokenizer_loader
        self._lock = threading.Lock()  # guards _tokenizer and _backends (worker threads)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="fe-grammar")
        self._grammars: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._pending: dict[str, Future[CompiledGrammar]] = {}
        self._matchers: dict[str, GrammarMatcher] = {}
        self._stop_ids: dict[str, list[int]] = {}
        self.num_compiled = 0  # grammars compiled (cache misses) since start

    # ------------------------------------------------------------------ backends
    def _get_backend(self, name: str, eos_token_id: int | None) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            if self._tokenizer is None:
                assert self._tokenizer_loader is not None
                self._tokenizer = self._tokenizer_loader()
            if name == "xgrammar":
                from flowengine.structured_outputs.xgrammar_backend import XgrammarBackend

                backend = XgrammarBackend(self._tokenizer, self.vocab_size)
            else:
                from flowengine.structured_outputs.guidance_backend import GuidanceBackend

                backend = GuidanceBackend(self._tokenizer, self.vocab_size,
                                          eos_token_id=eos_token_id)
            self._backends[name] = backend
            return backend

    def _compile(self, name: str, kind: str, spec: str, options: GrammarOptions,
                 eos_token_id: int | None) -> CompiledGrammar:
        grammar = self._get_backend(name, eos_token_id).compile(kind, spec, options)
        self.num_compiled += 1
        return grammar

    def grammar_future(self, kind: str, spec: str, options: GrammarOptions,
                       eos_token_id: int | None = None) -> Future[CompiledGrammar]:
        """The (cached) compile of (kind, spec); ValueError in the future if invalid."""
        name = select_backend(self.backend, kind, spec)
        key = (name, kind, spec, options)
        future = self._grammars.get(key)
        if future is not None:
            self._grammars.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, name, kind, spec, options, eos_token_id)
        self._grammars[key] = future
        while len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return future

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (no-op without structured_outputs)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self._pending[request.request_id] = self.grammar_future(
            params.kind, params.spec, grammar_options(params), request.eos_token_id)

    def has_matcher(self, request_id: str) -> bool:
        """True for a constrained request whose matcher exists (grammar ready)."""
        return request_id in self._matchers

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def poll(self, request: Request) -> str | None:
        """Make the request's matcher once its grammar is compiled.

        Returns None when the request may be scheduled (ready, or unconstrained),
        "compiling" while it must wait, or an error message (invalid grammar, or its
        delivered tokens do not match it) for a request that must fail.
        """
        req_id = request.request_id
        future = self._pending.get(req_id)
        if future is None:
            return None
        if not future.done():
            return "compiling"
        del self._pending[req_id]
        try:
            grammar = future.result()
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # a backend failure: this request fails, others go on
            logger.error("compiling the grammar of request %s failed: %r", req_id, exc)
            return f"structured outputs: compiling the grammar failed: {type(exc).__name__}"
        stop_ids = [request.eos_token_id] if request.eos_token_id is not None else []
        matcher = grammar.new_matcher(stop_ids)
        for token_id in request.output_token_ids:  # replay after an engine restart
            if not matcher.accept_token(token_id):
                return (f"structured outputs: the request's earlier token {token_id} does "
                        "not match its grammar")
        self._matchers[req_id] = matcher
        self._stop_ids[req_id] = stop_ids
        return None

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is not compiled yet (or not polled since)."""
        return len(self._pending)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until some pending compile is done, at most `timeout_s` (for a driver
        with nothing else to schedule)."""
        pending = [f for f in self._pending.values() if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance the request's matcher; False if a token was refused (True for an
        unconstrained request)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        for token_id in token_ids:
            if matcher.is_terminated():
                # Past the end (ignore_eos keeps a finished output going): only stop tokens.
                if token_id not in self._stop_ids[request_id]:
                    return False
            elif not matcher.accept_token(token_id):
                return False
        return True

    def remove(self, request_id: str) -> None:
        """Forget a finished request (its compiled grammar stays cached)."""
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._stop_ids.pop(request_id, None)

    # ------------------------------------------------------------------ bitmask
    def fill_bitmask(self, request_ids: Sequence[str]) -> bytes:
        """The next-token bitmask of `request_ids` (each with a matcher), one row each in
        order: [len(request_ids), num_words] int32, little-endian, as bytes (the form
        it travels in a StepPlan). A terminated matcher allows only its stop tokens."""
        bitmask = torch.full((len(request_ids), self.num_words), -1, dtype=torch.int32)
        for row, req_id in enumerate(request_ids):
            matcher = self._matchers[req_id]
            if matcher.is_terminated():
                bitmask[row] = 0
                for t in self._stop_ids[req_id]:
                    if t < self.vocab_size:
                        bitmask[row, t // 32] |= _bit(t % 32)
            else:
                matcher.fill_bitmask(bitmask, row)
        return bitmask.numpy().tobytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
