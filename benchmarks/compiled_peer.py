"""The compiled plain-PyTorch peer of issue 14 (e): a gpt-fast-style Llama decoder.

    python benchmarks/compiled_peer.py --out OUT [--batch 1 256] [--context 1024]

What gpt-fast (pytorch-labs/gpt-fast) does to make plain PyTorch fast, our code: the
whole model as a few plain tensor ops, a static KV cache `[layers, batch, kv_heads,
max_len, head_dim]` written with `index_copy_` at the step's position, attention over the
cache as two batched matmuls (the query heads of a KV head grouped, so each K/V byte
is read once; a boolean mask hides the unwritten tail), the decoder layer compiled by `torch.compile`
(Inductor fuses RMSNorm, RoPE, SiLU-and-mul and the residual adds into Triton kernels;
cuBLAS does the GEMMs) and the whole 32-layer step plus LM head and argmax replayed
from one CUDA graph, which is what `mode="reduce-overhead"` does (the layer is
compiled once and called per layer with that layer's weights, so compiling takes
seconds rather than the minutes of tracing 32 inlined layers).

Shapes: Llama-3.1-8B (hidden 4096, 32 layers, 32 / 8 heads, head_dim 128, intermediate
14336, vocab 128256), random bf16 weights built on the device, contexts of `context`
random cached tokens. Prints ms per decode step (median over CUDA-graph replays, CUDA
events) beside the same roofline as benchmarks/gpu_bench.py: (weight bytes + K/V bytes
read) / measured device-to-device copy bandwidth. Note that gpt-fast's attention reads
the cache up to max_len (here context + 64), not just each context.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.nn.functional as F

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 32, 8, 128
INTERMEDIATE, VOCAB, EPS, THETA = 14336, 128256, 1e-5, 500000.0


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, 1, D]; cos/sin [B, 1, 1, D] float32 (rotate_half layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def layer(h: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, w_gate_up: torch.Tensor,
          w_down: torch.Tensor, n1: torch.Tensor, n2: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          mask: torch.Tensor) -> torch.Tensor:
    """One decoder layer for one new token per sequence. h [B, HIDDEN]; caches
    [B, KV_HEADS, max_len, HEAD_DIM]; pos [1] int64 (all sequences at one position, as
    in gpt-fast's batched decode); mask [B, 1, 1, max_len] bool."""
    b = h.shape[0]
    qkv = rms_norm(h, n1) @ w_qkv.t()
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    q = rope(q.view(b, HEADS, 1, HEAD_DIM), cos, sin)
    k = rope(k.view(b, KV_HEADS, 1, HEAD_DIM), cos, sin)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v.view(b, KV_HEADS, 1, HEAD_DIM))
    # Grouped-query attention as two batched matmuls over the cache: each K/V byte is
    # read once (a repeat_interleave of K/V for SDPA would copy them QPK times).
    qpk = HEADS // KV_HEADS
    qg = q.view(b, KV_HEADS, qpk, HEAD_DIM)
    scores = (qg @ k_cache.transpose(-1, -2)).float() * HEAD_DIM ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v_cache.dtype)
    attn = probs @ v_cache  # [B, KV_HEADS, qpk, HEAD_DIM]
    h = h + attn.reshape(b, HEADS * HEAD_DIM) @ w_o.t()
    gate, up = (rms_norm(h, n2) @ w_gate_up.t()).chunk(2, dim=-1)
    return h + (F.silu(gate) * up) @ w_down.t()


