"""The C extension's AVX2 bodies (CPUs without AVX-512: AMD Zen 1-3, Intel client parts)
on a CPU that has AVX-512 too: the SiLU-and-mul and decode-attention kernel tests rerun
in a fresh interpreter with FLOWENGINE_CPU_NO_AVX512=1, which the extension reads once
per process. (The quantized matmul's AVX2 body: test_quant_kernels.test_avx2_body.) On a
CPU without AVX-512 the ordinary runs of those tests already take the AVX2 bodies."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_quant_kernels import _cpu_flags  # tests/cpu is on sys.path (no __init__)

from flowengine import _cpu_ops

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= _cpu_flags(),
                    reason="no AVX2/FMA/F16C on this CPU")
@pytest.mark.skipif(not _cpu_ops.has_avx512(),
                    reason="no AVX-512 here: the kernel tests themselves run the AVX2 bodies")
def test_kernel_tests_pass_on_the_avx2_bodies():
    env = dict(os.environ, FLOWENGINE_CPU_NO_AVX512="1")
    probe = subprocess.run(
        [sys.executable, "-c", "from flowengine import _cpu_ops as o; "
         "print(o.has_avx512(), o.linear_path(1))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["False", "avx2"], probe.stdout + probe.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.join(HERE, "test_cpu_kernels.py"), os.path.join(HERE, "test_cpu_attention.py")],
        env=env, capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(HERE)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
