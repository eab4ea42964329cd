"""Scale-out arguments: --data-parallel-size, --pipeline-parallel-size and
--distributed-executor-backend (vLLM's names) are validated with errors that say what
to change."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from flowengine.config import EngineArgs
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from


def test_data_parallel_runs_multiproc() -> None:
    args = EngineArgs(data_parallel_size=2)
    assert args.placement == "multiproc"
    assert EngineArgs().data_parallel_size == 1
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        EngineArgs(data_parallel_size=0)


def test_cli_flags_reach_engine_args() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--data-parallel-size", "3", "--distributed-executor-backend", "mp"])
    args = engine_args_from(ns)
    assert (args.data_parallel_size, args.distributed_executor_backend) == (3, "mp")
    assert engine_args_from(parser.parse_args(["-dp", "2"])).data_parallel_size == 2


def test_pipeline_parallel_size_is_validated() -> None:
    assert EngineArgs(pipeline_parallel_size=1).pipeline_parallel_size == 1
    assert EngineArgs(pipeline_parallel_size=2).placement == "multiproc"
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineArgs(pipeline_parallel_size=0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["-pp", "2"])).pipeline_parallel_size == 2


def test_executor_backend_values() -> None:
    for ok in (None, "mp", "uni"):
        assert EngineArgs(distributed_executor_backend=ok).distributed_executor_backend == ok
    with pytest.raises(ValueError, match="must be 'mp', 'ray' or 'uni', got 'mpi'"):
        EngineArgs(distributed_executor_backend="mpi")


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
def test_ray_backend_without_ray_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pip install flowengine\[ray\]"):
        EngineArgs(distributed_executor_backend="ray")
