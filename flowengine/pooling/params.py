"""Per-request pooling options and the embedding outputs (vLLM's names and shapes).

The executor returns each request's pooled vector raw (float32, before truncation and
normalisation); the frontend applies the request's `PoolingParams` here: first the
Matryoshka truncation to `dimensions`, then L2 normalisation when asked (the order
vLLM and sentence-transformers use, so a truncated vector has unit norm).

No torch: runs in the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# F.normalize's epsilon: a zero vector stays zero instead of becoming NaN.
_NORM_EPS = 1e-12


@dataclass(frozen=True)
class PoolingParams:
    """Options of one embedding request (vLLM's `PoolingParams`).

    dimensions: keep the first `dimensions` values (Matryoshka models only; checked
        against the model's PoolerConfig at admission). normalize: L2-normalise; None:
        the model's default (PoolerConfig.normalize). truncate_prompt_tokens: keep the
        last k prompt tokens (-1: max_model_len), as for generation.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
                not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)
                              or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {k!r}")


def finish_embedding(raw: bytes, params: PoolingParams, default_normalize: bool) -> np.ndarray:
    """A request's embedding from the executor's raw pooled vector.

    raw: float32 little-endian bytes, [hidden_size]. Returns [dimensions or hidden_size]
    float32: truncated to params.dimensions, then L2-normalised if params.normalize
    (None: default_normalize).
    """
    vec = np.frombuffer(raw, dtype="<f4")
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    normalize = default_normalize if params.normalize is None else params.normalize
    if normalize:
        vec = vec / max(float(np.linalg.norm(vec)), _NORM_EPS)
    return vec.astype("<f4", copy=False)


class EmbeddingOutput:
    """The embedding of one request (vLLM's `EmbeddingOutput`).

    embedding: list[float] (made on first access); vector: the same as a float32
    numpy array [hidden_size]; hidden_size: its length.
    """

    __slots__ = ("vector", "_list")

    def __init__(self, vector: np.ndarray) -> None:
        self.vector = vector
        self._list: list[float] | None = None

    @property
    def embedding(self) -> list[float]:
        if self._list is None:
            self._list = self.vector.tolist()
        return self._list

    @property
    def hidden_size(self) -> int:
        return int(self.vector.shape[0])

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt and `AsyncEngine.encode` yields (vLLM's
    `EmbeddingRequestOutput`): `outputs.embedding` is the vector; `error` is set (and
    outputs None) when the request failed in the engine."""

    request_id: str
    outputs: EmbeddingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    error: str | None = None


# vLLM's pooling tasks (`PoolingTask`); a pooling-runner model here serves "embed".
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
SERVED_POOLING_TASKS = ("embed",)


def supported_tasks(runner: str) -> tuple[str, ...]:
    """What a model of this runner serves (vLLM's `LLM.supported_tasks`)."""
    return SERVED_POOLING_TASKS if runner == "pooling" else ("generate",)


def check_pooling_task(pooling_task: str | None, runner: str) -> str:
    """`LLM.encode`'s pooling_task, checked against the model (vLLM's rules: the task
    is required, and must be one the model supports). Raises ValueError saying what to
    use instead."""
    if pooling_task is None:
        raise ValueError(
            "pooling_task is required for LLM.encode; for embeddings use LLM.embed(...) "
            "or pooling_task='embed'"
        )
    if runner != "pooling":
        raise ValueError(
            f"LLM.encode(pooling_task={pooling_task!r}) needs a pooling model, but this "
            "one runs the 'generate' runner; load an embedding model, or the same weights "
            "with runner='pooling' (decoder models pool their last token)"
        )
    if pooling_task not in SERVED_POOLING_TASKS:
        known = "" if pooling_task in POOLING_TASKS else " (not a vLLM pooling task)"
        raise ValueError(
            f"pooling_task {pooling_task!r}{known} is not supported by this model; it "
            f"supports {list(SERVED_POOLING_TASKS)}"
        )
    return pooling_task


class PoolingOutput:
    """The pooled output of one request (vLLM's `PoolingOutput`): `data` is a
    float32 torch tensor [hidden_size] (for "embed": the embedding, truncated and
    normalised as its PoolingParams say)."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"PoolingOutput(data=<tensor of shape {tuple(self.data.shape)}>)"


@dataclass
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt (vLLM's `PoolingRequestOutput`): `outputs`
    the pooled tensor; `error` is set (and outputs None) when the request failed."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    error: str | None = None
