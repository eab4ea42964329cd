"""Thread count and wait policy of the CPU executor (flowengine/executor/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flowengine.executor import cpu_threads
from flowengine.executor.cpu_threads import (
    bf16_matmul_path,
    cgroup_cpu_limit,
    cpu_thread_count,
)


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None


def test_thread_count_sources(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_thread_count(3) == (3, "--cpu-threads")
    assert cpu_thread_count(None) == (8, "8 available core(s)")
    assert cpu_thread_count(None, world_size=2, reserved_cpus=1) == (3, "8 available core(s)")
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 1)
    assert cpu_thread_count(None, world_size=2, reserved_cpus=1)[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_thread_count(None) == (5, "OMP_NUM_THREADS")
    assert cpu_thread_count(2) == (2, "--cpu-threads")


def test_available_cpus_follows_affinity():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no sched_getaffinity")
    assert 1 <= cpu_threads.available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("env,expected", [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "active"},
                                                              "active")])
def test_import_sets_passive_wait_unless_chosen(env, expected):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import flowengine, os; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == expected


def test_bf16_path_from_flags():
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    assert bf16_matmul_path({"avx512f", "amx_bf16", "avx512_bf16"}) == (True, "oneDNN with AMX-BF16")
    assert bf16_matmul_path({"avx512f", "avx512_bf16"}) == (True, "oneDNN with AVX512-BF16")
    native, text = bf16_matmul_path({"avx2"})
    assert not native and "emulated" in text


def test_cpu_threads_argument_validated():
    from flowengine.config import EngineArgs

    with pytest.raises(ValueError, match="cpu_threads"):
        EngineArgs(cpu_threads=0)
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="fp4")
