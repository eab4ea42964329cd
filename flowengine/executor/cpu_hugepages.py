"""CPU weights and KV cache on transparent huge pages (issue #20).

A decode step of the default model streams its 96 MB of quantized weights from memory
once per token, spread over ~120 matmuls of 0.2-1 MB, and its attention reads K/V rows
scattered over the cache's blocks. On 4 KiB pages that is ~24,000 TLB entries a step
for the weights alone; on 2 MiB pages ~50. Linux gives anonymous memory huge pages where
`madvise(MADV_HUGEPAGE)` asks for them (the `madvise` setting of
/sys/kernel/mm/transparent_hugepage/enabled, the default of Debian, Ubuntu and most
distributions; `always` gives them without asking; `never` gives none, and then
nothing here changes anything but where the bytes live).

`HugePageArena` is one anonymous mapping, advised for huge pages, from which tensors
are cut at 64-byte boundaries (`torch.frombuffer` keeps the mapping alive as long as
any tensor cut from it). `rehome_module` moves every CPU tensor a model holds
(parameters, buffers, and tensors held by plain attributes such as QuantizedWeight's
planes) into one arena, in place (`Tensor.set_`, so every reference sees the new
memory; tensors that share a storage keep sharing it). `zeros` allocates the KV cache
from an arena: fresh anonymous pages are zero, and they are touched at once so the
memory is committed at start-up as `torch.zeros` commits it.

Measured (benchmarks/cpu_matmul_step.py --pages 4k,huge: the matmuls of one decode
step, the weights in one arena against torch's own allocations, alternated in one
process, 2-vCPU Zen 3, docs/benchmarks.md session 51): 0.91-0.97 of the time at 1 row
in six runs of 21 rounds, 0.96-0.99 at 4 rows, ~1.0 at 16 (compute-bound there); the
whole decode step showed no gain above that host's noise.

Opt-in, FLOWENGINE_CPU_HUGEPAGES=1, because of what it costs on some VMs: on that
guest, whose virtio balloon reports free memory to the host (VIRTIO_BALLOON_F_REPORTING:
free blocks of 2 MiB and up go back to the host, which faults them in again when the
guest touches them), the first touch of 1 GB of huge pages took 13 s against 0.8 s for
torch.zeros (later ones 1.5 s against 0.5-1.1): seconds of start-up per GB, more
than the matmuls gain there. On a host without that, it is worth turning on for a
memory-bound batch-1 decode.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes (x86-64 and arm64 with 4 KiB base pages)
_ALIGN = 64  # bytes: every tensor starts on a cache line


def thp_setting() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or
    "unknown" where /sys does not say."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def enabled() -> bool:
    """Whether CPU weights and KV caches go to huge-page arenas (Linux with
    MADV_HUGEPAGE, and FLOWENGINE_CPU_HUGEPAGES=1)."""
    return (hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("FLOWENGINE_CPU_HUGEPAGES", "0") == "1")


class HugePageArena:
    """One anonymous mapping of at least `nbytes` bytes, advised for huge pages, cut
    into tensors in order by `take`.

    Raises OSError if the mapping fails (out of address space or memory)."""

    def __init__(self, nbytes: int) -> None:
        # one spare huge page: the mapping need not start on a huge-page boundary, and
        # the advice is given for the aligned part
        size = (max(nbytes, 1) + 2 * HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        addr = self._bytes.data_ptr()
        self._off = (-addr) % HUGE_PAGE
        aligned = size - self._off - (size - self._off) % HUGE_PAGE
        if aligned > 0 and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE, self._off, aligned)
        self.size = size

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` bytes as a uint8 tensor (zeros if never written).

        Raises MemoryError when the arena has no room left."""
        off = self._off
        if off + nbytes > self.size:
            raise MemoryError(f"huge-page arena of {self.size} bytes has no room for "
                              f"{nbytes} more at {off}")
        self._off = off + padded_bytes(nbytes)
        return self._bytes[off:off + nbytes]


def padded_bytes(nbytes: int) -> int:
    """What `take(nbytes)` uses of an arena: nbytes rounded up to 64."""
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """One zeroed, contiguous CPU tensor per shape, of `dtype`, all from one huge-page
    arena (torch.zeros for each when `enabled()` is false). The pages are touched here
    (committed at start-up, as torch.zeros commits them)."""
    if not enabled():
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    sizes = [dtype.itemsize * torch.Size(s).numel() for s in shapes]
    arena = HugePageArena(sum(padded_bytes(n) for n in sizes))
    out = []
    for s, n in zip(shapes, sizes, strict=True):
        t = arena.take(n)
        t.zero_()  # commit the pages now (they read as zero either way)
        out.append(t.view(dtype).view(s))
    return out


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the module tree holds: its parameters and buffers, tensors in
    plain attributes of the modules, and tensors in the attributes of objects held
    there (QuantizedWeight's qs and scales)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(values) -> None:
        for v in values:
            if (isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_sparse
                    and id(v) not in seen):
                seen.add(id(v))
                found.append(v)

    for m in module.modules():
        visit(m._parameters.values())
        visit(m._buffers.values())
        plain = [v for k, v in vars(m).items() if not k.startswith("_")]
        visit(plain)
        for v in plain:
            if not isinstance(v, (torch.Tensor, nn.Module)) and hasattr(v, "__dict__"):
                visit(x for k, x in vars(v).items() if not k.startswith("_"))
    return found


@torch.no_grad()
def rehome_module(module: nn.Module, min_bytes: int = 1 << 20) -> int:
    """Move the module's CPU tensors into one huge-page arena, in place; returns the
    bytes moved (0 when `enabled()` is false or the tensors hold less than `min_bytes`:
    a small model gains nothing from it).

    Storages are moved whole, so views keep sharing memory (tied embeddings, the slices
    of a fused projection). Call before anything keeps a tensor's data_ptr."""
    if not enabled():
        return 0
    groups: dict[int, list[torch.Tensor]] = {}  # storage address -> its tensors
    sizes: dict[int, int] = {}
    for t in _module_tensors(module):
        s = t.untyped_storage()
        if s.nbytes() > 0:
            groups.setdefault(s.data_ptr(), []).append(t)
            sizes[s.data_ptr()] = s.nbytes()
    total = sum(padded_bytes(n) for n in sizes.values())
    if total < min_bytes:
        return 0
    arena = HugePageArena(total)
    # storage by storage, so that each old one is freed before the next is copied: the
    # peak is the weights plus one storage (the arena's pages are committed as written)
    while groups:
        ptr, tensors = groups.popitem()
        region = arena.take(sizes[ptr])
        region.copy_(torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage()))
        for t in tensors:
            base = region.view(t.dtype)
            t.set_(base.untyped_storage(), base.storage_offset() + t.storage_offset(),
                   t.size(), t.stride())
        del tensors, region
    logger.info("CPU weights (%.0f MB) moved to memory advised for huge pages "
                "(transparent_hugepage: %s)", total / 1e6, thp_setting())
    return total
