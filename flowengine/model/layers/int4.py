"""4-bit GPTQ and AWQ checkpoints (W4A16): packed int4 weights with per-group scales.

Both formats store, per linear layer with K input and N output features and groups of
`group_size` input features (G = K / group_size groups):

    w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n]        q, z in 0..15

- GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`): `qweight` int32 [K / 8, N] packs
  input rows 8r..8r+7 of column n into word [r, n], row 8r+i at bits 4i..4i+3;
  `qzeros` int32 [G, N / 8] packs columns the same way along N; `scales` float16
  [G, N]; `g_idx` int32 [K] the group of each input row. Without act-order
  (`desc_act: false`) g(k) = k // group_size; with it (`desc_act: true`) the rows were
  quantized in order of decreasing Hessian diagonal, so g_idx is a permutation of that
  pattern. `checkpoint_format: gptq` (v1, AutoGPTQ's default) stores z - 1 in qzeros;
  `gptq_v2` stores z. Symmetric (`sym: true`) checkpoints have z = 8 everywhere.
- AWQ GEMM (AutoAWQ, `quant_method: awq`, `version: gemm`): `qweight` int32 [K, N / 8]
  packs 8 output columns per word, `qzeros` int32 [G, N / 8] likewise, `scales` float16
  [G, N]; within a word, nibble i (bits 4i..4i+3) holds column `AWQ_PACK_ORDER[i]` of
  its 8 (the interleave AutoAWQ's GEMM kernel reads). Zeros are stored as they are.

At load both become FlowEngine's one layout (`to_canonical`): `qweight` int32 [K / 8, N]
in GPTQ's packing (what the W4A16 Triton kernel reads, kernels/w4a16.py), `qzeros`
uint8 [G, N] (the zero points unpacked: 1/64 of the weight bytes at group size 128),
`scales` float16 [G, N], and `g_idx` int32 [K] only for act-order layers. No weight
matrix is ever dequantized whole: CUDA dequantizes tiles in the GEMM's registers; the
CPU repacks into the Q4_1 blocks of flowengine/_cpu_ops.c (32 weights, d * q + m,
d = s, m = -s * z rounded to float16, that rounding corrected per group after the
kernel, see `Int4Linear.finalize`) when the groups are 32-aligned, else dequantizes
tiles of output rows (at most 16 MiB of float32) one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.model.layers.quant_linear import QuantizedWeight

PACK = 8  # 4-bit values per int32 word
# AWQ GEMM: nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8 columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# CPU fallback: output rows dequantized per tile, at most this many float32 values
# (16 MiB: 1024 rows of K = 4096); each tile's GEMM then amortises its dequantization.
_CPU_TILE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Int4QuantConfig:
    """A checkpoint's `quantization_config` for GPTQ or AWQ (4 bits).

    Attributes:
        method: "gptq" or "awq".
        group_size: input features per scale; -1: one group per layer (per channel).
        desc_act: GPTQ act-order (g_idx is a permutation of the groups).
        sym: symmetric (z = 8) GPTQ; AWQ is always asymmetric (`zero_point: true`).
        zero_offset: added to stored zeros (1 for GPTQ v1 checkpoints, else 0).
        modules_to_not_convert: name fragments of layers kept in float (AWQ's list).
    """

    method: str
    group_size: int
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 0
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> Int4QuantConfig:
        """Parse `quantization_config` (config.json) of quant_method gptq / awq.

        Raises:
            ValueError: another quant_method, bits other than 4, a group size that is
                not -1 or a multiple of 8, an AWQ version other than gemm, a GPTQ
                checkpoint_format other than gptq / gptq_v2, AWQ without zero points,
                bits / group_size that are not integers, desc_act / sym that are not
                booleans, or modules_to_not_convert that is not a list of strings.
        """
        method = str(qc.get("quant_method", "")).lower()
        if method not in ("gptq", "awq"):
            raise ValueError(
                f"quantization_config quant_method {qc.get('quant_method')!r} is not "
                "supported; FlowEngine loads 4-bit 'gptq' and 'awq' checkpoints (or a float "
                "checkpoint with --quantization fp8 / int8)")
        bits = _int_key(qc, ("bits", "w_bit"), 4)
        if bits != 4:
            raise ValueError(f"{method} checkpoint has bits={bits}; FlowEngine runs 4-bit "
                             f"{method.upper()} only")
        group_size = _int_key(qc, ("group_size", "q_group_size"), 128)
        if group_size != -1 and (group_size <= 0 or group_size % PACK):
            raise ValueError(f"{method} group_size {group_size} must be -1 or a positive "
                             f"multiple of {PACK}")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported; FlowEngine "
                                 "loads AWQ's GEMM packing (version 'gemm')")
            if not qc.get("zero_point", True):
                raise ValueError("AWQ without zero points (zero_point: false) is not "
                                 "supported")
            skip = qc.get("modules_to_not_convert") or []
            if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
                raise ValueError("quantization_config modules_to_not_convert must be a list "
                                 f"of module name fragments (strings), got {skip!r}")
            return cls("awq", group_size, False, False, 0, tuple(skip))
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (only "
                             "'gptq' and 'gptq_v2'); re-export the checkpoint in GPTQ format")
        if qc.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        return cls("gptq", group_size, _bool_key(qc, "desc_act", False),
                   _bool_key(qc, "sym", True), 1 if fmt == "gptq" else 0)

    def layer_group_size(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def _int_key(qc: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    """The integer under the first of `keys` present (GPTQ's name, then AutoAWQ's).
    Raises ValueError naming the key for anything but an integer (a float such as 4.5
    must not be truncated into a valid value)."""
    for key in keys:
        if key in qc:
            value = qc[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"quantization_config {key} must be an integer, got "
                                 f"{value!r}")
            return value
    return default


def _bool_key(qc: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false flag; raises ValueError for anything else (the string "false" is
    truthy, so it would silently mean true)."""
    value = qc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"quantization_config {key} must be true or false, got {value!r}")
    return value


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along rows (GPTQ qweight) -> uint8 [8R, C]; row 8r+i from
    bits 4i of word [r, :]."""
    r, c = packed.shape
    q = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device).view(1, PACK, 1)) & 0xF
    return q.reshape(r * PACK, c).to(torch.uint8)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] packed along columns -> uint8 [R, 8C]; column 8c+j from nibble j of
    word [:, c], or, with `order` (AWQ_PACK_ORDER), from the nibble i whose
    order[i] == j."""
    r, c = packed.shape
    q = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, C, nibble]
    if order is not None:
        inverse = [order.index(j) for j in range(PACK)]
        q = q[..., inverse]
    return q.reshape(r, c * PACK).to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8/int [8R, C] values 0..15 -> int32 [R, C] (inverse of unpack_rows)."""
    k, c = q.shape
    q = q.to(torch.int64).reshape(k // PACK, PACK, c) << _SHIFTS.to(torch.int64).view(
        1, PACK, 1).to(q.device)
    return _to_int32(q.sum(dim=1))


def pack_cols(q: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """uint8/int [R, 8C] values 0..15 -> int32 [R, C] (inverse of unpack_cols)."""
    r, n = q.shape
    q = q.to(torch.int64).reshape(r, n // PACK, PACK)
    if order is not None:
        q = q[..., list(order)]  # nibble i takes column order[i]
    return _to_int32((q << _SHIFTS.to(torch.int64).to(q.device)).sum(dim=-1))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # Words are 0..2^32-1; int32 holds the same bits (two's complement).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_canonical(cfg: Int4QuantConfig, tensors: dict[str, torch.Tensor], in_features: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One checkpoint layer's tensors ({"qweight", "qzeros", "scales"[, "g_idx"]}) ->
    (qweight int32 [K / 8, N] GPTQ packing, qzeros uint8 [G, N], scales float16 [G, N],
    g_idx int32 [K] or None when g_idx is the plain k // group_size).

    Raises:
        ValueError: a tensor is missing, has the wrong dtype (qweight / qzeros not
            2-D int32, scales not floating point, g_idx not integer) or its shape
            disagrees with in_features / the other tensors.
    """
    gs = cfg.layer_group_size(in_features)
    k = in_features
    missing = {"qweight", "qzeros", "scales"} - set(tensors)
    if missing:
        raise ValueError(f"{cfg.method} layer lacks tensor(s) {sorted(missing)}")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    # Packed words copied into int32 buffers from another dtype would be converted by
    # value, not reinterpreted: a float qweight would load as garbage, silently.
    for leaf, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ValueError(f"{cfg.method} {leaf} must be a 2-D int32 tensor of packed "
                             f"4-bit values, got {tensor.dtype} {tuple(tensor.shape)}")
    if not scales.is_floating_point():
        raise ValueError(f"{cfg.method} scales must be floating point, got {scales.dtype}")
    if "g_idx" in tensors and tensors["g_idx"].is_floating_point():
        raise ValueError(f"GPTQ g_idx must be integer group indices, got "
                         f"{tensors['g_idx'].dtype}")
    if cfg.method == "awq":
        if qweight.shape[0] != k:
            raise ValueError(f"AWQ qweight has {qweight.shape[0]} rows, the layer has "
                             f"{k} input features")
        qweight = pack_rows(unpack_cols(qweight, AWQ_PACK_ORDER))
        zeros = unpack_cols(qzeros, AWQ_PACK_ORDER)
    else:
        if qweight.shape[0] * PACK != k:
            raise ValueError(f"GPTQ qweight has {qweight.shape[0]} rows (x 8), the layer "
                             f"has {k} input features")
        zeros = unpack_cols(qzeros) + cfg.zero_offset
    n = qweight.shape[1]
    groups = -(-k // gs)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"{cfg.method} scales {tuple(scales.shape)} / qzeros "
                         f"{tuple(zeros.shape)} do not match [{groups}, {n}] (group size {gs})")
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        plain = torch.arange(k, dtype=torch.int32) // gs
        if g_idx.shape != (k,):
            raise ValueError(f"GPTQ g_idx has shape {tuple(g_idx.shape)}, expected [{k}]")
        if torch.equal(g_idx, plain):
            g_idx = None
        elif int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"GPTQ g_idx values must lie in 0..{groups - 1}")
    return (qweight.contiguous(), zeros.contiguous(), scales.to(torch.float16).contiguous(),
            g_idx)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, group_size: int,
               rows: slice = slice(None)) -> torch.Tensor:
    """Canonical planes -> float32 W [N, K] (output rows `rows` only), exactly
    (q - z) * s. The reference of the kernels and the CPU fallback."""
    q = unpack_rows(qweight[:, rows]).float()  # [K, n]
    k = q.shape[0]
    groups = (torch.arange(k, device=q.device) // group_size if g_idx is None
              else g_idx.long())
    z = qzeros[:, rows].float()[groups]
    s = scales[:, rows].float()[groups]
    return ((q - z) * s).t().contiguous()


