"""The CPU attention backend: decode straight over the paged KV cache (issue #20).

Decode tokens (one new token per request) are attended by the C kernel
`paged_decode_attention` (flowengine/_cpu_ops.c): for each (request, KV head) the
query heads of that KV head pass over the request's blocks as the block table lists
them, in groups that share each K and V row's load (up to 4 heads at head_dim 64, 2 at
128), with an online softmax in float32; no copy of the context is
gathered first, which the torch reference does every step. Float32, bfloat16 and
float16 caches (half-width values widened to float32 exactly). Steps whose requests all have a few new tokens (at most
VERIFY_MAX_QUERY_LEN: the verification steps of speculative decoding, k + 1 tokens per
request) take the same C pass with one virtual request per new token: token t of a
request with q_len new tokens sits at position seq_len - q_len + t, so it is a decode
token over the request's block-table row with context length seq_len - (q_len - 1 - t)
(causal within the step, sliding window relative to its own position). Longer prefill
chunks take the C kernel `paged_prefill_attention` on CPUs with AVX2 and without
AVX-512: per (request, KV head, block of query tokens) a flash-attention pass over the
cache's keys and values (the chunk's own, written first, and any cached prefix), with
register tiles for the scores and the weighted values; 2.2x faster than PyTorch's CPU
flash-attention kernel for one 128-token prompt of the default model and for 16 of them
(docs/benchmarks.md, session 49). Elsewhere (AVX-512 CPUs, not measured against it;
soft caps; bf16 queries; a bf16 cache where the CPU multiplies bf16 natively) prefill
keeps the reference's SDPA path. Without the C extension, or for a head_dim / group
size the kernels do not take, attention falls back to the reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flowengine.model.attention.backend import register_attn_backend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.attention.torch_backend import TorchAttentionBackend, write_kv_cache
from flowengine.model.layers import cpu_kernels
from flowengine.model.layers.cpu_kernels import KV_FORMATS

# The kernel's limits (MAX_D, MAX_G in _cpu_ops.c).
_MAX_HEAD_DIM = 256
_MAX_GROUP = 32
# Query dtypes (the kernel's q_bf16); the cache's are cpu_kernels.KV_FORMATS.
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Steps with at most this many new tokens per request run the C decode pass, one
# virtual request per token (module docstring); longer chunks go to SDPA.
VERIFY_MAX_QUERY_LEN = 8


def _native_bf16() -> bool:
    from flowengine.model.layers.quant_linear import _native_bf16 as native

    return native()


def _kernel():
    try:
        from flowengine import _cpu_ops
    except ImportError:
        return None
    return _cpu_ops


def _check_layout(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                  **index: tuple[torch.Tensor, torch.dtype]) -> None:
    """Raise ValueError unless q, kv_cache and out are contiguous and each index tensor
    (name=(tensor, dtype)) is a contiguous tensor of its dtype."""
    for name, (tensor, dtype) in index.items():
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor")
    if not (q.is_contiguous() and kv_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError("q, kv_cache and out must be contiguous")


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, tok_idx: torch.Tensor, req_idx: torch.Tensor,
                           scale: float, out: torch.Tensor, *, soft_cap: float | None = None,
                           sliding_window: int | None = None) -> None:
    """Attention of one new token per request over its paged context, into `out`.

    Args:
        q: [T, Hq, D] float32 or bfloat16, contiguous; row tok_idx[i] is request i's token.
        kv_cache: [2, num_blocks, block_size, Hkv, D] float32, bfloat16 or float16,
            contiguous.
        block_tables: [R_all, max_blocks] int32, contiguous; request i's row req_idx[i].
        seq_lens: [R] int32, request i's context length (its new token included).
        tok_idx, req_idx: [R] int64.
        out: like q; rows tok_idx[i] are written ([Hq, D] each), the others untouched.
        soft_cap: scores -> cap * tanh(scores / cap) (Gemma 2). sliding_window: only
            the last `sliding_window` positions are attended.

    Raises:
        ValueError: a dtype, layout or size the kernel does not take (the caller falls
            back to the torch reference).
    """
    ops = _kernel()
    if ops is None:
        raise ValueError("the C extension flowengine._cpu_ops is not built")
    t, hq, d = q.shape
    _, num_blocks, block_size, hkv, d_kv = kv_cache.shape
    if (q.dtype not in _DTYPES or kv_cache.dtype not in KV_FORMATS or out.dtype != q.dtype
            or d != d_kv or d > _MAX_HEAD_DIM or hq % hkv or hq // hkv > _MAX_GROUP):
        raise ValueError(f"paged_decode_attention does not take q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    _check_layout(q, kv_cache, out, block_tables=(block_tables, torch.int32),
                  seq_lens=(seq_lens, torch.int32), tok_idx=(tok_idx, torch.int64),
                  req_idx=(req_idx, torch.int64))
    ops.paged_decode_attention(
        q.data_ptr(), _DTYPES[q.dtype], tok_idx.data_ptr(), req_idx.data_ptr(),
        tok_idx.shape[0], hq, hkv, d, kv_cache.data_ptr(), KV_FORMATS[kv_cache.dtype],
        num_blocks, block_size, block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        out.data_ptr(), torch.get_num_threads())


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor,
                            seq_lens: torch.Tensor, reqs: torch.Tensor, scale: float,
                            out: torch.Tensor, *, sliding_window: int | None = None) -> None:
    """Causal attention of the listed requests' new tokens over their paged contexts,
    into `out` (the C kernel `paged_prefill_attention`, AVX2; the tokens' own K/V must
    be in the cache already).

    Args:
        q: [T, Hq, D] float32, contiguous; request r's new tokens are rows
            query_start[r] .. query_start[r + 1] - 1, at positions seq_lens[r] - n ..
            seq_lens[r] - 1 (n = their count).
        kv_cache: [2, num_blocks, block_size, Hkv, D] float32, bfloat16 or float16,
            contiguous.
        block_tables: [R, max_blocks] int32, contiguous; row r is request r's.
        query_start: [R + 1] int64. seq_lens: [R] int32 (context with the new tokens).
        reqs: [N] int64, the requests to attend (the others' rows are not written).
        out: [T, Hq, D] float32, contiguous.
        sliding_window: a token at position p attends to p - sliding_window < j <= p.

    Raises:
        ValueError: a dtype, layout or size the kernel does not take, a CPU without
            AVX2 + FMA, or a request with no new tokens or fewer context positions
            than new tokens (nothing is written).
        IndexError: a context longer than its block-table row.
    """
    ops = _kernel()
    if ops is None:
        raise ValueError("the C extension flowengine._cpu_ops is not built")
    t, hq, d = q.shape
    _, num_blocks, block_size, hkv, d_kv = kv_cache.shape
    if (q.dtype != torch.float32 or out.dtype != torch.float32 or out.shape != q.shape
            or kv_cache.dtype not in KV_FORMATS or d != d_kv):
        raise ValueError(f"paged_prefill_attention does not take q {tuple(q.shape)} "
                         f"{q.dtype}, cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    _check_layout(q, kv_cache, out, block_tables=(block_tables, torch.int32),
                  query_start=(query_start, torch.int64), seq_lens=(seq_lens, torch.int32),
                  reqs=(reqs, torch.int64))
    num_reqs = seq_lens.shape[0]
    if (query_start.shape[0] != num_reqs + 1 or block_tables.shape[0] < num_reqs
            or (reqs.numel() and (int(reqs.min()) < 0 or int(reqs.max()) >= num_reqs))
            or int(query_start[-1]) > t):
        raise ValueError("paged_prefill_attention: query_start, seq_lens, block_tables "
                         "and reqs disagree on the requests")
    ops.paged_prefill_attention(
        q.data_ptr(), out.data_ptr(), kv_cache.data_ptr(), KV_FORMATS[kv_cache.dtype], hq, hkv,
        d, num_blocks, block_size, block_tables.data_ptr(), block_tables.shape[1],
        query_start.data_ptr(), seq_lens.data_ptr(), reqs.data_ptr(), reqs.shape[0], scale,
        sliding_window or 0, torch.get_num_threads())


@functools.lru_cache(maxsize=1)
def _prefill_kernel_on() -> bool:
    """Whether prompt chunks take the C prefill kernel: the extension is built, the CPU
    has AVX2 + FMA and no AVX-512 (where PyTorch's SDPA has 16-lane bodies and ours
    has not been measured against it)."""
    ops = _kernel()
    return ops is not None and ops.has_avx2() and not ops.has_avx512()


class _PrefillPlan(NamedTuple):
    """What the prefill kernel and the decode kernel take for a step with prompt chunks,
    built once per step (all layers share `meta`)."""

    starts: torch.Tensor        # [R + 1] int64, query_start_loc
    seq_lens: torch.Tensor      # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32, contiguous
    chunks: torch.Tensor        # int64: the requests with more than one new token
    decode: list[int]           # the requests with one
    starts_list: list[int]
    seq_lens_list: list[int]
    num_tokens: int             # starts[-1]: the rows past it are padding


def _prefill_plan(meta: AttentionMetadata) -> _PrefillPlan | None:
    """The step's _PrefillPlan, cached on `meta`; None when no request has more than one
    new token."""
    cached = getattr(meta, "_cpu_prefill_plan", False)
    if cached is not False:
        return cached
    starts = meta.query_start_loc_cpu.to(torch.int64).contiguous()
    q_lens = starts[1:] - starts[:-1]
    chunks = torch.nonzero(q_lens > 1).flatten()
    plan = None
    if chunks.numel():
        block_tables = meta.block_tables
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            block_tables = block_tables.to(torch.int32).contiguous()
        plan = _PrefillPlan(starts, meta.seq_lens_cpu.to(torch.int32).contiguous(),
                            block_tables, chunks, torch.nonzero(q_lens == 1).flatten().tolist(),
                            starts.tolist(), meta.seq_lens_cpu.tolist(), int(starts[-1]))
    try:
        meta._cpu_prefill_plan = plan
    except AttributeError:  # a metadata type with slots: build it each layer
        pass
    return plan


def _decode_plan(meta: AttentionMetadata, q: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(tok_idx, req_idx, seq_lens int32, block_tables int32) of a CPU step where every
    request has 1..VERIFY_MAX_QUERY_LEN new tokens and there are no padding rows (one
    entry per token: a virtual decode request, module docstring), built on the first
    layer's call and cached on `meta`; None for any other step."""
    cached = getattr(meta, "_cpu_decode_plan", False)
    if cached is not False:
        return cached
    plan = None
    num_reqs = meta.seq_lens_cpu.shape[0]
    if (_kernel() is not None and q.device.type == "cpu" and num_reqs > 0
            and 1 <= meta.max_query_len <= VERIFY_MAX_QUERY_LEN):
        starts = meta.query_start_loc_cpu
        num_tokens = int(starts[-1])
        if num_tokens == q.shape[0]:  # no padding rows
            block_tables = meta.block_tables
            if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
                block_tables = block_tables.to(torch.int32).contiguous()
            seq_lens = meta.seq_lens_cpu.to(torch.int32)
            # One token each, in request order (max_query_len too: a padded step can
            # have as many rows as tokens with a request of two and an empty one).
            if num_tokens == num_reqs and meta.max_query_len == 1:
                idx = torch.arange(num_reqs, dtype=torch.int64)
                plan = (idx, idx, seq_lens.contiguous(), block_tables)
            else:
                q_lens = (starts[1:] - starts[:-1]).to(torch.int64)
                req_idx = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
                tok_idx = torch.arange(num_tokens, dtype=torch.int64)
                # Token t of request r: context up to its own position, i.e. seq_len
                # minus the request's tokens after it.
                after = starts[1:].to(torch.int64)[req_idx] - 1 - tok_idx
                lens = (seq_lens.to(torch.int64)[req_idx] - after).to(torch.int32)
                plan = (tok_idx, req_idx, lens.contiguous(), block_tables)
    try:
        meta._cpu_decode_plan = plan
    except AttributeError:  # a metadata type with slots: no cache, build each layer
        pass
    return plan


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch reference, with decode over the paged cache in C (module docstring)."""

    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """As TorchAttentionBackend.forward. A step whose every request has one new
        token, or at most VERIFY_MAX_QUERY_LEN (verification), with no padding rows
        takes a short path: the kernel's index tensors are built
        once per step (kept on `meta`, which all layers share) and the KV write is one
        C call, so a layer costs two C calls instead of ~15 torch operators."""
        plan = _decode_plan(meta, q)
        if (plan is None or plan[0].shape[0] != q.shape[0]  # a caller with other rows
                or not (q.is_contiguous() and q.dtype in _DTYPES)
                or kv_cache.dtype not in KV_FORMATS or q.shape[2] > _MAX_HEAD_DIM
                or q.shape[1] // kv_cache.shape[3] > _MAX_GROUP
                or not cpu_kernels.write_kv_cache(k, v, kv_cache, meta.slot_mapping)):
            out = self._prefill_step(q, k, v, kv_cache, meta, scale, sliding_window,
                                     logits_soft_cap)
            if out is not None:
                return out
            return super().forward(q, k, v, kv_cache, meta, scale,
                                   sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)
        tok_idx, req_idx, lens, block_tables = plan
        out = torch.empty_like(q)
        paged_decode_attention(q, kv_cache, block_tables, lens, tok_idx, req_idx, scale, out,
                               soft_cap=logits_soft_cap, sliding_window=sliding_window)
        return out

    def _prefill_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      sliding_window: int | None, soft_cap: float | None
                      ) -> torch.Tensor | None:
        """A step with prompt chunks (more than one new token for some request): the
        K/V write, then every such request by the C prefill kernel
        (`paged_prefill_attention`, which reads the chunk's keys and values and any
        cached prefix from the cache) and the one-token requests by the decode kernel;
        padding rows are zeros. None (nothing written) where the kernel does not apply:
        no prompt chunk, a soft cap, bfloat16 queries, a head_dim that is not a multiple
        of 8, a CPU without AVX2 or with AVX-512 (measured only without it), or a bf16
        cache on a CPU that multiplies bf16 natively (_prefill_dtype's bf16 SDPA)."""
        if (meta.max_query_len <= 1 or soft_cap is not None or not _prefill_kernel_on()
                or q.dtype != torch.float32 or not q.is_contiguous()
                or kv_cache.dtype not in KV_FORMATS or q.shape[2] % 8
                or q.shape[2] > _MAX_HEAD_DIM or q.shape[1] % kv_cache.shape[3]
                or q.shape[1] // kv_cache.shape[3] > _MAX_GROUP
                or self._prefill_dtype(kv_cache) != torch.float32):
            return None
        plan = _prefill_plan(meta)
        if plan is None or plan.num_tokens > q.shape[0]:
            return None
        self._write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if plan.num_tokens < q.shape[0]:
            out[plan.num_tokens:] = 0
        paged_prefill_attention(q, kv_cache, plan.block_tables, plan.starts, plan.seq_lens,
                                plan.chunks, scale, out, sliding_window=sliding_window)
        if plan.decode:
            self._decode(q, kv_cache, meta, plan.decode, plan.starts_list, plan.seq_lens_list,
                         scale, out, sliding_window, None)
        return out

    @staticmethod
    def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
        """One C call (cpu_kernels.write_kv_cache) where it takes the inputs; torch's
        index_copy_ otherwise (~150 us a layer for 384 prefill tokens, measured)."""
        if not cpu_kernels.write_kv_cache(k, v, kv_cache, slot_mapping):
            write_kv_cache(k, v, kv_cache, slot_mapping)

    @staticmethod
    def _prefill_dtype(kv_cache: torch.Tensor) -> torch.dtype:
        """bfloat16 over a bf16 cache on a CPU that multiplies bf16 natively (AMX-BF16
        or AVX512-BF16), else float32. PyTorch's CPU flash attention then takes bf16
        products (float32 accumulation and softmax): the keys and values are the
        cache's bf16 values, which decode reads anyway; the query and the softmax
        weights are rounded to bf16, a bf16 model's precision (`--dtype bfloat16`;
        its matmuls round their inputs to bf16 too from bf16_rows' row counts, and
        below them run in float32). Prompts of at most VERIFY_MAX_QUERY_LEN tokens in
        a step of only such requests take the C decode pass in float32 instead, so a
        short prompt's attention precision depends on its step, as the matmuls'
        does on the step's rows. Measured 2.8x faster than
        float32 for 16 requests x 128 tokens of the default model (9 query heads, 3 KV
        heads, head_dim 64; docs/benchmarks.md session 44)."""
        if kv_cache.dtype == torch.bfloat16 and _native_bf16():
            return torch.bfloat16
        return torch.float32

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                reqs: list[int], query_start: list[int], seq_lens: list[int],
                scale: float, out: torch.Tensor, sliding_window: int | None = None,
                soft_cap: float | None = None) -> None:
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = kv_cache.shape[3]
        if (_kernel() is None or q.device.type != "cpu" or q.dtype not in _DTYPES
                or kv_cache.dtype not in KV_FORMATS or head_dim > _MAX_HEAD_DIM
                or num_heads // num_kv_heads > _MAX_GROUP):
            TorchAttentionBackend._decode(q, kv_cache, meta, reqs, query_start, seq_lens,
                                          scale, out, sliding_window, soft_cap)
            return
        tok_idx = torch.tensor([query_start[i] for i in reqs], dtype=torch.int64)
        req_idx = torch.tensor(reqs, dtype=torch.int64)
        lens = torch.tensor([seq_lens[i] for i in reqs], dtype=torch.int32)
        block_tables = meta.block_tables
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            block_tables = block_tables.to(torch.int32).contiguous()
        q_in = q if q.is_contiguous() else q.contiguous()
        if out.is_contiguous() and out.dtype == q_in.dtype:
            paged_decode_attention(q_in, kv_cache, block_tables, lens, tok_idx, req_idx,
                                   scale, out, soft_cap=soft_cap, sliding_window=sliding_window)
            return
        tmp = torch.empty_like(q_in)
        paged_decode_attention(q_in, kv_cache, block_tables, lens, tok_idx, req_idx, scale,
                               tmp, soft_cap=soft_cap, sliding_window=sliding_window)
        out.index_copy_(0, tok_idx, tmp.index_select(0, tok_idx).to(out.dtype))


register_attn_backend("cpu", CpuAttentionBackend, default_for_device="cpu")
