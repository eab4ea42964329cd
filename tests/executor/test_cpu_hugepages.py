"""executor/cpu_hugepages.py: tensors moved into a huge-page arena keep their values,
sharing and identity; the KV cache's zeros; the opt-in switch (off by default)."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from flowengine.executor import cpu_hugepages as hp

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="no MADV_HUGEPAGE on this platform")


@pytest.fixture(autouse=True)
def _opted_in(monkeypatch) -> None:
    monkeypatch.setenv("FLOWENGINE_CPU_HUGEPAGES", "1")


def _advised(ptr: int) -> bool:
    """Whether the mapping holding address `ptr` carries MADV_HUGEPAGE ("hg" in its
    VmFlags): what the arena asks for, whether or not the kernel grants huge pages."""
    current = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= ptr < hi
        elif head == "VmFlags:" and current:
            return "hg" in line.split()[1:]
    return False


class _Planes:
    """Stands for QuantizedWeight: tensors in plain attributes of a plain object."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.qs = torch.randint(0, 256, (4096, 288), dtype=torch.uint8, generator=g)
        self.scales = torch.randn(4096, 36, generator=g).half()


def _model() -> tuple[nn.Module, _Planes, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Embedding(1000, 512))
    m[1].weight = m[0].weight  # tied, as the default model's embedding and LM head
    m[0].register_buffer("table", torch.randn(64, 32))
    planes = _Planes()
    m[1].planes = planes
    m[2].rows = planes.qs[100:164]  # a view into another tensor's storage
    return m, planes, m[2].rows


def test_rehome_moves_in_place_keeping_values_and_sharing() -> None:
    m, planes, rows = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    qs, scales = planes.qs.clone(), planes.scales.clone()
    old_ptrs = {planes.qs.data_ptr(), m[0].weight.data_ptr(), m[2].weight.data_ptr()}
    x = torch.randn(3, 512)
    y = m[1](m[0](x))

    moved = hp.rehome_module(m)

    assert moved >= planes.qs.numel() + 2 * 4096 * 36 + 4 * (512 * 512 + 1000 * 512)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(planes.qs, qs) and torch.equal(planes.scales, scales)
    assert isinstance(m[0].weight, nn.Parameter) and m[1].weight is m[0].weight
    # views still alias their base: 100 rows of 288 bytes in
    assert rows.data_ptr() == planes.qs.data_ptr() + 100 * 288
    assert torch.equal(rows, qs[100:164])
    for t in (planes.qs, planes.scales, m[0].weight, m[0].table, m[2].weight):
        assert t.data_ptr() not in old_ptrs and t.data_ptr() % 64 == 0
        assert _advised(t.data_ptr())
    assert torch.equal(m[1](m[0](x)), y)


@pytest.mark.parametrize("setting", [None, "0"])
def test_rehome_leaves_small_modules_and_is_off_by_default(monkeypatch, setting) -> None:
    small = nn.Linear(8, 8)
    ptr = small.weight.data_ptr()
    assert hp.enabled() and hp.rehome_module(small) == 0 and small.weight.data_ptr() == ptr
    m, planes, _ = _model()
    ptr = planes.qs.data_ptr()
    if setting is None:
        monkeypatch.delenv("FLOWENGINE_CPU_HUGEPAGES")
    else:
        monkeypatch.setenv("FLOWENGINE_CPU_HUGEPAGES", setting)
    assert not hp.enabled()
    assert hp.rehome_module(m) == 0 and planes.qs.data_ptr() == ptr
    caches = hp.zeros([(2, 4, 3)], torch.float32)
    assert caches[0].shape == (2, 4, 3) and not caches[0].any()
    assert not _advised(caches[0].data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_are_zero_contiguous_and_disjoint(dtype) -> None:
    shapes = [(2, 37, 16, 3, 64), (2, 37, 16, 3, 64), (5,)]
    caches = hp.zeros(shapes, dtype)
    assert [tuple(c.shape) for c in caches] == shapes
    assert all(c.dtype == dtype and c.is_contiguous() for c in caches)
    assert all(not c.float().any() for c in caches)
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in caches)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    assert _advised(caches[0].data_ptr())
    caches[0].fill_(1)  # writable, and writing one leaves the others zero
    assert not caches[1].float().any()


def test_arena_bounds() -> None:
    arena = hp.HugePageArena(100)
    assert arena.size % hp.HUGE_PAGE == 0 and arena.size >= 100 + hp.HUGE_PAGE
    a = arena.take(10)
    b = arena.take(10)
    assert b.data_ptr() - a.data_ptr() == 64
    with pytest.raises(MemoryError, match="no room"):
        arena.take(arena.size)


def test_the_cpu_model_runner_puts_weights_and_kv_cache_there(default_model_path) -> None:
    from flowengine.config import CacheConfig
    from flowengine.executor.model_runner import ModelRunner
    from flowengine.model.model_config import ModelConfig

    config = ModelConfig.from_pretrained(default_model_path, max_model_len=256)
    runner = ModelRunner(config, CacheConfig(16, 8), torch.device("cpu"), torch.float32)
    assert len(runner.kv_caches) == 30
    assert all(_advised(c.data_ptr()) and not c.any() for c in runner.kv_caches)
    model = runner.model.model
    assert _advised(model.layers[0].self_attn.qkv_proj.weight.data_ptr())
    assert _advised(model.embed_tokens.weight.data_ptr())
