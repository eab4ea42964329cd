"""The W4A16 GEMM compiles for sm_90 (H100/H200) without a GPU, at Llama-3.1-8B's decode
launch parameters (down_proj K 14336, grouped tiles) and an act-order prefill tile; the
same child-process compile as test_kernel_compile_sm90.py (which owns the other
kernels' list)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

W4A16 = [
    ("w4a16", "_w4a16_gemm_kernel",
     {"N": 4096, "K": 14336, "GROUP_SIZE": 128, "K_PER_SPLIT": 1792, "BLOCK_M": 16,
      "BLOCK_N": 64, "BLOCK_K": 128, "HAS_G_IDX": False, "GROUPED": True, "HAS_BIAS": False,
      "DOT_PRECISION": "tf32"}),
    ("w4a16", "_w4a16_gemm_kernel",
     {"N": 28672, "K": 4096, "GROUP_SIZE": 128, "K_PER_SPLIT": 4096, "BLOCK_M": 64,
      "BLOCK_N": 128, "BLOCK_K": 128, "HAS_G_IDX": True, "GROUPED": False, "HAS_BIAS": True,
      "DOT_PRECISION": "tf32"}),
]
POINTERS = {"qweight_ptr": "*i32", "qzeros_ptr": "*u8", "scales_ptr": "*fp16",
            "g_idx_ptr": "*i32", "out_ptr": "*fp32"}


def test_w4a16_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_kernel_compile_sm90 as t, test_kernel_w4a16_sm90 as w\n"
        "t.KERNELS[:] = w.W4A16; t.FP8_KERNELS[:] = []; t.POINTER_TYPES.update(w.POINTERS)\n"
        "t.compile_all()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"w4a16 does not compile for sm_90:\n{proc.stderr[-6000:]}"
