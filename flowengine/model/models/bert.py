"""BERT encoders in plain PyTorch (Devlin et al. 2019, "BERT"), for embedding models.

Serves `BertModel` checkpoints such as sentence-transformers' all-MiniLM-L6-v2 under the
pooling runner (flowengine/pooling/): the forward returns the last layer's hidden state
of every token, and the pooler reduces each request's rows to one vector.

One encoder layer: bidirectional multi-head self-attention with biases, then a GELU MLP,
each followed by a residual add and LayerNorm (post-LN, unlike the pre-norm decoders).
Embeddings are the sum of word, absolute position and token type embeddings (type 0:
one segment per request), then LayerNorm. Operations run in transformers' order
(`modeling_bert.py`), so float32 outputs match it to rounding.

Attention needs no KV cache: with the pooling runner a request's whole prompt is in one
step (chunked prefill and prefix caching are off), so every token attends to the step's
own keys of its request. The `kv_caches` argument is accepted for the runner's uniform
call and ignored (the runner allocates none for encoder-only models).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.model_config import ModelConfig
from flowengine.model.weight_shards import WeightShard, read_shard, tensor_shape

# Checkpoint tensors the encoder does not use: a buffer of old checkpoints, the
# [CLS] pooler head (sentence-transformers pools the token states instead) and the
# pretraining heads of BertForPreTraining / BertForMaskedLM.
_IGNORED_PREFIXES = ("pooler.", "cls.")
_IGNORED_NAMES = ("embeddings.position_ids",)

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class PaddedBatch:
    """Where each token of a flattened step sits in a padded [R, L] batch.

    Built once per forward from the step's query_start_loc and shared by every layer.
    dest: [T] int64 row of each token in the flattened [R * L] padded batch.
    key_mask: [R, 1, 1, L] bool, True = a real token (None when all R requests have
    length L: no padding to mask).
    """

    def __init__(self, query_start_loc_cpu: torch.Tensor, device: torch.device) -> None:
        qsl = query_start_loc_cpu.to(torch.int64)
        lens = qsl[1:] - qsl[:-1]
        self.num_reqs = int(lens.shape[0])
        self.max_len = int(lens.max()) if self.num_reqs else 0
        self.num_tokens = int(qsl[-1])
        req = torch.repeat_interleave(torch.arange(self.num_reqs), lens)
        pos = torch.arange(self.num_tokens) - qsl[:-1].repeat_interleave(lens)
        self.dest = (req * self.max_len + pos).to(device)
        self.key_mask: torch.Tensor | None = None
        if self.num_reqs and bool((lens != self.max_len).any()):
            mask = torch.arange(self.max_len)[None, :] < lens[:, None]
            self.key_mask = mask[:, None, None, :].to(device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [R, H, L, D] (padding rows zero)."""
        _, heads, dim = x.shape
        out = x.new_zeros(self.num_reqs * self.max_len, heads, dim)
        out.index_copy_(0, self.dest, x)
        return out.view(self.num_reqs, self.max_len, heads, dim).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[R, H, L, D] -> [T, H * D]."""
        num_reqs, heads, length, dim = x.shape
        flat = x.transpose(1, 2).reshape(num_reqs * length, heads * dim)
        return flat.index_select(0, self.dest)


class BertSelfAttention(nn.Module):
    """Bidirectional attention within each request; q/k/v fused in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        width = config.num_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * width, bias=True)
        self.dense = nn.Linear(width, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        """hidden [T, hidden_size] -> LayerNorm(hidden + attention(hidden)), same shape."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads,
                                             self.head_dim).unbind(1)
        attn = F.scaled_dot_product_attention(batch.pad(q), batch.pad(k), batch.pad(v),
                                              attn_mask=batch.key_mask)
        return self.norm(self.dense(batch.unpad(attn)) + hidden)


class BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN(x + attn(x)); x = LN(x + down(act(up(x))))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported for BERT "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
        self.attention = BertSelfAttention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        hidden = self.attention(hidden, batch)
        return self.norm(self.output(self.act(self.intermediate(hidden))) + hidden)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1),
                                                  config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Token type 0 for every token: one segment per request (as vLLM and
        # sentence-transformers do for single texts).
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]
        return self.norm(hidden + self.position_embeddings(positions))


class BertModel(nn.Module):
    """A BERT encoder over a flattened batch of whole prompts.

    Args:
        model_config: the resolved architecture (`ModelConfig`, `rms_norm_eps` holds
            BERT's `layer_norm_eps`).
        attn_backend: unused (attention runs here, without a KV cache); accepted for
            the loader's uniform constructor.
        tp: must be a single rank; BERT encoders are small enough for one device.

    Raises ValueError under tensor parallelism.
    """

    def __init__(self, model_config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        if tp.world_size != 1:
            raise ValueError(f"{model_config.architecture} runs on one device; set "
                             "tensor_parallel_size 1")
        self.config = model_config
        self.tp = tp
        self.embeddings = BertEmbeddings(model_config)
        self.layers = nn.ModuleList(BertLayer(model_config)
                                    for _ in range(model_config.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 (each request's whole prompt, positions from 0)
        -> last-layer hidden states [T, hidden_size], model dtype. Tokens beyond
        query_start_loc[-1] (padding) are returned unchanged in count, as zeros."""
        num_real = int(attn_metadata.query_start_loc_cpu[-1])
        batch = PaddedBatch(attn_metadata.query_start_loc_cpu, input_ids.device)
        hidden = self.embeddings(input_ids[:num_real], positions[:num_real])
        for layer in self.layers:
            hidden = layer(hidden, batch)
        if num_real < input_ids.shape[0]:
            hidden = torch.cat([hidden, hidden.new_zeros(input_ids.shape[0] - num_real,
                                                         hidden.shape[1])])
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{self.config.architecture} is an encoder without a language-model "
                         "head; it serves embeddings (runner 'pooling'), not generation")

    # ------------------------------------------------------------------ weights
    def weight_shards(self) -> list[WeightShard]:
        """Every checkpoint tensor (Hugging Face names) with its parameter; q/k/v weights
        and biases fill rows of the fused qkv_proj."""
        c = self.config
        width = c.num_heads * c.head_dim
        shards: list[WeightShard] = []
        for name, param in self.named_parameters():
            hf = _hf_name(name)
            if ".attention.qkv_proj." in name:
                base, leaf = hf.rsplit(".qkv_proj.", 1)
                cols = (c.hidden_size,) if leaf == "weight" else ()
                for i, part in enumerate(("query", "key", "value")):
                    shards.append(WeightShard(f"{base}.self.{part}.{leaf}", name, (width, *cols),
                                              0, 0, width, i * width))
            else:
                shards.append(WeightShard(hf, name, tuple(param.shape)))
        return shards

    def expected_weight_names(self) -> set[str]:
        return {s.hf_name for s in self.weight_shards()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy checkpoint tensors (names with or without the `bert.` prefix of
        BertFor* checkpoints) into the parameters. Returns the names loaded (without
        the prefix). Raises ValueError for an unknown tensor or a shape that disagrees
        with config.json."""
        targets: dict[str, list[WeightShard]] = {}
        for shard in self.weight_shards():
            targets.setdefault(shard.hf_name, []).append(shard)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_IGNORED_PREFIXES) or name in _IGNORED_NAMES:
                continue
            shards = targets.get(name)
            if shards is None:
                unexpected.append(name)
                continue
            for shard in shards:
                if tensor_shape(tensor) != shard.full_shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tensor_shape(tensor)} but the "
                        f"model built from config.json expects {shard.full_shape}")
                shard.destination(params[shard.param]).copy_(read_shard(tensor, shard))
            loaded.add(name)
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} tensor(s) this BERT model has no place "
                f"for: {sorted(unexpected)[:20]}; check that config.json matches the weights")
        return loaded


# A layer parameter's module path -> transformers' (modeling_bert.py) module path.
_LAYER_MODULES = {
    "attention.qkv_proj": "attention.qkv_proj",  # split into self.query/key/value
    "attention.dense": "attention.output.dense",
    "attention.norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "norm": "output.LayerNorm",
}


def _hf_name(param_name: str) -> str:
    """The checkpoint name of a parameter (transformers' module names)."""
    if param_name.startswith("embeddings."):
        return param_name.replace("embeddings.norm.", "embeddings.LayerNorm.")
    _, index, rest = param_name.split(".", 2)  # "layers", "3", "attention.dense.weight"
    module, leaf = rest.rsplit(".", 1)
    return f"encoder.layer.{index}.{_LAYER_MODULES[module]}.{leaf}"
