"""Weights kept quantized on the CPU: GGUF's Q4_0, Q4_1 and Q8_0 blocks (issue #20;
Q4_K is rewritten into Q4_1 blocks at load, `q4_k_to_q4_1_blocks`).

A `QuantizedWeight` stands where a layer's float `weight` [N, K] would be. It holds the
weights in one of GGUF's 32-weight block formats (ggml-common.h), split into planes:

    format  qs                      scales                  weight
    q4_0    uint8 [N, K / 2]        float16 [N, K / 32]     d * (q - 8)
    q4_1    uint8 [N, K / 2]        float16 [N, K / 16]     d * q + m   (d, m pairs)
    q8_0    int8  [N, K]            float16 [N, K / 32]     d * q

(a Q4 block's byte j holds weight j in its low nibble and weight j + 16 in its high one,
as in the file). `matmul` multiplies float32 activations by the weights without
materialising them: the C kernels of flowengine/_cpu_ops.c. For 1-3 activation rows
on a CPU with AVX512-VNNI they quantize each 32-value block of the activations to
three int8 levels (x = s (2^16 h + 2^8 m + l), relative error 6e-8 of the block's
largest value for Q4, 2.4e-7 for Q8_0: float32's accuracy) and multiply with integer
dot products (vpdpbusd), 4 weight rows per pass; for up to 13 rows they dequantize
one block at a time into registers, for up to 8 activation rows at once; from 14 rows
(batched decode, prefill) 16 weight rows at a time are dequantized into a small
transposed float32 panel that every tile of 16 activation rows reuses (no horizontal
sums; ~1.7x the dot-product body's rate at 64+ rows on AVX-512). A CPU with AVX2, FMA
and F16C but no AVX-512 (AMD Zen 1-3, most Intel client parts) takes, for 1 row, int16
products of the codes (unpacked straight from the packed bytes) with the activations
rounded as below (0.82 of the float32 body's time), for 2-3 rows an AVX2 float32 body
(one block at a time dequantized into registers, up to 4 activation rows at once)
and from 4 rows the int16 panel body: each 32-value block of the
activations rounded to int16 multiples of max|x_block| / 32767 (error <= 1.5e-5 of
the block's largest value; the default model's greedy ids unchanged, the logprobs of
its generated tokens within 3.1e-3 of float32; prompt logprobs, unlikely tokens
included, up to 1.5e-2 (median 3e-6 over the 16 engine-core prompts; float32
activations: 7.4e-5)), 16 weight rows' codes unpacked to int16 into a panel, and
vpmaddwd (16 products per instruction, twice an FMA's 8) into int32 sums per block,
scaled into float32 (0.65-0.8 of the float32 panel body's time at 6-128 rows;
FLOWENGINE_CPU_INT16_MIN_ROWS=0 keeps float32 activations: the float32 panel body
from 12 rows, 16 weight rows, tiles of 6 activation rows). Above
DEQUANT_MIN_ROWS the matrix is dequantized into a float32 scratch for torch's GEMM.
With `--dtype bfloat16` (`use_bf16_gemms`; or bf16 activations) on a CPU whose oneDNN
multiplies bf16 natively, products may be bf16 (`bf16_rows`): on a CPU with AMX-BF16
the kernel's AMX bodies from AMX_ROWS[format][0] rows (batched decode): up to
`amx_int8_max_rows()` rows, where the CPU has AMX-INT8, integer products of the 4- or
8-bit codes with the activations rounded to 16-bit integers per 32-value block (two
int8 bytes; error <= 1/65024 of the block's largest value), scaled in float32; more
rows, 32 weight rows at a time dequantized to bf16 into a panel, the activations as
bf16 tiles, float32 sums. From AMX_ROWS[format][1] (BF16_GEMM_MIN_ROWS where there is
no AMX) the matrix is dequantized into a bf16 scratch for one oneDNN bf16 GEMM
(prefill).
The dequantized values are exactly gguf.quants.dequantize's, so results differ from
float32 over the dequantized matrix only by the order of the sums (and, on the VNNI
path, by the activations' rounding to 24 bits per block; on the AVX2 int16 body, to 16
bits per block).

`int8` (online, from a float checkpoint) quantizes to the q8_0 layout: symmetric, one
float16 scale per 32 weights of a row (llama.cpp's quantize_row_q8_0 rounding).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# format -> (C kernel id, bytes of one block in a GGUF file, scale halves per block)
FORMATS: dict[str, tuple[int, int, int]] = {
    "q4_0": (0, 18, 1),
    "q4_1": (1, 20, 2),
    "q8_0": (2, 34, 1),
}
BLOCK = 32
# Above this many activation rows a matmul dequantizes the matrix and runs torch's
# GEMM; at or below it the C kernel reads the packed weights (decode batches, offline
# batches, prefill chunks), and a decode step of up to this many rows runs its layers
# in one C call (cpu_fused.py). Measured rule (session 27, 2-core AMD EPYC, 1 thread,
# best of 6, the float32 body cache-blocked in row tiles; benchmarks/cpu_quant_rows.py,
# table in docs/benchmarks.md, issue 20): the kernel against dequantize + F.linear, ms:
#   q4_1 3072x576:   16 rows 0.43/0.77, 64 1.76/2.42, 512 15.1/18.5, 2048 60.8/73.3
#   q4_1 576x1536:   16 rows 0.22/0.39, 64 0.89/1.18, 512 7.20/8.87, 2048 31.7/35.5
#   q8_0 49152x576:  16 rows 9.0/67.2, 64 32.7/112, 512 245/457
# i.e. 1.12-7.5x faster at every row count measured; the ratio falls slowly with the
# rows (the GEMM amortises its dequantization), so above the largest measured count the
# dequantizing path stays. (It was 16: the unblocked float32 body read its activations
# from L2 above 16 rows of 576 features and took 2x the time per row.) Since session 31
# the panel body takes 14+ rows at ~1.7x that body's rate from 64 rows (docs/
# benchmarks.md), so the margin over dequantize + GEMM only grew; not re-measured above
# 2048 rows.
DEQUANT_MIN_ROWS = 2048
# A matmul of at least this many rows, where `--dtype bfloat16` asked for it
# (`use_bf16_gemms`) or the activations are bf16, on a CPU whose oneDNN multiplies bf16
# natively (AMX-BF16 or AVX512-BF16): the matrix is dequantized into a bf16 scratch for
# one bf16 GEMM, float32 accumulation (the precision any bf16 model's matmuls have; the
# float32 kernels keep float32's). Measured (session 39,
# 2-thread Xeon with AMX, SmolLM2-135M's Q4_1 shapes, ms, kernel / bf16 GEMM): qkv
# 960 x 576 at 32 rows 0.21 / 0.54, 64 0.57 / 0.52, 512 3.05 / 0.68, 2048 12.3 / 1.30;
# gate_up 3072 x 576 at 64 rows 1.28 / 0.94, 2048 36.0 / 3.51; down 576 x 1536 at 64
# rows 0.75 / 0.68, 2048 21.2 / 2.06. The dequantization costs N x K whatever the rows,
# and the Q8_0 kernel is faster per row: the tied Q8_0 LM head 49152 x 576 took 19.7 /
# 51.4 ms at 64 rows, 74.4 / 73.6 at 256, 157 / 109 at 512 (benchmarks/cpu_quant_rows.py
# --dtype bfloat16).
# Per format, on a CPU without AMX (a format not listed never takes bf16 products):
BF16_GEMM_MIN_ROWS: dict[str, int] = {"q4_0": 64, "q4_1": 64, "q8_0": 256}
# Per format, on a CPU with AMX-BF16: (rows from which the kernel's AMX body runs, rows
# from which the bf16 GEMM runs instead). Measured (session 40, the same machine and
# command; ms, float32 kernel / dequantize + bf16 GEMM / AMX body):
#   q4_1 3072 x 576:  4 rows 0.12 / 0.52 / 0.10, 16 0.33 / 0.54 / 0.10,
#                     64 0.92 / 0.62 / 0.21, 256 3.51 / 0.88 / 0.54, 512 7.97 / 1.27 /
#                     1.25, 2048 32.9 / 4.14 / 6.52
#   q4_1 576 x 1536:  4 rows 0.06 / 0.26 / 0.06, 16 0.19 / 0.27 / 0.07, 512 4.53 / 0.72 /
#                     0.95
#   q8_0 49152 x 576: 4 rows 1.94 / 57.1 / 2.32, 8 3.41 / 56.7 / 1.98, 16 6.29 / 56.1 /
#                     1.60, 256 67.6 / 74.8 / 17.1, 2048 507 / 177 / 96.0
# (1-2 rows: the VNNI kernel, 2-6x faster than the AMX body, which dequantizes every
# weight whatever the rows). Q8_0's GEMM threshold is past the largest count measured.
# Session 42 added the AMX-INT8 body for 3-8 rows (same machine, ms per call, 2 threads,
# weights in L2; float32 kernel / AMX-BF16 / AMX-INT8):
#   q4_1 3072 x 576:  2 rows 0.070 / 0.110 / 0.057, 3 0.095 / 0.111 / 0.060,
#                     4 0.127 / 0.111 / 0.067, 8 0.192 / 0.111 / 0.106
#   q4_1 576 x 1536:  4 rows 0.056 / 0.071 / 0.045, 8 0.095 / 0.071 / 0.070
#   q8_0 49152 x 576: 2 rows 1.01 / 1.40 / 0.97, 4 1.81 / 1.43 / 1.01, 8 2.87 / 1.52 /
#                     1.59
# and, all matmuls of a decode step with the weights in L3 as in the model, 2 rows took
# longer on it than on the VNNI kernel: so it starts at 3 rows for every format.
AMX_ROWS: dict[str, tuple[int, int]] = {"q4_0": (3, 512), "q4_1": (3, 512),
                                        "q8_0": (3, 4096)}
# Where the AMX-INT8 body does not run (no AMX-INT8, FLOWENGINE_CPU_NO_AMX_INT8=1): the
# AMX-BF16 body starts where it beat the float32 kernel (session 40's table above).
AMX_BF16_MIN_ROWS: dict[str, int] = {"q4_0": 4, "q4_1": 4, "q8_0": 8}
_NATIVE_BF16: bool | None = None
_HAS_AMX: bool | None = None


def _native_bf16() -> bool:
    """Whether bf16 GEMMs run natively here (cpu_threads.bf16_matmul_path), cached."""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        from flowengine.executor.cpu_threads import bf16_matmul_path

        _NATIVE_BF16 = bf16_matmul_path()[0]
    return _NATIVE_BF16


def _has_amx() -> bool:
    """Whether the kernel's AMX-BF16 body runs here (_cpu_ops.has_amx), cached."""
    global _HAS_AMX
    if _HAS_AMX is None:
        _HAS_AMX = bool((_OPS or _ops()).has_amx())
    return _HAS_AMX


