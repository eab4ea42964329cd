"""Persistent staging buffers: a step's integer inputs packed into one byte buffer.

Every integer input of a step (token ids, positions, slot mapping, ...) is a *region*
of one byte buffer. The host fills numpy views of the regions, then one copy moves the
used prefix of the buffer to the device, where torch views of the same regions are the
step's input tensors (DESIGN.md §6: persistent pinned host buffers, one non-blocking
copy per step).

On CUDA the host side is pinned memory, so the copy is asynchronous, and there are two
host buffers used in turn: with two steps in flight, step N+1 is filled while step N's
copy may still wait in the stream behind step N-1's kernels. Before a host buffer is
refilled, the event recorded after its last copy is waited on. On the CPU the host
buffer *is* the device buffer and nothing is copied.
"""

from __future__ import annotations

import numpy as np
import torch

# One region: (numpy dtype, torch dtype of the same width, number of elements).
Region = tuple[type[np.generic], torch.dtype, int]

ALIGN_BYTES = 8


def buffer_layout(regions: dict[str, Region]) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte (offset, size) of each region in insertion order, each offset a multiple
    of ALIGN_BYTES (so every view is aligned for its dtype), and the total size."""
    offsets: dict[str, tuple[int, int]] = {}
    total = 0
    for name, (np_dtype, _, count) in regions.items():
        nbytes = count * np.dtype(np_dtype).itemsize
        offsets[name] = (total, nbytes)
        total += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, total


class StagingBuffers:
    """Host and device views of packed regions.

    Args:
        regions: name -> (numpy dtype, torch dtype, count), laid out in this order; put
            the largest, partly used region last so that copies can stop early.
        device: where the device views live.
        num_host: host buffers used in turn (default 2 on CUDA, 1 elsewhere, where the
            only host buffer is the device buffer; 2 on the CPU copies as CUDA does,
            for tests).

    Attributes:
        np: numpy views of the host buffer being filled (see `next_host`).
        dev: torch views of the device buffer (the same object as the host buffer on
            the CPU).
        offsets: name -> (byte offset, byte size).
    """

    def __init__(self, regions: dict[str, Region], device: torch.device,
                 num_host: int | None = None) -> None:
        self.device = device
        self.offsets, self.total_bytes = buffer_layout(regions)
        is_cuda = device.type == "cuda"
        if num_host is None:
            num_host = 2 if is_cuda else 1
        self._hosts = [torch.zeros(self.total_bytes, dtype=torch.uint8, pin_memory=is_cuda)
                       for _ in range(num_host)]
        self._copy_done: list[torch.cuda.Event | None] = [None] * num_host
        self._dev = (self._hosts[0] if device.type == "cpu" and num_host == 1 else
                     torch.empty(self.total_bytes, dtype=torch.uint8, device=device))
        self._host_views = [self._views_np(h.numpy(), regions) for h in self._hosts]
        self.dev: dict[str, torch.Tensor] = {
            name: self._dev[start:start + nbytes].view(torch_dtype)
            for name, (start, nbytes), (_, torch_dtype, _) in zip(
                self.offsets, self.offsets.values(), regions.values(), strict=True)
        }
        self._turn = 0
        self.np = self._host_views[0]

    def _views_np(self, host: np.ndarray, regions: dict[str, Region]) -> dict[str, np.ndarray]:
        return {name: host[start:start + nbytes].view(np_dtype)
                for name, (start, nbytes), (np_dtype, _, _) in zip(
                    self.offsets, self.offsets.values(), regions.values(), strict=True)}

    @property
    def num_host(self) -> int:
        """How many host buffers are used in turn (2 on CUDA, 1 on the CPU)."""
        return len(self._hosts)

    @property
    def turn(self) -> int:
        """Index of the host buffer being filled, in [0, num_host)."""
        return self._turn

    def next_host(self) -> dict[str, np.ndarray]:
        """Switch to the next host buffer, wait until its previous copy has left it,
        and return (and set as `np`) its region views."""
        self._turn = (self._turn + 1) % len(self._hosts)
        done = self._copy_done[self._turn]
        if done is not None:
            done.synchronize()
            self._copy_done[self._turn] = None
        self.np = self._host_views[self._turn]
        return self.np

    def copy_to_device(self, num_bytes: int) -> None:
        """Copy the first `num_bytes` of the current host buffer to the device buffer:
        one non-blocking copy on the current stream (nothing on the CPU)."""
        if self._dev is self._hosts[self._turn]:
            return
        host = self._hosts[self._turn]
        self._dev[:num_bytes].copy_(host[:num_bytes], non_blocking=True)
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._copy_done[self._turn] = done

    def host_tensor(self, name: str, count: int) -> torch.Tensor:
        """A torch view of the first `count` elements of a host region (no copy)."""
        return torch.from_numpy(self.np[name][:count])
