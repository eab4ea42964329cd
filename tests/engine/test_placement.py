"""placement "auto" (the default): multiproc for the server on CUDA, inproc on the CPU and
for the offline LLM; an explicit placement is kept (config.settle_placement)."""

from __future__ import annotations

import argparse

import pytest

from flowengine.config import EngineArgs, settle_placement
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from


@pytest.mark.parametrize(("device", "frontend", "want"), [
    ("cuda", True, "multiproc"),
    ("cpu", True, "inproc"),
    ("cuda", False, "inproc"),
    ("cpu", False, "inproc"),
])
def test_auto_settles_by_device_and_caller(device: str, frontend: bool, want: str) -> None:
    args = EngineArgs(model="m", max_num_seqs=7)
    assert args.placement == "auto"
    settled = settle_placement(args, device, frontend=frontend)
    assert settled.placement == want
    assert (settled.model, settled.max_num_seqs) == ("m", 7)  # nothing else changes


@pytest.mark.parametrize("placement", ["inproc", "multiproc"])
def test_an_explicit_placement_is_kept(placement: str) -> None:
    args = EngineArgs(placement=placement)
    for device in ("cuda", "cpu"):
        assert settle_placement(args, device, frontend=True) is args


def test_parallel_sizes_still_force_multiproc_and_cli_default_is_auto() -> None:
    assert EngineArgs(tensor_parallel_size=2).placement == "multiproc"
    assert EngineArgs(tensor_parallel_size=2, placement="inproc").placement == "multiproc"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).placement == "auto"
    assert engine_args_from(parser.parse_args(["--placement", "inproc"])).placement == "inproc"
    with pytest.raises(SystemExit):
        parser.parse_args(["--placement", "nowhere"])
    with pytest.raises(ValueError, match="placement must be one of"):
        EngineArgs(placement="nowhere")