class Peer:
    """Weights, static cache and one captured decode step at one batch size."""

    def __init__(self, batch: int, context: int, device: str, compile_layer: bool) -> None:
        dt = torch.bfloat16
        self.batch, self.context = batch, context
        self.max_len = context + 64

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, dtype=dt, device=device) * shape[-1] ** -0.5

        self.layers = [dict(w_qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
                            w_o=w(HIDDEN, HEADS * HEAD_DIM), w_gate_up=w(2 * INTERMEDIATE, HIDDEN),
                            w_down=w(HIDDEN, INTERMEDIATE),
                            n1=torch.ones(HIDDEN, dtype=dt, device=device),
                            n2=torch.ones(HIDDEN, dtype=dt, device=device))
                       for _ in range(LAYERS)]
        self.embed = w(VOCAB, HIDDEN)
        self.lm_head = w(VOCAB, HIDDEN)
        self.norm = torch.ones(HIDDEN, dtype=dt, device=device)
        shape = (batch, KV_HEADS, self.max_len, HEAD_DIM)
        self.k_caches = [torch.randn(shape, dtype=dt, device=device) for _ in range(LAYERS)]
        self.v_caches = [torch.randn(shape, dtype=dt, device=device) for _ in range(LAYERS)]
        inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
        self.inv_freq = inv_freq
        self.tokens = torch.randint(0, VOCAB, (batch,), device=device)
        self.pos = torch.tensor([context], device=device)
        self.layer_fn = torch.compile(layer, dynamic=False) if compile_layer else layer

    def step(self) -> torch.Tensor:
        """Decode one token per sequence at self.pos; advances nothing (replayable)."""
        freqs = self.pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().view(1, 1, 1, HEAD_DIM), emb.sin().view(1, 1, 1, HEAD_DIM)
        mask = (torch.arange(self.max_len, device=self.pos.device) <= self.pos).view(1, 1, 1, -1)
        h = self.embed[self.tokens]
        for lw, kc, vc in zip(self.layers, self.k_caches, self.v_caches, strict=True):
            h = self.layer_fn(h, lw["w_qkv"], lw["w_o"], lw["w_gate_up"], lw["w_down"],
                              lw["n1"], lw["n2"], kc, vc, self.pos, cos, sin, mask)
        return (rms_norm(h, self.norm) @ self.lm_head.t()).argmax(-1)

    def roofline_ms(self, bw_gbs: float) -> float:
        weights = sum(t.numel() for lw in self.layers for t in lw.values()) * 2
        weights += self.lm_head.numel() * 2 + self.batch * HIDDEN * 2
        kv = 2 * LAYERS * self.batch * (self.context + 1) * KV_HEADS * HEAD_DIM * 2
        return (weights + kv) / (bw_gbs * 1e9) * 1e3

    def time_ms(self, iters: int = 30) -> float:
        for _ in range(3):
            self.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            self.step()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[iters // 2]


def check_against_eager(peer: Peer) -> float:
    """Max |compiled - eager| of one layer's output over its std (same inputs)."""
    lw = peer.layers[0]
    h = torch.randn(peer.batch, HIDDEN, dtype=torch.bfloat16, device=peer.pos.device)
    freqs = peer.pos.float()[:, None] * peer.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().view(1, 1, 1, HEAD_DIM), emb.sin().view(1, 1, 1, HEAD_DIM)
    mask = (torch.arange(peer.max_len, device=h.device) <= peer.pos).view(1, 1, 1, -1)
    args = (lw["w_qkv"], lw["w_o"], lw["w_gate_up"], lw["w_down"], lw["n1"], lw["n2"])
    kc, vc = peer.k_caches[0].clone(), peer.v_caches[0].clone()
    want = layer(h, *args, kc, vc, peer.pos, cos, sin, mask).float()
    got = peer.layer_fn(h, *args, peer.k_caches[0], peer.v_caches[0], peer.pos, cos, sin,
                        mask).float()
    return float((got - want).abs().max() / want.std())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    p.add_argument("--context", type=int, default=1024)
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_attention_bench import copy_bandwidth_gbs

    bw = copy_bandwidth_gbs()
    rows = []
    for batch in ns.batch:
        peer = Peer(batch, ns.context, "cuda", compile_layer=True)
        err = check_against_eager(peer)
        ms = peer.time_ms()
        roof = peer.roofline_ms(bw)
        rows.append({"batch": batch, "context": ns.context, "ms": ms, "roofline_ms": roof,
                     "max_err_over_std": err})
        print(f"peer batch {batch} x {ns.context}: {ms:.3f} ms/step, roofline {roof:.3f} ms "
              f"({ms / roof:.2f}x); compiled vs eager layer max err {err:.3f} std", flush=True)
        del peer
        torch.cuda.empty_cache()
    meta = {"command": " ".join([sys.executable, *sys.argv]), "gpu": torch.cuda.get_device_name(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "copy_bandwidth_gbs": bw}
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "compiled_peer.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("| batch x context | compiled peer ms/step | roofline ms | ratio |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} x {r['context']} | {r['ms']:.3f} | {r['roofline_ms']:.3f} | "
              f"{r['ms'] / r['roofline_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
