"""Project-wide pytest setup: run Triton kernels in interpreter mode on machines
without an NVIDIA GPU, so the kernel tests (tests/kernels) exercise them on CPU.

NOTE: must run before any module decorates a kernel with `triton.jit` (the decorator
reads TRITON_INTERPRET), which is why it lives in the top-level conftest, imported
first. An explicit TRITON_INTERPRET in the environment wins.
"""

from __future__ import annotations

import os

if "CUDA_VISIBLE_DEVICES" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
