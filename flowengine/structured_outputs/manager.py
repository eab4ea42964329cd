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
- Bitmask rows live in one persistent buffer, a row ("slot") per matcher, refilled
  only when the matcher changed since its last fill (a token accepted; a matcher past
  its end keeps its stop-token row). The rows of a step are filled in one batched call
  per backend (xgrammar's `BatchGrammarMatcher`, llguidance's `LLExecutor`), outside
  the GIL, on `fill_threads` threads once a step has `PARALLEL_FILL_ROWS` rows to fill
  (one thread below: waking threads costs more than a few rows take).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
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
# Rows to fill in one step from which the batched fill uses `fill_threads` threads.
PARALLEL_FILL_ROWS = 64


def default_fill_threads() -> int:
    """Threads for a large step's bitmask fill: FLOWENGINE_GRAMMAR_FILL_THREADS, else 1.
    xgrammar's threads did not pay at 32-128 rows on the 16-core H200 host nor on the
    2-core CPU (docs/benchmarks.md: 2, 4 and 8 threads slower than one)."""
    env = os.environ.get("FLOWENGINE_GRAMMAR_FILL_THREADS")
    if env:
        value = int(env)
        if value < 1:
            raise ValueError(f"FLOWENGINE_GRAMMAR_FILL_THREADS must be >= 1, got {env!r}")
        return value
    return 1


