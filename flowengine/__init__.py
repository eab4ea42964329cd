"""FlowEngine: high-throughput LLM inference and serving.

Public API: `LLM` (offline batches), `AsyncEngine` (async `submit()`),
`SamplingParams`, `RequestOutput`, `CompletionOutput`, `EngineArgs`; for embeddings
`PoolingParams` and `EmbeddingRequestOutput` (`LLM.embed`, `AsyncEngine.encode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Before anything imports torch: CPU executor threads wait passively (see there).
from flowengine.executor.cpu_threads import configure_wait_policy

configure_wait_policy()

from flowengine.config import EngineArgs  # noqa: E402
from flowengine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from flowengine.pooling.params import EmbeddingRequestOutput, PoolingParams  # noqa: E402
from flowengine.sampling_params import (  # noqa: E402
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from flowengine.version import __version__  # noqa: E402

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
    "RequestOutputKind",
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