def amx_int8_max_rows() -> int:
    """The most activation rows of a matmul that the kernel's AMX-INT8 body takes (from
    AMX_ROWS[format][0]; more rows take the AMX-BF16 body), 0 where it does not run
    (no AMX-INT8, FLOWENGINE_CPU_NO_AMX_INT8=1, or no C extension)."""
    if not kernels_available() or not _has_amx():
        return 0
    ops = _OPS or _ops()
    return int(ops.AMX_INT8_MAX_ROWS) if ops.has_amx_int8() else 0


def bf16_rows(fmt: str) -> tuple[int, int] | None:
    """For a matmul of format `fmt` allowed bf16 products: (rows from which the
    kernel's AMX body runs, 0 = never; rows from which one bf16 GEMM over the
    dequantized matrix runs), or None where this CPU does not multiply bf16 natively
    (or the format has no threshold)."""
    if fmt not in BF16_GEMM_MIN_ROWS or not _native_bf16():
        return None
    if _has_amx():
        return amx_rows(fmt)
    return 0, BF16_GEMM_MIN_ROWS[fmt]


def amx_rows(fmt: str) -> tuple[int, int]:
    """On a CPU with AMX: (rows from which the kernel's AMX bodies run, rows from which
    one bf16 GEMM runs instead): AMX_ROWS[fmt] where the AMX-INT8 body runs, else the
    AMX-BF16 body from AMX_BF16_MIN_ROWS[fmt]."""
    if amx_int8_max_rows():
        return AMX_ROWS[fmt]
    return AMX_BF16_MIN_ROWS[fmt], AMX_ROWS[fmt][1]