class StructuredOutputManager:
    """Compiles grammars and keeps one matcher per constrained request.

    Args:
        backend: "auto", "xgrammar" or "guidance" (--structured-outputs-backend).
        vocab_size: the model's vocabulary size (logits width); bitmask rows have
            ceil(vocab_size / 32) int32 words.
        tokenizer_loader: returns the Hugging Face tokenizer (called once, in a
            worker thread); or pass `tokenizer` directly.
        compile_threads: worker threads for compiling.
        fill_threads: threads of a step's batched bitmask fill from PARALLEL_FILL_ROWS
            rows on (default `default_fill_threads()`).

    Raises ValueError for an unknown backend name or fill_threads < 1.
    """

    def __init__(self, backend: str = "auto", *, vocab_size: int,
                 tokenizer_loader: Callable[[], Any] | None = None, tokenizer: Any = None,
                 compile_threads: int = 2, fill_threads: int | None = None) -> None:
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
        # Matchers whose one-token advance may go to their backend's batched accept
        # (xgrammar, ending only on one of its stop tokens, which it has).
        self._batchable: dict[str, GrammarMatcher] = {}
        # Requests whose matcher accepted a stop token (terminated; xgrammar's only way).
        self._ended: set[str] = set()
        self.num_compiled = 0  # grammars compiled (cache misses) since start
        self.fill_threads = default_fill_threads() if fill_threads is None else fill_threads
        if self.fill_threads < 1:
            raise ValueError(f"fill_threads must be >= 1, got {fill_threads}")
        # Bitmask rows: slot per matcher; `_dirty` = matchers changed since their fill.
        self._row_bytes = 4 * self.num_words
        self._rows = torch.zeros((0, self.num_words), dtype=torch.int32)
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._dirty: set[str] = set()
        self.num_rows_filled = 0  # rows computed by a matcher (not reused) since start

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
        if (stop_ids and getattr(matcher, "batch_accept_token", None) is not None
                and getattr(matcher, "terminates_on_stop_token_only", False)):
            self._batchable[req_id] = matcher
        if matcher.is_terminated():
            self._ended.add(req_id)
        self._assign_slot(req_id)
        return None

    def _assign_slot(self, req_id: str) -> None:
        if not self._free_slots:
            old = self._rows
            capacity = max(16, 2 * old.shape[0])
            self._rows = torch.zeros((capacity, self.num_words), dtype=torch.int32)
            self._rows[:old.shape[0]] = old
            self._free_slots = list(range(capacity - 1, old.shape[0] - 1, -1))
        self._slots[req_id] = self._free_slots.pop()
        self._dirty.add(req_id)

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
        unconstrained request). A matcher past its end (ignore_eos keeps a finished
        output going) takes only its stop tokens."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        self._dirty.add(request_id)
        stop_ids = self._stop_ids[request_id]
        # xgrammar ends only on a stop token: is_terminated() needs asking only then
        # (one C++ call less per token; the scheduler makes one per request per step).
        cheap = getattr(matcher, "terminates_on_stop_token_only", False) and stop_ids
        ended = self._ended
        for token_id in token_ids:
            if request_id in ended:
                if token_id not in stop_ids:
                    return False
            elif not cheap and matcher.is_terminated():
                ended.add(request_id)
                if token_id not in stop_ids:
                    return False
            elif not matcher.accept_token(token_id):
                return False
            elif cheap and token_id in stop_ids and matcher.is_terminated():
                ended.add(request_id)
        return True

    def accept_tokens_batch(self, items: Sequence[tuple[str, Sequence[int]]]) -> list[bool]:
        """`accept_tokens` of each (request_id, token_ids), in order (one call per step
        from the scheduler). The common case, one token that is no stop token for a
        matcher that ends only on one (xgrammar), goes to one batched call
        (`batch_accept_token`: one library call, GIL released, for every such row); the
        rest take `accept_tokens`. NOTE: hot path, every constrained row every step."""
        batchable = self._batchable
        stop_ids = self._stop_ids
        ended = self._ended
        rows: list[int] = []
        batch_ids: list[str] = []
        batch_matchers: list[Any] = []
        batch_tokens: list[int] = []
        rest: list[int] = []
        for i, (request_id, token_ids) in enumerate(items):
            matcher = batchable.get(request_id)
            if matcher is not None and len(token_ids) == 1 and request_id not in ended:
                token_id = token_ids[0]
                if token_id not in stop_ids[request_id]:
                    rows.append(i)
                    batch_ids.append(request_id)
                    batch_matchers.append(matcher)
                    batch_tokens.append(token_id)
                    continue
            rest.append(i)
        results = [True] * len(items)
        if batch_matchers:
            self._dirty.update(batch_ids)
            if len(batch_matchers) == 1:
                flags = [batch_matchers[0].accept_token(batch_tokens[0])]
            else:
                flags = type(batch_matchers[0]).batch_accept_token(batch_matchers, batch_tokens)
            if not all(flags):
                for i, ok in zip(rows, flags, strict=True):
                    if not ok:
                        results[i] = False
        accept = self.accept_tokens
        for i in rest:
            results[i] = accept(*items[i])
        return results

    def remove(self, request_id: str) -> None:
        """Forget a finished request (its compiled grammar stays cached)."""
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._stop_ids.pop(request_id, None)
        self._batchable.pop(request_id, None)
        self._ended.discard(request_id)
        self._dirty.discard(request_id)
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    # ------------------------------------------------------------------ bitmask
    def fill_bitmask(self, request_ids: Sequence[str]) -> bytes:
        """The next-token bitmask of `request_ids` (each with a matcher), one row each in
        order: [len(request_ids), num_words] int32, little-endian, as bytes (the form
        it travels in a StepPlan). A terminated matcher allows only its stop tokens.

        Only rows whose matcher changed since its last fill are computed (one batched
        call per backend, GIL released); the others are reused from the buffer."""
        slots = self._slots
        dirty = self._dirty
        rows = self._rows
        stale = [rid for rid in request_ids if rid in dirty]
        if stale:
            batches: dict[Any, tuple[list[Any], list[int]]] = {}
            ended = self._ended
            for rid in stale:
                slot = slots[rid]
                matcher = self._matchers[rid]
                if rid in ended or (not getattr(matcher, "terminates_on_stop_token_only", False)
                                    and matcher.is_terminated()):
                    ended.add(rid)
                    self._write_stop_row(slot, self._stop_ids[rid])
                    continue
                batch_fill = getattr(matcher, "batch_fill_bitmask", None)
                if batch_fill is None:
                    matcher.fill_bitmask(rows, slot)
                    continue
                group = batches.setdefault(batch_fill, ([], []))
                group[0].append(matcher)
                group[1].append(slot)
            threads = self.fill_threads if len(stale) >= PARALLEL_FILL_ROWS else 1
            for batch_fill, (matchers, batch_slots) in batches.items():
                if len(matchers) == 1:
                    matchers[0].fill_bitmask(rows, batch_slots[0])
                else:
                    batch_fill(matchers, rows, batch_slots, threads)
            dirty.difference_update(stale)
            self.num_rows_filled += len(stale)
        data = memoryview(rows.numpy()).cast("B")
        size = self._row_bytes
        first = slots[request_ids[0]] if request_ids else 0
        # One copy out of the buffer: a slice when the rows are consecutive slots.
        if all(slots[rid] == first + i for i, rid in enumerate(request_ids)):
            return bytes(data[first * size:(first + len(request_ids)) * size])
        return b"".join([data[slots[rid] * size:(slots[rid] + 1) * size]
                         for rid in request_ids])

    def _write_stop_row(self, slot: int, stop_ids: list[int]) -> None:
        row = self._rows[slot].numpy().view(np.uint32)
        row[:] = 0
        for t in stop_ids:
            if t < self.vocab_size:
                row[t // 32] |= np.uint32(1 << (t % 32))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
