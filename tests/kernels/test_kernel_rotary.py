from __future__ import annotations

import pytest
import torch
from kernel_refs import assert_close, ref_rotary
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from flowengine.kernels.reshape_and_cache import reshape_and_cache
from flowengine.kernels.rope_cache import build_rope_cache, compute_inv_freq
from flowengine.kernels.rotary import rotary_embedding, rotary_embedding_and_cache

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_config(head_dim: int, theta: float, scaling: dict | None) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=131072, rope_theta=theta, rope_scaling=scaling,
    )


def test_inv_freq_matches_transformers_bit_for_bit() -> None:
    hf_llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(128, 500000.0, LLAMA3_SCALING), "cpu")
    assert torch.equal(compute_inv_freq(128, 500000.0, LLAMA3_SCALING), hf_llama3)
    legacy = {**LLAMA3_SCALING, "type": "llama3"}
    del legacy["rope_type"]
    assert torch.equal(compute_inv_freq(128, 500000.0, legacy), hf_llama3)
    default = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    assert torch.equal(compute_inv_freq(64, 100000.0, None), default)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING])
def test_cache_matches_transformers_rotary_embedding(scaling: dict | None) -> None:
    config = _hf_config(64, 500000.0, scaling)
    positions = torch.tensor([[0, 1, 7, 1000, 8191, 40000]])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = build_rope_cache(64, 40001, 500000.0, scaling)
    assert cos.shape == (40001, 32) and cos.dtype == torch.float32
    assert torch.equal(cos[positions[0]], hf_cos[0, :, :32])
    assert torch.equal(sin[positions[0]], hf_sin[0, :, 32:])


def test_cache_rejects_unknown_rope_type() -> None:
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="lacks"):
        compute_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-5, "atol": 1e-5}),
     (torch.bfloat16, {"rtol": 8e-3, "atol": 8e-3})],  # one bf16 rounding
)
def test_rotary_in_place_on_qkv_views(
    dtype: torch.dtype, tol: dict[str, float], device: torch.device
) -> None:
    num_tokens, num_q_heads, num_kv_heads, head_dim = 11, 6, 2, 64
    cos, sin = build_rope_cache(head_dim, 2048, 10000.0, LLAMA3_SCALING, device=device)
    qkv = torch.randn(
        num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device
    )
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 2048, (num_tokens,), device=device)
    expected_q, expected_k = ref_rotary(q, positions, cos, sin), ref_rotary(k, positions, cos, sin)

    rotary_embedding(positions, q, k, cos, sin)

    assert_close(q, expected_q, **tol)
    assert_close(k, expected_k, **tol)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)


def test_rotary_reads_strided_cos_sin_views(device: torch.device) -> None:
    """cos/sin as views of a [max_pos, 2, head_dim] table (the model layer's layout)."""
    head_dim = 32
    cos, sin = build_rope_cache(head_dim, 100, 10000.0, device=device)
    table = torch.stack([torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)], dim=1)
    q = torch.randn(4, 3, head_dim, device=device)
    k = torch.randn(4, 1, head_dim, device=device)
    positions = torch.tensor([0, 99, 5, 42], dtype=torch.int32, device=device)
    expected_q, expected_k = ref_rotary(q, positions, cos, sin), ref_rotary(k, positions, cos, sin)
    rotary_embedding(positions, q, k, table[:, 0, : head_dim // 2], table[:, 1, : head_dim // 2])
    assert_close(q, expected_q, rtol=1e-5, atol=1e-5)
    assert_close(k, expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_rotary_and_cache_equals_rotary_then_write(
    cache_dtype: torch.dtype | None, device: torch.device
) -> None:
    """The fused kernel leaves q and the cache bit for bit as rotary_embedding followed
    by reshape_and_cache do (fp32 activations; an E4M3 cache written from values E4M3
    holds exactly only through the interpreter's rounding, see test_kernel_fp8_kv_cache,
    so there values are pre-rounded to E4M3 and rotated by position 0: cos 1, sin 0),
    leaves k as it was and skips slot -1."""
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 6, 2, 64, 16, 5
    cos, sin = build_rope_cache(head_dim, 2048, 500000.0, LLAMA3_SCALING, device=device)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=device)
    if cache_dtype is not None:
        qkv = qkv.to(cache_dtype).float()
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    positions = (torch.zeros(num_tokens, dtype=torch.int64, device=device)
                 if cache_dtype is not None
                 else torch.randint(0, 2048, (num_tokens,), device=device))
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[3] = -1
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), device=device).to(cache_dtype or torch.float32)
    want_cache = cache.clone()
    want_q, want_k = q.clone(), k.clone()
    k_before = k.clone()

    rotary_embedding(positions, want_q, want_k, cos, sin)
    reshape_and_cache(want_k, v, want_cache, slots)
    rotary_embedding_and_cache(positions, q, k, v, cache, slots, cos, sin)

    assert torch.equal(q, want_q)
    assert torch.equal(k, k_before), "the key is read, not rotated in place"
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    written = slots >= 0
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim).float()
    rotated_k = ref_rotary(k_before, positions, cos, sin)
    assert_close(flat[0, slots[written]], rotated_k[written], rtol=1e-5, atol=1e-5)
    assert torch.equal(flat[1, slots[written]], v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[written]] = False
    assert flat[:, untouched].isnan().all()


