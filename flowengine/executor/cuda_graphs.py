"""CUDA graphs for decode-only steps (DESIGN.md §6).

A decode step of a large model launches hundreds of small kernels; replaying them as
one captured CUDA graph removes the per-launch host cost that otherwise dominates at
small batch sizes (gpt-fast's and vLLM's recipe). A graph has fixed shapes and fixed
buffer addresses, so one graph is captured per batch size in CAPTURE_SIZES (vLLM's
default list), reading the runner's persistent input buffers; a step with b requests
is padded up to the nearest captured size with empty requests (seq_len 0, no tokens)
and padding tokens of slot -1, which every kernel skips. Prefill or mixed steps and
batches above the largest size run eagerly.

Speculative decoding adds verification graphs (`tokens_per_req` = k + 1): a step whose
requests each compute at most k + 1 tokens (the last known token and its drafts) is
padded to b requests and b * (k + 1) tokens for the nearest captured b, so drafts are
verified by a replay instead of an eager forward.

The split-KV decode kernel's split count is a launch parameter, so it is fixed per
captured size (from the size and max_model_len) while capturing.

Mixed steps (prefill chunks with decodes; vLLM v1's FULL cudagraph mode for a unified
attention backend): `MixedCudaGraphs` captures one graph per *token* count in
`mixed_capture_sizes` (the decode sizes up to 512, then coarser steps up to
max_num_batched_tokens), each over min(tokens, max_num_seqs) request rows, with the
attention backend set to `unified_only`: every layer's attention is the unified paged
kernel, whose grid (`num_tokens // BLOCK_Q + num_reqs` programs, a program finds its
request in `query_start_loc` on the device) and tile (the prefill tile, fixed because
max_query_len > 1) depend only on the padded shapes, never on how the tokens are split
among the requests. So any step of at most T tokens (and so at most T requests) with
some request computing more than one token replays the graph of the nearest T >= its
token count: padding requests are empty (zero new tokens, seq_len 0; their programs
exit at once), padding tokens have slot -1 and zero output rows. Steps above the
largest size run eagerly.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from flowengine.executor.input_batch import InputBatch

logger = logging.getLogger(__name__)

# vLLM's default cudagraph capture sizes: 1, 2, 4, then every multiple of 8 up to 512.
CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 513, 8))


def capture_sizes_for(max_num_seqs: int, max_num_tokens: int,
                      sizes: Sequence[int] = CAPTURE_SIZES) -> list[int]:
    """The sizes worth capturing: ascending, up to the first that covers max_num_seqs
    (a decode step has at most max_num_seqs requests), none above max_num_tokens (the
    input buffers' capacity)."""
    chosen: list[int] = []
    for size in sorted(sizes):
        if size > max_num_tokens:
            break
        chosen.append(size)
        if size >= max_num_seqs:
            break
    return chosen


def mixed_capture_sizes(max_num_seqs: int, max_num_tokens: int,
                        sizes: Sequence[int] = CAPTURE_SIZES) -> list[int]:
    """Token counts of the mixed-step graphs: `sizes` from 2 up to 512 (vLLM's list),
    then every 64 up to 1024 and every 128 beyond, none above max_num_tokens; the
    largest is max_num_tokens itself when it lies between two steps, so every step the
    scheduler can form (<= max_num_batched_tokens) replays a graph.
    (max_num_seqs bounds the request rows of each graph, not the list.)"""
    del max_num_seqs
    chosen = [s for s in sorted(sizes) if 2 <= s <= min(512, max_num_tokens)]
    size = 512
    while size < max_num_tokens:
        size += 64 if size < 1024 else 128
        chosen.append(min(size, max_num_tokens))
    if max_num_tokens >= 2 and (not chosen or chosen[-1] < max_num_tokens):
        chosen.append(max_num_tokens)
    return sorted(set(chosen))


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` >= num_reqs, or None when num_reqs exceeds
    them all (the step then runs eagerly)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class DecodeCudaGraphs:
    """One captured model forward per decode batch size.

    Args:
        model: the LlamaForCausalLM; captured from input ids to final-norm hidden states.
        kv_caches: the per-layer KV cache tensors (captured by address).
        input_batch: the runner's non-growable InputBatch; graphs read its device buffers.
        attn_backend: the model's TritonAttentionBackend; its num_kv_splits is fixed per
            size while capturing, then restored.
        max_seq_len: longest context a step can have (max_model_len); picks split counts.
        sizes: ascending batch sizes to capture.
        tokens_per_req: 1 for decode graphs; k + 1 for the verification graphs of
            speculative decoding: a graph of size b then holds b * (k + 1) token rows
            over b request rows, and replays any step of at most b requests with at most
            k + 1 tokens each (the attention kernel, split-KV decode for k + 1 <= 8 and the
            unified one beyond, reads each request's query length from
            query_start_loc; its tile shape is fixed by max_query_len).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], input_batch: InputBatch,
                 attn_backend: object, max_seq_len: int, sizes: Sequence[int],
                 tokens_per_req: int = 1) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be ascending and distinct, got {list(sizes)}")
        if input_batch.growable:
            raise ValueError("CUDA graphs need a non-growable InputBatch (fixed addresses)")
        self.model = model
        self.kv_caches = kv_caches
        self.input_batch = input_batch
        self.attn_backend = attn_backend
        self.max_seq_len = max_seq_len
        self.sizes = list(sizes)
        self.tokens_per_req = tokens_per_req
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # EAGLE-3: the auxiliary layer inputs, captured as outputs too when the model
        # is set to return them (LlamaModel.aux_hidden_state_layers).
        self._aux: dict[int, list[torch.Tensor]] = {}

    def _prepare_capture(self, size: int) -> None:
        """Set what the attention backend fixes per graph (the decode kernel's splits)."""
        from flowengine.kernels.decode_attention import choose_num_kv_splits

        self.attn_backend.num_kv_splits = choose_num_kv_splits(
            size, self.kv_caches[0].shape[3], self.max_seq_len, self.kv_caches[0].device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs then reuse the shared
        memory pool). Raises RuntimeError naming the size whose capture failed."""
        device = self.kv_caches[0].device
        pool = torch.cuda.graph_pool_handle()
        saved_splits = self.attn_backend.num_kv_splits
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        try:
            for size in reversed(self.sizes):
                self._prepare_capture(size)
                try:
                    self._capture_one(size, pool)
                except Exception as exc:
                    raise RuntimeError(
                        f"CUDA graph capture failed for {self._kind} batch size {size}: "
                        f"{exc}; run with enforce_eager=True to serve without graphs"
                    ) from exc
        finally:
            self.attn_backend.num_kv_splits = saved_splits
            self._end_capture()
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d %s CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(self.sizes), self._kind, self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start, used / 2**20)

    def _end_capture(self) -> None:
        pass

    def _capture_inputs(self, size: int) -> tuple[object, object]:
        """(StepInputs, AttentionMetadata) of the all-padding step captured for `size`."""
        q = self.tokens_per_req
        inputs = self.input_batch.prepare([], [], pad_to=size * q, pad_reqs_to=size)
        meta = dataclasses.replace(inputs.attn_metadata, max_query_len=q,
                                   max_seq_len=self.max_seq_len)
        return inputs, meta

    @property
    def _kind(self) -> str:
        return "decode" if self.tokens_per_req == 1 else "verification"

    def _capture_one(self, size: int, pool: tuple[int, int]) -> None:
        # An all-padding batch: kernels launch with the graph's shapes and exit early.
        # (Verification graphs: the attention output is zeroed whole on each replay,
        # since the padding count the backend reads on the host is 0 at capture.)
        inputs, meta = self._capture_inputs(size)
        args = (inputs.input_ids, inputs.positions, self.kv_caches, meta)
        wants_aux = bool(getattr(self.model.model, "aux_hidden_state_layers", ()))
        kwargs = {"aux_hidden_states": []} if wants_aux else {}
        self.model(*args, **kwargs)  # compiles the Triton kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        aux: list[torch.Tensor] = []
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(*args, **({"aux_hidden_states": aux} if wants_aux else {}))
        self._graphs[size] = graph
        self._outputs[size] = hidden
        if wants_aux:
            self._aux[size] = aux

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on what the input buffers hold now; returns its static
        [size * tokens_per_req, hidden_size] output (overwritten by the next replay of this size).
        Raises KeyError for a size not captured."""
        self._graphs[size].replay()
        return self._outputs[size]

    def aux_outputs(self, size: int) -> list[torch.Tensor] | None:
        """The auxiliary hidden states of the latest replay of `size` (static buffers),
        or None when the graphs were captured without them."""
        return self._aux.get(size)


class MixedCudaGraphs(DecodeCudaGraphs):
    """One captured model forward per token count for mixed prefill + decode steps
    (module docstring). `sizes` are token counts; the graph of T tokens has
    min(T, max_num_reqs) request rows. Replay with the token count (`replay(T)`), after
    `InputBatch.prepare(..., pad_to=T, pad_reqs_to=reqs_for(T))`.

    Args: as DecodeCudaGraphs (tokens_per_req is not used), plus
        max_num_reqs: the most requests a step can have (max_num_seqs).
    """

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], input_batch: InputBatch,
                 attn_backend: object, max_seq_len: int, sizes: Sequence[int],
                 max_num_reqs: int) -> None:
        super().__init__(model, kv_caches, input_batch, attn_backend, max_seq_len, sizes)
        self.max_num_reqs = max_num_reqs
        self._saved_unified = False

    def reqs_for(self, size: int) -> int:
        """Request rows of the graph of `size` tokens."""
        return min(size, self.max_num_reqs)

    @property
    def _kind(self) -> str:
        return "mixed"

    def _prepare_capture(self, size: int) -> None:
        # The unified kernel for every layer, with the prefill tile (max_query_len > 1):
        # its launch depends on the padded shapes only.
        if not self._saved_unified:
            self._saved_unified = True
            self._unified_before = self.attn_backend.unified_only
        self.attn_backend.unified_only = True

    def _end_capture(self) -> None:
        if self._saved_unified:
            self.attn_backend.unified_only = self._unified_before
            self._saved_unified = False

    def _capture_inputs(self, size: int) -> tuple[object, object]:
        inputs = self.input_batch.prepare([], [], pad_to=size, pad_reqs_to=self.reqs_for(size))
        meta = dataclasses.replace(inputs.attn_metadata, max_query_len=max(2, size),
                                   max_seq_len=self.max_seq_len)
        return inputs, meta