logger = logging.getLogger(__name__)
_PATH_LOGGED = False


def _ops():
    global _OPS
    from flowengine import _cpu_ops

    _OPS = _cpu_ops
    return _cpu_ops


_OPS = None  # the module once imported (a decode step makes ~120 matmul calls)


def kernel_paths() -> str:
    """Which C bodies the quantized matmuls run on this CPU, in words (chosen at run
    time from cpuid; FLOWENGINE_CPU_NO_VNNI=1 / FLOWENGINE_CPU_NO_AVX512=1 /
    FLOWENGINE_CPU_NO_AVX2=1 / FLOWENGINE_CPU_PANEL_MIN_ROWS=0 /
    FLOWENGINE_CPU_INT16_MIN_ROWS=0 opt out)."""
    ops = _ops()
    names = {"avx512-vnni": "AVX512-VNNI integer dot products (activations as three int8 "
                            "levels, float32 accuracy)",
             "avx512": "AVX-512 float32 dot products",
             "avx512-panels": "AVX-512 float32, 16-row dequantized panels",
             "avx2": "AVX2 + FMA float32 dot products (no AVX-512 on this CPU)",
             "avx2-panels": "AVX2 + FMA float32, 16-row dequantized panels",
             "avx2-int16-panels": "AVX2 int16 products (activations rounded to 16 bits "
                                  "per 32-value block), 16-row panels of the codes",
             "avx2-int16": "AVX2 int16 products (activations rounded to 16 bits per "
                           "32-value block), the codes unpacked per block",
             "c": "portable C float32"}
    parts, start, path = [], 1, ops.linear_path(1)
    for rows in range(2, DEQUANT_MIN_ROWS + 2):
        nxt = ops.linear_path(rows) if rows <= DEQUANT_MIN_ROWS else None
        if nxt != path:
            span = f"{start}" if start == rows - 1 else f"{start}-{rows - 1}"
            parts.append(f"{span} activation rows: {names.get(path, path)}")
            start, path = rows, nxt
    parts.append("more: dequantize + torch GEMM")
    return "; ".join(parts)


