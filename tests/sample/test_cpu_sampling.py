"""The CPU's C sampler (`flowengine._cpu_ops.sample_rows`, Sampler._race_on_host)
against the torch ops it replaces (Sampler._sample_random): for seeded rows both draw
the same counter-based noise, so they must pick the same token, filters included;
greedy rows take the argmax; rows the masks leave one token or none behave as torch's
argmax does. The distributions of unseeded rows are checked by
test_sampling_distribution.py, which runs both paths."""

from __future__ import annotations

import pytest
import torch

import flowengine.sample.sampler as sampler_module
from flowengine.sample.metadata import SamplingState
from flowengine.sample.sampler import Sampler, cpu_ops
from flowengine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="flowengine._cpu_ops is not built")

FILTERS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.3, "top_p": 0.5, "top_k": 100},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.9, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 1},
]


def _both(logits: torch.Tensor, states: list[SamplingState], monkeypatch) -> tuple:
    monkeypatch.setattr(sampler_module, "FUSED_SAMPLING", True)
    c_path = Sampler(seed=3)(logits, states).sampled_token_ids
    monkeypatch.setattr(sampler_module, "FUSED_SAMPLING", False)
    torch_path = Sampler(seed=3)(logits, states).sampled_token_ids
    return c_path, torch_path


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_seeded_rows_pick_the_torch_paths_token(filters: dict, monkeypatch) -> None:
    """6 batches x 48 rows, a 5,003-token vocabulary (not a multiple of the C loop's 16
    lanes), logits of a 3x-scaled normal: every row's token is the torch path's."""
    gen = torch.Generator().manual_seed(11)
    for batch in range(6):
        logits = torch.randn(48, 5003, generator=gen) * 3
        states = [SamplingState(SamplingParams(seed=batch * 100 + i, **filters), [1],
                                list(range(i % 5))) for i in range(48)]
        c_path, torch_path = _both(logits, states, monkeypatch)
        assert torch.equal(c_path, torch_path), (batch, (c_path != torch_path).nonzero())


