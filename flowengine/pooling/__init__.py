"""Embeddings: pooling hidden states into one vector per request (the pooling runner).

- `config.py`: which pooling a model gets (`PoolerConfig`, from the user's
  `--pooler-config`, else the model's sentence-transformers files, else the
  architecture's default) and the runner a model resolves to;
- `params.py`: per-request options (`PoolingParams`: dimensions, normalize) and their
  application to a pooled vector in the frontend; the outputs `LLM.embed` and
  `LLM.encode` return, and `LLM.encode`'s pooling_task check;
- `pooler.py`: the device side, [T, hidden] states of a step -> [R, hidden] float32.

This module and params.py/config.py import no torch: the frontend and the scheduler's
process use them.
"""

from flowengine.pooling.config import PoolerConfig
from flowengine.pooling.params import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
)

__all__ = [
    "EmbeddingOutput", "EmbeddingRequestOutput", "PoolerConfig", "PoolingOutput",
    "PoolingParams", "PoolingRequestOutput",
]  # fmt: skip
