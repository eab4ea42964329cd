"""More data-parallel replicas than the host can run are refused before any process
starts (`flowengine serve --data-parallel-size 99999` on a 2-core CPU used to spawn
replica after replica until killed)."""

from __future__ import annotations

import pytest

from flowengine.config import EngineArgs
from flowengine.engine.builder import _check_data_parallel, resolve
from flowengine.executor.cpu_threads import available_cpus


def test_more_replicas_than_cpu_cores_is_refused(default_model_path, monkeypatch) -> None:
    cpus = available_cpus()
    args = EngineArgs(model=default_model_path, data_parallel_size=cpus + 1, device="cpu")
    spawned = []
    monkeypatch.setattr("flowengine.actors.supervisor.Supervisor.start",
                        lambda self: spawned.append(self))
    with pytest.raises(ValueError) as err:
        resolve(args)
    assert str(err.value) == (
        f"data_parallel_size {cpus + 1} needs at least {cpus + 1} CPU cores (one per "
        f"replica), but {cpus} are available; lower data_parallel_size")
    assert spawned == []
    _check_data_parallel(cpus, 1, "cpu")  # one replica per core is fine
    _check_data_parallel(1, 8, "cpu")  # no data parallelism: nothing to check


def test_cuda_replicas_need_their_gpus(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    _check_data_parallel(2, 2, "cuda")
    with pytest.raises(ValueError) as err:
        _check_data_parallel(3, 2, "cuda")
    assert str(err.value) == (
        "data_parallel_size 3 x tensor_parallel_size 2 needs 6 GPUs, but torch sees 4; "
        "lower data_parallel_size")