def test_mixed_batch_with_greedy_rows_strided_logits_and_masks(monkeypatch) -> None:
    """Greedy rows among seeded ones, logits that are a view with a row stride wider
    than the vocabulary, allowed_token_ids leaving a few tokens and one leaving one."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(40, 3100, generator=gen) * 2
    logits = wide[:, :3000]
    assert logits.stride(0) == 3100
    states = []
    for i in range(40):
        allowed = [7] if i == 3 else ([1, 50, 2999, 1234] if i % 4 == 1 else None)
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.5 + i / 40,
                                top_p=0.8 if i % 6 == 2 else 1.0,
                                seed=None if i % 3 == 0 else 7 + i, allowed_token_ids=allowed)
        states.append(SamplingState(params, [1], []))
    c_path, torch_path = _both(logits, states, monkeypatch)
    assert torch.equal(c_path, torch_path)
    greedy_rows = [i for i in range(40) if i % 3 == 0 and i % 4 != 1 and i != 3]
    assert torch.equal(c_path[greedy_rows], logits[greedy_rows].argmax(dim=-1))
    assert int(c_path[3]) == 7
    for i in range(1, 40, 4):
        assert int(c_path[i]) in (1, 50, 2999, 1234)


def test_direct_call_edge_rows() -> None:
    """sample_rows itself: a row of -inf gives token 0 (torch.argmax's answer); top-k
    1 and a 0.0 top-p-like tiny p keep the maximum only; ties of the maximum under
    greedy go to the lowest index; a bad shape is a ValueError."""
    ops = cpu_ops()
    logits = torch.randn(4, 100)
    logits[0] = float("-inf")
    logits[3, 10] = logits[3, 60] = 50.0
    keys = torch.arange(4, dtype=torch.int64) * 977
    top_k = torch.tensor([100, 1, 100, 100])
    top_p = torch.tensor([1.0, 1.0, 1e-6, 1.0])
    greedy = torch.tensor([0, 0, 0, 1], dtype=torch.uint8)
    out = torch.full((4,), -1, dtype=torch.int64)
    ops.sample_rows(logits.data_ptr(), 4, 100, 100, 0, top_k.data_ptr(), top_p.data_ptr(), 0,
                    keys.data_ptr(), greedy.data_ptr(), out.data_ptr(), 2)
    assert out.tolist() == [0, int(logits[1].argmax()), int(logits[2].argmax()), 10]
    with pytest.raises(ValueError):
        ops.sample_rows(logits.data_ptr(), 4, 100, 50, 0, 0, 0, 0, keys.data_ptr(), 0,
                        out.data_ptr(), 1)


def test_all_greedy_batch_is_torch_argmax() -> None:
    """An all-greedy batch (one C call, greedy = 1): torch.argmax's token in every row,
    ties of the maximum to the lowest index (within and across 16-lane groups and in
    the tail), a row of -inf to token 0, a vocabulary of 4,099 and a row stride."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(9, 4200, generator=gen)
    logits = wide[:, :4099]
    logits[1, 5] = logits[1, 9] = 40.0        # a tie inside one group
    logits[2, 17] = logits[2, 4000] = 40.0    # across groups
    logits[3, 4097] = logits[3, 4098] = 40.0  # in the tail past the last full group
    logits[4] = float("-inf")
    logits[5, 2] = logits[5, 6] = 40.0        # inside one 8-lane group (the AVX2 body)
    states = [SamplingState(SamplingParams(temperature=0.0), [1], []) for _ in range(9)]
    got = Sampler()(logits, states).sampled_token_ids
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[1:6].tolist() == [5, 17, 4097, 0, 2]


@pytest.mark.parametrize("body", ["avx2", "scalar"])
def test_the_other_bodies_pick_the_same_tokens(body: str) -> None:
    """FLOWENGINE_CPU_NO_AVX512=1 (read once per process) takes the AVX2 bodies (8
    lanes; splitmix64's 64-bit products from 32-bit ones), and with
    FLOWENGINE_CPU_NO_AVX2=1 too the scalar loops (libm's logf), instead of the AVX-512
    bodies: the seeded and greedy tests, in a subprocess."""
    import os
    import subprocess
    import sys

    from flowengine.executor.cpu_threads import cpu_flags

    if body == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("no AVX2/FMA/F16C on this CPU")
    env = dict(os.environ, FLOWENGINE_CPU_NO_AVX512="1")
    if body == "scalar":
        env["FLOWENGINE_CPU_NO_AVX2"] = "1"
    probe = subprocess.run([sys.executable, "-c", "from flowengine import _cpu_ops as o; "
                            "print(o.has_avx512(), o.linear_path(1))"],
                           env=env, capture_output=True, text=True, timeout=120)
    has_avx512, path = probe.stdout.split()
    # the AVX2 matmul bodies ("avx2", or "avx2-int16" for 1 row with int16 products)
    assert has_avx512 == "False", probe.stderr
    assert path.startswith("avx2") if body == "avx2" else path == "c", (path, probe.stderr)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{__file__}::test_seeded_rows_pick_the_torch_paths_token",
                           f"{__file__}::test_all_greedy_batch_is_torch_argmax"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(FILTERS) + 1} passed" in proc.stdout


def test_low_temperature_keeps_its_precision_and_u_zero_keeps_the_only_token(monkeypatch) -> None:
    """Two equal logits of 100 at temperature 2e-5 (l / T = 5e6): each token half the
    time (scores taken from the maximum; from l / T itself float32 rounds them to 1/4
    nat and ties go to token 0: 44% against 50% was measured); and a seeded row whose
    only kept token draws U = 0 (seed 39,044,000 at step 0, token 9) still gets that
    token on both paths, not token 0. An empty batch gives an empty result."""
    logits = torch.full((20_000, 2), 100.0)
    states = [SamplingState(SamplingParams(temperature=2e-5), [0], [])] * 20_000
    monkeypatch.setattr(sampler_module, "FUSED_SAMPLING", True)
    share = float(Sampler(seed=1)(logits, states).sampled_token_ids.float().mean())
    assert abs(share - 0.5) < 5 * 0.5 / 20_000 ** 0.5, share
    row = torch.randn(1, 32000, generator=torch.Generator().manual_seed(0))
    row[0, 9] = 20.0
    for filters in ({"allowed_token_ids": [9]}, {"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        state = [SamplingState(SamplingParams(seed=39_044_000, **filters), [1], [])]
        c_path, torch_path = _both(row, state, monkeypatch)
        assert c_path.tolist() == torch_path.tolist() == [9], filters
    monkeypatch.setattr(sampler_module, "FUSED_SAMPLING", True)
    assert Sampler()(torch.empty(0, 10), []).sampled_token_ids.shape == (0,)
