"""The draft heads of speculative decoding that read the target's hidden states:
EAGLE-1/2, EAGLE-3 and Medusa, with loaders for their public checkpoint layouts.

- **EAGLE** (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty"; SafeAILab's `cnets.py`, vLLM's `llama_eagle.py`): at position p the
  head reads the target's final-norm hidden state h_p and the embedding of token p + 1,
  `x = fc([embed(t_{p+1}); h_p])` (fc: [hidden, 2 * hidden], bias optional), then one
  (or more) Llama decoder layers whose first has no input norm; its output `x +
  residual` is both the next feature and, through the *target's* LM head, the logits
  of token p + 2. The embedding is the target's. Checkpoint names: `fc.weight`
  (`fc.bias`), `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
  `layers.{i}.post_attention_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`
  (`layers.{i>0}.input_layernorm.weight`); `embed_tokens.weight` and `lm_head.weight`,
  if present, are ignored (shared with the target, as vLLM does).
- **EAGLE-3** (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
  Language Models via Training-Time Test"; vLLM's `llama_eagle3.py`): the feature of
  position p is `fc(concat(a_low, a_mid, a_high))`, the pre-norm residual stream
  entering three target layers (config `eagle_config.eagle_aux_hidden_state_layer_ids`,
  else vLLM's default (2, L // 2, L - 3)); the midlayer's attention reads
  `[input_layernorm(embed); hidden_norm(feature)]` (q/k/v_proj: [.., 2 * hidden]) with
  the feature as residual; a final `norm` gives the logits over its own draft
  vocabulary (`lm_head`: [draft_vocab_size, hidden]), mapped to target ids by
  `d2t` (target = draft + d2t[draft]); the pre-norm output is the next feature.
  Names: `fc.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.*`, `midlayer.mlp.*`, `norm.weight`, `lm_head.weight`, `d2t`
  (`t2d` ignored); `embed_tokens.weight` when present, else the target's.
- **Medusa** (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
  with Multiple Decoding Heads"): head i maps the target's final-norm hidden state at
  position p through ResBlocks `x + silu(linear(x))` and its own LM head to token
  p + 2 + i. Both public layouts: vLLM's (`blocks.{i}.layers.{j}.linear.{weight,bias}`,
  `lm_heads.{i}.weight`; config `num_heads`, `num_hidden_layers`) and FasterDecoding's
  `medusa_lm_head.safetensors` (`{i}.{j}.linear.*`, `{i}.{num_layers}.weight`; config
  `medusa_num_heads`, `medusa_num_layers`).

Checkpoints are read from *.safetensors, or from a pytorch_model.bin with
`torch.load(weights_only=True)` (tensors only, no code). A checkpoint that lacks a
tensor of its layout, has one of the wrong shape or has tensors the layout does not
know raises ValueError naming them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable

import torch
from torch import nn

from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.layers.linear import ColumnParallelLinear
from flowengine.model.layers.rms_norm import RMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig
from flowengine.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

METHODS_WITH_HEADS = ("eagle", "eagle3", "medusa")


def read_head_config(path: str) -> dict:
    """config.json of a head checkpoint directory. Raises ValueError when missing."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"speculative_config.model {path} has no config.json")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def read_head_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `path` (*.safetensors, else pytorch_model.bin
    read with weights_only=True), by name. Raises ValueError when there is none."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(file))
        return tensors
    bins = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not bins:
        raise ValueError(f"speculative_config.model {path} has no *.safetensors or *.bin "
                         "weights")
    for file in bins:
        state = torch.load(file, map_location="cpu", weights_only=True)
        tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors


