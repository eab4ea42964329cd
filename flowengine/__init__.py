"""FlowEngine: high-throughput LLM inference and serving.

Public API: `LLM` (offline batches), `AsyncEngine` (async `submit()`),
`SamplingParams`, `RequestOutput`, `CompletionOutput`, `EngineArgs`; for embeddings
`PoolingParams` and `EmbeddingRequestOutput` (`LLM.embed`, `AsyncEngine.encode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowengine.config import EngineArgs
from flowengine.outputs import CompletionOutput, Logprob, RequestOutput
from flowengine.pooling.params import EmbeddingRequestOutput, PoolingParams
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.version import __version__

if TYPE_CHECKING:
    from flowengine.entrypoints.async_engine import AsyncEngine
    from flowengine.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Import the heavy parts (torch, transformers) only when they are used.
    if name == "LLM":
        from flowengine.entrypoints.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from flowengine.entrypoints.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'flowengine' has no attribute {name!r}")
