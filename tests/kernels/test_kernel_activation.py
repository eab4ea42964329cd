from __future__ import annotations

import pytest
import torch
from kernel_refs import assert_close, ref_silu_and_mul

from flowengine.kernels.activation import BLOCK_COLS, silu_and_mul


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, {"rtol": 1e-6, "atol": 1e-6}),
     (torch.bfloat16, {"rtol": 8e-3, "atol": 8e-3})],  # one bf16 rounding (2**-8)
)
def test_silu_and_mul(dtype: torch.dtype, tol: dict[str, float], device: torch.device) -> None:
    intermediate = BLOCK_COLS + 476  # two column blocks, the last one partial
    # Row stride wider than the row: a view into a larger buffer.
    x = (torch.randn(7, 2 * intermediate + 8, device=device) * 4)[:, : 2 * intermediate].to(dtype)
    out = torch.full((7, intermediate), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, ref_silu_and_mul(x), **tol)


def test_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* intermediate_size columns"):
        silu_and_mul(torch.randn(2, 7))