def head_model_config(raw: dict, path: str, target: ModelConfig) -> ModelConfig:
    """The geometry of an EAGLE head's decoder layer from its config.json (a Llama
    config), with the target's max_model_len (its RoPE table covers every position)."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map")}
    hf = LlamaConfig.from_dict({**fields, "architectures": ["LlamaForCausalLM"]})
    config = ModelConfig.from_hf_config(hf, path)
    return dataclasses.replace(config, max_model_len=target.max_model_len,
                               tie_word_embeddings=False)


class _Eagle1Layer(LlamaDecoderLayer):
    """A Llama decoder layer; the first layer of an EAGLE-1 head has no input norm
    (SafeAILab cnets.py: the fc output enters attention directly)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, first: bool) -> None:
        super().__init__(config, attn_backend)
        if first:
            self.input_layernorm = nn.Identity()


class EagleHead(nn.Module):
    """EAGLE-1/2 head (see the module docstring).

    Args: config: the head's decoder geometry; attn_backend: the target's backend;
    fc_bias: whether the checkpoint has `fc.bias`.
    """

    method = "eagle"

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, fc_bias: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = ColumnParallelLinear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(_Eagle1Layer(config, attn_backend, i == 0)
                                    for i in range(config.num_layers))
        self.rotary_emb = RotaryEmbedding.from_config(config)

    def combine(self, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> torch.Tensor:
        """The target's step output -> features [T, hidden]: its final-norm states."""
        return hidden

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, h] (of tokens p + 1), features [T, h] (of positions p), positions
        [T] int64 -> (hidden for the LM head, next feature), [T, h] each."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta, self.rotary_emb)
        out = x + residual
        return out, out


class _Eagle3MidLayer(nn.Module):
    """EAGLE-3's one decoder layer: attention over [norm(embed); norm(feature)] (2h wide)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 norm_before_residual: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend)
        attn = self.self_attn
        attn.qkv_proj = ColumnParallelLinear(2 * h, attn.q_size + 2 * attn.kv_size,
                                             bias=config.qkv_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, rotary: RotaryEmbedding
                ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = self.self_attn(positions, x, kv_cache, meta, rotary)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """EAGLE-3 head (see the module docstring).

    Args: config: the head's geometry; attn_backend: the target's; target_hidden_size:
    width of each auxiliary state (fc reads three); draft_vocab_size: rows of lm_head;
    own_embedding: the checkpoint has `embed_tokens.weight`.
    """

    method = "eagle3"

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *,
                 target_hidden_size: int, draft_vocab_size: int, own_embedding: bool,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = ColumnParallelLinear(3 * target_hidden_size, h, bias=False)
        self.midlayer = _Eagle3MidLayer(config, attn_backend, norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(h, draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding.from_config(config)

    def combine(self, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> torch.Tensor:
        """The target's auxiliary states (3 x [T, target_h]) -> features [T, h]."""
        assert aux is not None and len(aux) == 3
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As EagleHead.forward: (final-norm hidden for lm_head, pre-norm next feature)."""
        x, residual = self.midlayer(positions, embeds, features, kv_caches[0], meta,
                                    self.rotary_emb)
        return self.norm.add_and_norm(x, residual)

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [R] int64 in the target's vocabulary."""
        ids = nn.functional.linear(hidden, self.lm_head.weight).argmax(dim=-1)
        return ids + self.d2t[ids]


