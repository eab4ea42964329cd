"""Intra-op threads of a CPU executor: how many, and how they wait (issue #20).

OpenMP threads that spin while they wait for work take whole cores from anything else
that runs there, and a spinning pool whose sibling was descheduled makes every small
matmul wait a scheduler tick: on a shared 2-core machine one decode step of the default
model took 6x longer with torch's default (active) wait than with passive waiting.
So FlowEngine sets OMP_WAIT_POLICY=PASSIVE unless the user set a policy. libgomp reads
it once, when the library loads (with `import torch`), which is why `flowengine`'s
package import calls `configure_wait_policy` before anything imports torch; a process
that imported torch first keeps the policy it started with (a log line says so).

The thread count comes from the cores the process may use (its CPU affinity, bounded by
a cgroup CPU quota, as in a container), shared among tensor-parallel ranks;
`--cpu-threads` (EngineArgs.cpu_threads) overrides it, and so does OMP_NUM_THREADS.
"""

from __future__ import annotations

import logging
import math
import os
import sys

logger = logging.getLogger(__name__)

_WAIT_POLICY_SET_BY_US = False


def configure_wait_policy() -> None:
    """Default OMP_WAIT_POLICY to PASSIVE (a no-op when the user chose a policy). Call
    before torch is imported."""
    global _WAIT_POLICY_SET_BY_US
    if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _WAIT_POLICY_SET_BY_US = True


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup quota allows (quota / period; cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us`), or None when unlimited or unknown."""
    try:
        with open(os.path.join(root, "cpu.max"), encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(period) > 0:
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="ascii") as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="ascii") as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by the cgroup quota
    (rounded up: a 1.5-CPU quota still runs two threads part of the time)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def cpu_thread_count(cpu_threads: int | None, world_size: int = 1,
                     reserved_cpus: int = 0) -> tuple[int, str]:
    """(threads, where the number came from) for one CPU executor rank.

    cpu_threads: the user's --cpu-threads (wins). Else OMP_NUM_THREADS. Else the
    available cores less `reserved_cpus` (for the engine and frontend processes of a
    multiproc placement), divided among `world_size` ranks, at least 1.
    """
    if cpu_threads is not None:
        return cpu_threads, "--cpu-threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cpus = available_cpus()
    return max(1, (cpus - reserved_cpus) // world_size), f"{cpus} available core(s)"


def setup_cpu_threads(cpu_threads: int | None, world_size: int = 1,
                      reserved_cpus: int = 0) -> int:
    """Set torch's intra-op threads for this executor and log the choice and the wait
    policy. Returns the thread count."""
    import torch

    threads, source = cpu_thread_count(cpu_threads, world_size, reserved_cpus)
    torch.set_num_threads(threads)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset (libgomp spins before sleeping)")
    logger.info("CPU executor: %d intra-op thread(s) (from %s), OMP_WAIT_POLICY %s%s",
                threads, source, policy,
                "" if _WAIT_POLICY_SET_BY_US or "OMP_WAIT_POLICY" in os.environ
                else "; torch was imported before flowengine, so its threads spin "
                     "while they wait (set OMP_WAIT_POLICY=PASSIVE to avoid it)")
    return threads


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_matmul_path(flags: set[str] | None = None) -> tuple[bool, str]:
    """(native, description) of how bfloat16 matmuls run on this CPU: oneDNN's AMX or
    AVX512-BF16 kernels where the CPU has them, else emulated (converted to float32
    inside oneDNN/ATen, several times slower than float32 itself)."""
    import torch

    flags = cpu_flags() if flags is None else flags
    onednn = torch.backends.mkldnn.is_available()
    if onednn and "amx_bf16" in flags:
        return True, "oneDNN with AMX-BF16"
    if onednn and "avx512_bf16" in flags:
        return True, "oneDNN with AVX512-BF16"
    return False, "emulated (this CPU has neither AMX-BF16 nor AVX512-BF16)"


def log_bf16_path() -> None:
    """Say which bfloat16 matmul path the executor takes; warn when it is emulated."""
    native, path = bf16_matmul_path()
    if native:
        logger.info("bfloat16 on the CPU: matmuls by %s", path)
    else:
        logger.warning("bfloat16 on the CPU: matmuls %s; float32 (--dtype float32) is "
                       "faster here", path)


def log_quantized_bf16_path(native: bool) -> None:
    """Say what `--dtype bfloat16` does with quantized weights on this CPU (resolve():
    float32 activations; where bf16 is native, bf16 products (AMX tiles for batched
    decode, bf16 GEMMs for the prefill) and a bf16 KV cache (build_executor))."""
    if native:
        from flowengine.model.layers.quant_linear import (
            BF16_GEMM_MIN_ROWS,
            amx_int8_max_rows,
            bf16_rows,
        )

        rows = {f: bf16_rows(f) for f in BF16_GEMM_MIN_ROWS}
        amx = ", ".join(f"{f} >= {r[0]}" for f, r in rows.items() if r and r[0])
        i8 = amx_int8_max_rows()
        if amx and i8:
            amx = (f"{amx} rows; up to {i8} rows AMX-INT8 products of the activations "
                   f"rounded to 16 bits per 32-value block, more rows AMX-BF16")
        elif amx:
            amx = f"{amx} rows; AMX-BF16"
        logger.info("bfloat16 with quantized weights on the CPU: activations and fused "
                    "decode kernels in float32, the KV cache in bf16 (with "
                    "--kv-cache-dtype auto); %smatmuls of many rows (prefill; %s) in bf16 "
                    "by %s",
                    f"batched decode matmuls on AMX tiles ({amx}), " if amx else "",
                    ", ".join(f"{f} >= {r[1]}" for f, r in rows.items() if r),
                    bf16_matmul_path()[1])
    else:
        logger.warning("bfloat16 with quantized weights on the CPU: bf16 matmuls are %s; "
                       "running float32", bf16_matmul_path()[1])