def _log_path_once() -> None:
    global _PATH_LOGGED
    if not _PATH_LOGGED and kernels_available():
        _PATH_LOGGED = True
        # where --dtype bfloat16 takes bf16 or int8 products instead, the bodies it
        # takes are logged with it (cpu_threads.log_quantized_bf16_path)
        logger.info("quantized CPU matmuls with float32 products: %s", kernel_paths())


def kernels_available() -> bool:
    """True when the C extension flowengine._cpu_ops is built (pip install builds it)."""
    try:
        _ops()
    except ImportError:
        return False
    return True


def qs_shape(fmt: str, n: int, k: int) -> tuple[int, int]:
    return (n, k) if fmt == "q8_0" else (n, k // 2)


def scales_shape(fmt: str, n: int, k: int) -> tuple[int, int]:
    return (n, k // BLOCK * FORMATS[fmt][2])


def empty_planes(fmt: str, n: int, k: int, device: torch.device | str = "meta"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (qs, scales) planes for an [n, k] weight in `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {sorted(FORMATS)}")
    if k % BLOCK:
        raise ValueError(f"a {fmt} weight needs in_features divisible by {BLOCK}, got {k}")
    qdtype = torch.int8 if fmt == "q8_0" else torch.uint8
    return (torch.empty(qs_shape(fmt, n, k), dtype=qdtype, device=device),
            torch.empty(scales_shape(fmt, n, k), dtype=torch.float16, device=device))


@dataclass
class PackedTensor:
    """A checkpoint tensor [rows, cols] still in its GGUF block format (planes as in
    the module docstring), as the GGUF reader yields it for a layer kept quantized."""

    fmt: str
    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        cols = self.scales.shape[1] // FORMATS[self.fmt][2] * BLOCK
        return (self.qs.shape[0], cols)

    def narrow(self, dim: int, start: int, length: int) -> PackedTensor:
        """Rows (dim 0), or columns (dim 1, at block boundaries) start..start+length.
        Raises ValueError for a column slice that splits a block."""
        if dim == 0:
            return PackedTensor(self.fmt, self.qs.narrow(0, start, length),
                                self.scales.narrow(0, start, length))
        if start % BLOCK or length % BLOCK:
            raise ValueError(
                f"a {self.fmt} tensor can be split by columns only at multiples of {BLOCK}, "
                f"got columns {start}..{start + length}; use tensor_parallel_size 1")
        per_col = 1 if self.fmt == "q8_0" else 2  # columns per qs byte
        halves = FORMATS[self.fmt][2]
        return PackedTensor(
            self.fmt, self.qs.narrow(1, start // per_col, length // per_col),
            self.scales.narrow(1, start // BLOCK * halves, length // BLOCK * halves))


def pack_gguf_blocks(raw: np.ndarray, fmt: str, cols: int) -> PackedTensor:
    """Split a GGUF tensor's raw blocks ([rows, cols / 32 * block_bytes] uint8, the
    reader's layout) into the planes. Copies (the reader's arrays are read-only views
    of the file's memory map)."""
    _, block_bytes, halves = FORMATS[fmt]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, block_bytes)
    scale_bytes = 2 * halves
    scales = blocks[..., :scale_bytes].copy().view(np.float16).reshape(rows, -1)
    qs = blocks[..., scale_bytes:].copy().reshape(rows, -1)
    if fmt == "q8_0":
        qs = qs.view(np.int8)
    return PackedTensor(fmt, torch.from_numpy(qs), torch.from_numpy(scales))


# GGUF's Q4_K super-block (ggml-common.h block_q4_K): d, dmin (float16), 12 bytes of
# 6-bit sub-block scales and mins, 128 bytes of codes, for 256 weights.
Q4_K_WEIGHTS, Q4_K_BYTES = 256, 144


def q4_k_to_q4_1_blocks(raw: np.ndarray) -> np.ndarray | None:
    """GGUF Q4_K blocks ([rows, cols / 256 * 144] uint8, the reader's layout) rewritten
    as Q4_1 blocks ([rows, cols / 32 * 20] uint8) with the same codes, or None when a
    sub-block's scale or min overflows float16.

    Q4_K (ggml's dequantize_row_q4_K) gives each 32-weight sub-block j of a super-block
    w = d * sc_j * q - dmin * m_j, with 6-bit sc_j, m_j and 4-bit q: Q4_1's
    w = d' * q + m' with d' = d * sc_j and m' = -dmin * m_j. Both products are exact in
    float32; Q4_1 stores them as float16, a rounding of at most 2^-11 of each: a weight
    moves by at most 2^-11 (15 |d'| + |m'|), under 1/68 of one code step d' where
    |m'| <= 15 |d'|. The codes are kept: Q4_K's 64-weight chunks hold sub-block 2c in the
    low nibbles of their 32 bytes and 2c + 1 in the high ones; Q4_1's byte j holds
    weight j (low) and j + 16 (high)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, Q4_K_BYTES)
    nsb = blocks.shape[1]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 4:16].astype(np.uint8)  # the 12 scale bytes
    # get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, 4-7 in
    # bytes 8-11's nibbles plus the top 2 bits of bytes 0-3 / 4-7.
    sc = np.empty((rows, nsb, 8), np.float32)
    mn = np.empty((rows, nsb, 8), np.float32)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    with np.errstate(over="ignore"):
        scale = (d[..., None] * sc).astype(np.float16)
        minimum = (-dmin[..., None] * mn).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        return None
    codes = blocks[..., 16:].reshape(rows, nsb, 4, 32)  # 4 chunks of 32 bytes
    values = np.stack([codes & 0xF, codes >> 4], axis=3).reshape(rows, nsb, 8, 32)
    out = np.empty((rows, nsb, 8, 20), np.uint8)
    out[..., 0:2] = scale[..., None].view(np.uint8)
    out[..., 2:4] = minimum[..., None].view(np.uint8)
    out[..., 4:] = values[..., :16] | (values[..., 16:] << 4)
    return out.reshape(rows, nsb * 8 * 20)


def quantize_q8_0(weight: torch.Tensor) -> PackedTensor:
    """Symmetric int8 per 32 weights of a row: d = amax / 127 (stored float16),
    q = round(w / d) (llama.cpp's quantize_row_q8_0). weight [N, K] float, K % 32 == 0."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 quantization needs in_features divisible by {BLOCK}, got {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return PackedTensor("q8_0", q.reshape(n, k).contiguous(), d.to(torch.float16).contiguous())


class QuantizedWeight:
    """An [N, K] weight matrix in a block format, with float32 activations.

    Args:
        fmt: "q4_0", "q4_1" or "q8_0". qs, scales: contiguous CPU planes (module
            docstring), filled in place by the loader. dtype: the model's dtype, which
            `embedding` returns and `dtype` reports (outputs of `matmul` take x's dtype,
            or its `out_dtype`).
    """

    def __init__(self, fmt: str, qs: torch.Tensor, scales: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
        if qs.device.type != "cpu":
            raise ValueError(f"quantized {fmt} weights run on the CPU only, not {qs.device}")
        self.fmt = fmt
        self.qs, self.scales = qs, scales
        self.dtype = dtype
        self.device = qs.device
        n, k = qs.shape[0], scales.shape[1] // FORMATS[fmt][2] * BLOCK
        self.shape = torch.Size((n, k))
        self._kernel = FORMATS[fmt][0]
        # float32 activations may take bf16 products (`use_bf16_gemms`: --dtype
        # bfloat16 with quantized weights): `bf16_rows(fmt)`; None: never.
        self.bf16_rows: tuple[int, int] | None = None
        _log_path_once()

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.scales.numel() * 2

    def _bf16_limits(self, dtype: torch.dtype) -> tuple[int, int] | None:
        """(AMX body rows, bf16 GEMM rows) for activations of `dtype`, None: no bf16
        products (bf16 activations: `bf16_rows(fmt)`; float32: what `use_bf16_gemms`
        set)."""
        if dtype == torch.bfloat16:
            return bf16_rows(self.fmt)
        return self.bf16_rows if dtype == torch.float32 else None

    def takes_bf16_gemm(self, rows: int, dtype: torch.dtype = torch.float32) -> bool:
        """Whether `matmul` of `rows` activation rows of `dtype` runs as one bf16 GEMM
        over the dequantized matrix (its product then exactly a bf16 tensor's values,
        before any bias)."""
        limits = self._bf16_limits(dtype)
        return limits is not None and rows >= limits[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] (any float dtype) -> x @ W^T (+ bias) [..., N] in out_dtype (None:
        x's dtype).

        float32 accumulation over exactly dequantized weights (on a CPU with AVX2 and
        no AVX-512, for 1 and for 4 or more rows, times x rounded to int16 per 32-value
        block: see the module docstring), except for bf16 x on a
        CPU with native bf16 GEMMs and float32 x where `use_bf16_gemms` set
        `bf16_rows`: there, from `bf16_rows(fmt)`'s counts of rows, with float32
        accumulation, the AMX-INT8 body (up to `amx_int8_max_rows()` rows: the exact
        weights times x rounded to 16-bit integers per 32-value block), the AMX-BF16
        body or one bf16 GEMM (products of x and the weights rounded to bf16, a bf16
        model's precision); the result in out_dtype. A bf16 GEMM's result asked for in
        bf16 is the GEMM's own output (no float32 copy), its bias (rounded to bf16)
        added by the GEMM: with a bias that can differ from asking for float32 and
        rounding."""
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"input has {x.shape[-1]} features, the weight expects {k}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        out_dtype = out_dtype or x.dtype
        rows = self._bf16_limits(x2.dtype)
        if rows is not None and m >= rows[1]:
            w16 = self.dequantize(torch.bfloat16)
            if out_dtype == torch.bfloat16:  # the bias (rounded to bf16) added by the GEMM
                out = F.linear(x2.to(torch.bfloat16), w16,
                               None if bias is None else bias.to(torch.bfloat16))
            else:  # float32 (or another dtype) out; the bias added in float32
                out = F.linear(x2.to(torch.bfloat16), w16).float()
                if bias is not None:
                    out += bias
                out = out.to(out_dtype)
            return out if len(lead) == 1 else out.view(*lead, n)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        amx = rows[0] if rows is not None else 0
        if m > DEQUANT_MIN_ROWS and not 0 < amx <= m:
            out = F.linear(x2, self.dequantize())
        else:
            out = torch.empty(m, n, dtype=torch.float32)
            if m:
                ops = _OPS or _ops()
                ops.linear(self._kernel, x2.data_ptr(), m, k, self.qs.data_ptr(),
                           self.scales.data_ptr(), n, out.data_ptr(), torch.get_num_threads(),
                           amx)
        if bias is not None:
            out += bias
        if out_dtype != torch.float32:
            out = out.to(out_dtype)
        return out if len(lead) == 1 else out.view(*lead, n)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix [N, K] in float32 (exactly gguf.quants.dequantize's values),
        or those values rounded to `dtype`."""
        n, k = self.shape
        bf16 = dtype == torch.bfloat16  # rounded in the same pass (no float32 matrix)
        out = torch.empty(n, k, dtype=torch.bfloat16 if bf16 else torch.float32)
        _ops().dequantize(self._kernel, self.qs.data_ptr(), self.scales.data_ptr(), n, k,
                          out.data_ptr(), torch.get_num_threads(), bf16)
        return out if dtype in (torch.float32, torch.bfloat16) else out.to(dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] int64 dequantized -> [T, K] in the model dtype."""
        n, k = self.shape
        qs, d = self.qs.index_select(0, ids), self.scales.index_select(0, ids).float()
        nb = k // BLOCK
        if self.fmt == "q8_0":
            w = qs.float().view(-1, nb, BLOCK) * d[..., None]
        else:
            q = qs.view(-1, nb, BLOCK // 2)
            q = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # weights j, then j + 16
            if self.fmt == "q4_1":
                d = d.view(-1, nb, 2)
                w = torch.addcmul(d[..., 1:], q, d[..., :1])
            else:
                w = (q - 8.0) * d[..., None]
        return w.reshape(-1, k).to(self.dtype)


def use_bf16_gemms(model: torch.nn.Module) -> None:
    """Let every quantized matmul of `model` with float32 activations take bf16
    products from `bf16_rows(format)`'s row counts (`QuantizedWeight.matmul`, and the
    fused decode layers of cpu_fused.py); the builder calls it for `--dtype bfloat16`
    with quantized weights on a CPU with native bf16 GEMMs."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            weight.bf16_rows = bf16_rows(weight.fmt)


def swiglu_bf16_gemms(x: torch.Tensor, gate_up: torch.nn.Module, down: torch.nn.Module
                      ) -> torch.Tensor | None:
    """down(silu(gate) * up) [T, H] float32 for float32 x [T, H] where the layers'
    weights are quantized and both matmuls run as one bf16 GEMM at T rows
    (`--dtype bfloat16` prefills on the CPU; unbiased layers, no tensor parallelism),
    or None where that does not hold (the caller runs its layers).

    The [T, 2 I] gate_up product stays the GEMM's bf16 output and the SiLU-and-mul
    rounds once to bf16 (cpu_kernels.silu_and_mul_bf16), which is what the down GEMM
    would have rounded its float32 input to: the same bits as the float32 route, less
    two float32 round trips of the widest activations (~12% of a 16 x 128-token
    prefill of the default model, docs/benchmarks.md session 44)."""
    from flowengine.model.layers import cpu_kernels

    gw, dw = getattr(gate_up, "weight", None), getattr(down, "weight", None)
    tp = getattr(down, "tp", None)
    if not (isinstance(gw, QuantizedWeight) and isinstance(dw, QuantizedWeight)
            and getattr(gate_up, "bias", None) is None and getattr(down, "bias", None) is None
            and (tp is None or tp.world_size == 1) and cpu_kernels.ENABLED
            and x.dtype == torch.float32 and x.dim() == 2 and not torch.is_grad_enabled()):
        return None
    m = x.shape[0]
    if not (gw.takes_bf16_gemm(m) and dw.takes_bf16_gemm(m)
            and dw.takes_bf16_gemm(m, torch.bfloat16)):
        return None
    act = cpu_kernels.silu_and_mul_bf16(gw.matmul(x, out_dtype=torch.bfloat16))
    if act is None:
        raise RuntimeError("silu_and_mul_bf16 refused the bf16 GEMM's output")
    return dw.matmul(act, out_dtype=torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a float or a quantized weight. On CUDA, a bf16/fp16 product of at
    most 8 rows takes the decode GEMV (kernels/gemv.py) where the GPU's swept table
    measured it faster than cuBLAS (`use_gemv`)."""
    if isinstance(weight, QuantizedWeight):
        return weight.matmul(x, bias)
    if (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and not torch.is_grad_enabled()):
        out = cuda_gemv(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def cuda_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight [N, K]^T (* weight_scale) (+ bias) by the decode GEMV, or None
    where the GEMV does not apply (more than 8 rows, a non-contiguous weight) or the
    swept table does not pick it for this shape."""
    from flowengine.kernels.gemv import GEMV_MAX_M, dense_gemv, use_gemv

    k = x.shape[-1]
    m = x.numel() // k if k else 0
    n = weight.shape[0]
    fmt = "fp8" if weight_scale is not None else "dense"
    if not (0 < m <= GEMV_MAX_M and weight.is_contiguous()
            and use_gemv(fmt, m, n, k, x.device)):
        return None
    x2 = x.reshape(m, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return dense_gemv(x2, weight, bias, weight_scale).view(*x.shape[:-1], n)


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """F.embedding for a float or a quantized weight."""
    if isinstance(weight, QuantizedWeight):
        return weight.embedding(ids)
    return F.embedding(ids, weight)