def test_rotary_and_cache_rejects_mismatched_cache(device: torch.device) -> None:
    cos, sin = build_rope_cache(32, 16, 10000.0, device=device)
    q = torch.randn(2, 4, 32, device=device)
    k = torch.randn(2, 2, 32, device=device)
    cache = torch.zeros(2, 3, 16, 1, 32, device=device)  # one KV head, not two
    slots = torch.tensor([0, 1], device=device)
    positions = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="kv_cache shape"):
        rotary_embedding_and_cache(positions, q, k, k.clone(), cache, slots, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_with_qk_norm_equals_norm_then_rotary(
    dtype: torch.dtype, device: torch.device
) -> None:
    """Qwen3's per-head q/k RMSNorm fused in front of the rotation: q and the cached k
    against the float32 torch reference (RMSNorm rounded to the activation dtype as
    transformers' RMSNorm rounds, then the rotation); float32 to 1e-5, bf16 to the
    per-element bound below (an ulp flip of the rounded norm, through the rotation)."""
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 5, 4, 2, 64, 16, 3
    eps = 1e-6
    cos, sin = build_rope_cache(head_dim, 4096, 1000000.0, device=device)
    qkv = (torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim,
                       device=device) * 3).to(dtype)
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    q_w = (1 + 0.5 * torch.randn(head_dim, device=device)).to(dtype)
    k_w = (1 + 0.5 * torch.randn(head_dim, device=device)).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, device=device,
                        dtype=dtype)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        return (w.float() * normed.float()).to(dtype).float()

    q_in, k_in = q.clone(), k.clone()
    want_q = ref_rotary(norm(q, q_w), positions, cos, sin)
    want_k = ref_rotary(norm(k, k_w), positions, cos, sin)
    rotary_embedding_and_cache(positions, q, k, v, cache, slots, cos, sin,
                               qk_norm=(q_w, k_w, eps))
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim).float()
    if dtype == torch.float32:
        assert_close(q.float(), want_q, rtol=1e-5, atol=1e-5)
        assert_close(flat[0, slots], want_k, rtol=1e-5, atol=1e-5)
    else:
        # bf16: the normed value is rounded to bf16 twice (after the norm, after the
        # weight), as transformers rounds, then rotated and rounded once more. Against
        # torch's round-to-nearest each kernel rounding may differ by one ulp (2**-7
        # relative; Triton's interpreter, which CI runs, truncates float32 -> bf16), and
        # the float32 rsqrt may differ by one more on the first: up to 3 ulps of each
        # rotated term (|x1| cos, |x2| sin) and 1 ulp of the output.
        for got, x, want in ((q.float(), norm(q_in, q_w), want_q),
                             (flat[0, slots], norm(k_in, k_w), want_k)):
            half = head_dim // 2
            c = cos[positions].abs().double()[:, None, :]
            s_ = sin[positions].abs().double()[:, None, :]
            a1, a2 = x[..., :half].abs().double(), x[..., half:].abs().double()
            magnitude = torch.cat([a1 * c + a2 * s_, a2 * c + a1 * s_], -1)
            bound = 3 * 2**-7 * magnitude + 2**-7 * want.abs() + 1e-6
            excess = (got.double() - want.double()).abs() - bound
            assert not torch.isnan(got).any()
            assert (excess <= 0).all(), f"beyond the bf16 bound by {excess.max().item()}"
    assert torch.equal(flat[1, slots], v.float())
    with pytest.raises(ValueError, match="norm weights"):
        rotary_embedding_and_cache(positions, q, k, v, cache, slots, cos, sin,
                                   qk_norm=(q_w[:8], k_w, eps))