def _q4_1_planes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 perm: torch.Tensor | None, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack canonical planes (rows reordered by `perm` so that groups are
    contiguous) into Q4_1 planes (quant_linear.py): qs uint8 [N, K / 2], scales
    float16 [N, K / 16] as (d, m) pairs, d = s, m = -s * z."""
    q = unpack_rows(qweight)  # [K, N]
    if perm is not None:
        q = q[perm]
    k, n = q.shape
    nb = k // 32
    q = q.t().reshape(n, nb, 32)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    group = torch.arange(nb) * 32 // group_size  # each 32-block lies in one group
    s = scales.float().t()[:, group]  # [N, nb]
    z = qzeros.float().t()[:, group]
    pairs = torch.stack([s, -s * z], dim=-1).to(torch.float16)
    return qs, pairs.reshape(n, nb * 2).contiguous()


class Int4Linear(nn.Module):
    """A linear layer with packed 4-bit weights (GPTQ / AWQ), activations in the model
    dtype (W4A16). Replaces a ColumnParallelLinear / RowParallelLinear of one rank.

    Buffers (canonical layout, module docstring): `qweight` int32 [K / 8, N], `qzeros`
    uint8 [G, N], `scales` float16 [G, N], `g_idx` int32 [K] (act-order layers only);
    `bias` [N] model dtype or None.

    Args:
        in_features (K, a multiple of 8), out_features (N), bias: as nn.Linear.
        group_size: input features per group (-1 resolved to K by the caller; a last
            group may be partial, G = ceil(K / group_size)). act_order: whether the
            layer keeps a g_idx.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int,
                 act_order: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if in_features % PACK:
            raise ValueError(f"a 4-bit layer needs in_features divisible by {PACK}, got "
                             f"{in_features}")
        groups = -(-in_features // group_size)
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.register_buffer("qweight", torch.empty(in_features // PACK, out_features,
                                                    dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(groups, out_features, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32)
                             if act_order else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._cpu: QuantizedWeight | None = None
        self._cpu_perm: torch.Tensor | None = None
        self._cpu_dm: torch.Tensor | None = None  # [N, G] float32, see finalize

    def finalize(self) -> None:
        """After the buffers are filled: on the CPU, repack into the Q4_1 blocks of the
        C kernels when every group is 32-aligned and has exactly group_size rows (an
        act-order layer then permutes its input once per call), dropping the canonical
        planes; otherwise keep them for the tile-dequantizing fallback."""
        if self.qweight.device.type != "cpu" or self.group_size % 32 or self.in_features % 32:
            return  # Q4_1 blocks are 32 weights of one group
        from flowengine.model.layers.quant_linear import kernels_available

        if not kernels_available():
            return
        perm = None
        if self.g_idx is not None:
            perm = torch.argsort(self.g_idx, stable=True)
            plain = torch.arange(self.in_features, dtype=torch.int32) // self.group_size
            if not torch.equal(self.g_idx[perm], plain):
                return  # groups of unequal sizes: the fallback reads g_idx directly
        qs, pairs = _q4_1_planes(self.qweight, self.qzeros, self.scales, perm,
                                 self.group_size)
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        self._cpu = QuantizedWeight("q4_1", qs, pairs, dtype)
        self._cpu_perm = perm
        # m = -s * z is exact in float32 (an 11-bit s times a 5-bit z) but not always in
        # float16: the Q4_1 kernel's block sums are off by (m - m16) * sum(x of the
        # block), which one [T, G] x [G, N] product per call puts back (1/16 of the
        # packed bytes at group size 128; none for symmetric GPTQ, where z = 8 and
        # m = -8 s is exact).
        m16 = pairs.view(self.out_features, -1, 2)[:, ::self.group_size // 32, 1].float()
        exact = -(self.scales.float() * self.qzeros.float()).t()  # [N, G]
        delta = exact - m16
        self._cpu_dm = delta.contiguous() if bool(delta.any()) else None
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if getattr(self, name) is not None:
                setattr(self, name, torch.empty(0, dtype=getattr(self, name).dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float -> [T, N] in x's dtype."""
        if self._cpu is not None:
            if self._cpu_perm is not None:
                x = x.index_select(-1, self._cpu_perm)
            out = self._cpu.matmul(x, self.bias)
            if self._cpu_dm is not None:
                groups = self._cpu_dm.shape[1]
                xg = F.pad(x.float(), (0, groups * self.group_size - self.in_features))
                xg = xg.view(*x.shape[:-1], groups, self.group_size).sum(-1)
                out = out + (xg @ self._cpu_dm.t()).to(out.dtype)
            return out
        if x.is_cuda:
            from flowengine.kernels.gemv import GEMV_MAX_M, GEMV_W4_GROUP, use_gemv, w4a16_gemv
            from flowengine.kernels.w4a16 import w4a16_gemm

            x2 = x.reshape(-1, self.in_features)
            x2 = x2 if x2.is_contiguous() else x2.contiguous()
            m = x2.shape[0]
            fmt = "w4a16" if self.g_idx is None else "w4a16_act"
            # Few rows: the decode GEMV where the GPU's swept table measured it faster
            # (benchmarks/gemv_gpu.py sweeps group size 128 only).
            gemm = (w4a16_gemv if m <= GEMV_MAX_M and self.group_size == GEMV_W4_GROUP
                    and use_gemv(fmt, m, self.out_features, self.in_features, x.device)
                    else w4a16_gemm)
            out = gemm(x2, self.qweight, self.scales, self.qzeros, self.g_idx,
                       self.group_size, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return self._tiled_linear(x)

    def _tiled_linear(self, x: torch.Tensor) -> torch.Tensor:
        # Dequantize a tile of output rows at a time (at most _CPU_TILE_ELEMENTS floats).
        x2 = x.reshape(-1, self.in_features).float()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        tile = max(8, _CPU_TILE_ELEMENTS // self.in_features // 8 * 8)
        for n0 in range(0, self.out_features, tile):
            rows = slice(n0, min(n0 + tile, self.out_features))
            w = dequantize(self.qweight, self.qzeros, self.scales, self.g_idx,
                           self.group_size, rows)
            out[:, rows] = F.linear(x2, w)
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def packed_bytes(self) -> int:
        """Bytes of weights a forward reads (packed planes, or the Q4_1 blocks and the
        rounding correction)."""
        if self._cpu is not None:
            dm = self._cpu_dm
            return self._cpu.nbytes + (0 if dm is None else dm.numel() * 4)
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.qzeros, self.scales, self.g_idx)
                   if t is not None)
