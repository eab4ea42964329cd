"""The C extension's other bodies on this CPU: the SiLU-and-mul and decode-attention
kernel tests rerun in a fresh interpreter with the faster bodies switched off (the
extension reads FLOWENGINE_CPU_NO_AVX512 / FLOWENGINE_CPU_NO_AVX2 once per process):
- "avx2" (CPUs without AVX-512: AMD Zen 1-3, Intel client parts), on a CPU that has
  AVX-512 too (on one without it the ordinary runs of those tests take the AVX2 bodies);
- "c", the portable bodies, on any CPU.
(The quantized matmul's bodies: test_quant_kernels.test_avx2_body and
test_portable_body_without_avx512.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from flowengine.executor.cpu_threads import cpu_flags

_cpu_ops = pytest.importorskip("flowengine._cpu_ops")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SWITCHES = {"avx2": {"FLOWENGINE_CPU_NO_AVX512": "1"},
            "c": {"FLOWENGINE_CPU_NO_AVX512": "1", "FLOWENGINE_CPU_NO_AVX2": "1"}}


@pytest.mark.parametrize("body", ["avx2", "c"])
def test_kernel_tests_pass_on_the_other_bodies(body):
    if body == "avx2":
        if not {"avx2", "fma", "f16c"} <= cpu_flags():
            pytest.skip("no AVX2/FMA/F16C on this CPU")
        if not _cpu_ops.has_avx512():
            pytest.skip("no AVX-512 here: the kernel tests themselves run the AVX2 bodies")
    env = dict(os.environ, **SWITCHES[body])
    env.pop("FLOWENGINE_CPU_NO_FUSED", None)
    probe = subprocess.run(
        [sys.executable, "-c", "from flowengine import _cpu_ops as o; "
         "print(o.has_avx512(), o.linear_path(1))"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    has_avx512, path = probe.stdout.split()
    # AVX2: "avx2", or "avx2-int16" (1 row with int16 products)
    assert has_avx512 == "False" and path.split("-")[0] == body, probe.stdout + probe.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         os.path.join(HERE, "test_cpu_kernels.py"), os.path.join(HERE, "test_cpu_attention.py")],
        env=env, capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 60, proc.stdout[-3000:]