class MedusaHeads(nn.Module):
    """Medusa: `num_heads` heads of `num_layers` ResBlocks each plus an LM head (None:
    the target's, config `original_lm_head`)."""

    method = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 own_lm_heads: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ResBlocks(hidden_size, num_layers) for _ in range(num_heads))
        self.lm_heads = (nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                       for _ in range(num_heads)) if own_lm_heads else None)
        self.num_heads = num_heads

    def draft_token_ids(self, hidden: torch.Tensor, k: int,
                        target_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden [R, h] (target final-norm states of the last verified positions) ->
        [R, k] int64 greedy drafts of heads 0..k-1."""
        cols = []
        for i in range(k):
            x = self.blocks[i](hidden)
            logits = target_logits(x) if self.lm_heads is None else self.lm_heads[i](x)
            cols.append(logits.argmax(dim=-1))
        return torch.stack(cols, dim=1)


class _ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class _ResBlocks(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ResBlock(hidden_size) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------- loading
def _checkpoint_parts(param_name: str) -> list[str]:
    """The checkpoint tensors (in row order) that make one parameter: fused q/k/v and
    gate/up are stored separately."""
    for fused, parts in ((".qkv_proj.", ("q_proj", "k_proj", "v_proj")),
                         (".gate_up_proj.", ("gate_proj", "up_proj"))):
        if fused in param_name:
            base, leaf = param_name.split(fused)
            return [f"{base}.{p}.{leaf}" for p in parts]
    return [param_name]


def load_head_state(module: nn.Module, tensors: dict[str, torch.Tensor], path: str,
                    layout: str, rename: Callable[[str], str] = lambda n: n,
                    ignored: tuple[str, ...] = ()) -> None:
    """Fill every parameter and persistent buffer of `module` from `tensors` (names
    through `rename`, the checkpoint's name of a module name). Raises ValueError naming
    the missing tensors, those of the wrong shape, and those the layout has no place
    for (except `ignored`)."""
    used: set[str] = set()
    state = dict(module.named_parameters())
    state.update((n, b) for n, b in module.named_buffers() if not n.startswith("rotary_emb."))
    sources = {name: [rename(p) for p in _checkpoint_parts(name)] for name in state}
    missing = [p for parts in sources.values() for p in parts if p not in tensors]
    if missing:
        raise ValueError(f"{layout} checkpoint {path} lacks tensor(s) {sorted(missing)[:8]}; "
                         "does speculative_config.method name this checkpoint's kind?")
    for name, target in state.items():
        parts = sources[name]
        value = torch.cat([tensors[p] for p in parts], dim=0)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{layout} checkpoint {path}: tensor {' + '.join(parts)} has shape "
                f"{tuple(value.shape)}, the head built from its config.json needs "
                f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
        used.update(parts)
    unknown = sorted(n for n in tensors if n not in used and n not in ignored)
    if unknown:
        raise ValueError(f"{layout} checkpoint {path} has tensor(s) the {layout} layout has "
                         f"no place for: {unknown[:8]}; is speculative_config.method right?")


def _place(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Parameters to dtype and device; buffers (RoPE tables, d2t) keep their dtype."""
    for p in module.parameters():
        p.data = p.data.to(device=device, dtype=dtype)
    for name, buf in list(module.named_buffers()):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        owner._buffers[name.rpartition(".")[2]] = buf.to(device)
    return module.eval().requires_grad_(False)


def load_eagle_head(method: str, path: str, target: ModelConfig,
                    attn_backend: AttentionBackend, device: torch.device, dtype: torch.dtype
                    ) -> tuple[nn.Module, ModelConfig, tuple[int, ...]]:
    """Build and load the EAGLE / EAGLE-3 head in `path`.

    Returns (head, its decoder geometry, the target layers whose inputs EAGLE-3 reads;
    () for EAGLE). Raises ValueError for a head that does not fit the target (hidden
    size, vocabulary) or a checkpoint not in the method's layout.
    """
    raw = read_head_config(path)
    config = head_model_config(raw, path, target)
    tensors = read_head_tensors(path)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{method} head {path} has vocab_size {config.vocab_size}, the "
                         f"target {target.vocab_size}; a head is trained for one target")
    if method == "eagle":
        if config.hidden_size != target.hidden_size:
            raise ValueError(f"EAGLE head {path} has hidden_size {config.hidden_size}, the "
                             f"target {target.hidden_size}")
        head: nn.Module = EagleHead(config, attn_backend, fc_bias="fc.bias" in tensors)
        load_head_state(head, tensors, path, "EAGLE",
                        ignored=("embed_tokens.weight", "lm_head.weight"))
        return _place(head, device, dtype), config, ()
    target_h = int(raw.get("target_hidden_size") or config.hidden_size)
    if target_h != target.hidden_size:
        raise ValueError(f"EAGLE-3 head {path} reads hidden states of width {target_h}, the "
                         f"target's are {target.hidden_size}")
    draft_vocab = int(raw.get("draft_vocab_size") or config.vocab_size)
    head = Eagle3Head(config, attn_backend, target_hidden_size=target_h,
                      draft_vocab_size=draft_vocab,
                      own_embedding="embed_tokens.weight" in tensors,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)))
    if "d2t" not in tensors and draft_vocab == config.vocab_size:
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # identity mapping
    load_head_state(head, tensors, path, "EAGLE-3", ignored=("t2d",))
    d2t = head.d2t
    mapped = torch.arange(draft_vocab) + d2t
    if bool(((mapped < 0) | (mapped >= target.vocab_size)).any()):
        raise ValueError(f"EAGLE-3 head {path}: d2t maps draft ids outside the target's "
                         f"{target.vocab_size} tokens")
    eagle_config = raw.get("eagle_config") or {}
    layers = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(int(i) for i in layers) if layers else (2, n // 2, n - 3)
    if len(aux) != 3 or any(not 0 <= i < n for i in aux) or len(set(aux)) != 3:
        raise ValueError(f"EAGLE-3 head {path} reads target layers {list(aux)}; the target "
                         f"has {n} layers (three distinct ids in [0, {n}) are needed)")
    return _place(head, device, dtype), config, tuple(sorted(aux))


def load_medusa_heads(path: str, target: ModelConfig, num_speculative_tokens: int,
                      device: torch.device, dtype: torch.dtype) -> MedusaHeads:
    """Build and load the Medusa heads in `path` (either public layout). Raises
    ValueError when k exceeds the heads, the sizes disagree with the target, or the
    checkpoint is not a Medusa one."""
    raw = read_head_config(path)
    fasterdecoding = "medusa_num_heads" in raw
    num_heads = raw.get("medusa_num_heads", raw.get("num_heads"))
    num_layers = raw.get("medusa_num_layers", raw.get("num_hidden_layers", 1))
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"Medusa checkpoint {path}: config.json needs num_heads (vLLM's "
                         "layout) or medusa_num_heads (FasterDecoding's)")
    hidden = int(raw.get("hidden_size", target.hidden_size))
    vocab = int(raw.get("vocab_size", target.vocab_size))
    if hidden != target.hidden_size or vocab != target.vocab_size:
        raise ValueError(f"Medusa heads {path} are {hidden} wide over {vocab} tokens, the "
                         f"target {target.hidden_size} over {target.vocab_size}")
    truncated = raw.get("truncated_vocab_size")
    if truncated is not None and int(truncated) != vocab:
        raise ValueError(f"Medusa heads {path} have a truncated vocabulary "
                         f"({truncated} of {vocab}); FlowEngine's Medusa needs full heads")
    if num_speculative_tokens > num_heads:
        raise ValueError(f"speculative_config: num_speculative_tokens "
                         f"{num_speculative_tokens} exceeds the {num_heads} Medusa heads of "
                         f"{path}")
    own = not raw.get("original_lm_head", False)
    heads = MedusaHeads(hidden, vocab, num_heads, int(num_layers), own_lm_heads=own)
    tensors = read_head_tensors(path)

    def rename(name: str) -> str:
        if not fasterdecoding:
            return name
        parts = name.split(".")  # blocks.i.layers.j.linear.w | lm_heads.i.weight
        if parts[0] == "blocks":
            return f"{parts[1]}.{parts[3]}.{'.'.join(parts[4:])}"
        return f"{parts[1]}.{num_layers}.{parts[2]}"

    load_head_state(heads, tensors, path, "Medusa", rename)
    return _place(heads, device, dtype)  # type: ignore[return-value]
