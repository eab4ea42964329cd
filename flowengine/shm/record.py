"""Record format of the rings, and the memory-ordering contract that makes it lock-free.

A record is `[int64 payload length][payload, zero-padded to a multiple of 8 bytes]`,
so every header is an aligned int64. A record that does not fit before the end of the
buffer is preceded by a wrap marker (length -1) at the current position: the reader
jumps to the start of the next lap. The largest payload is capacity - 8 bytes (a
record that fills the whole buffer, written at the start of a lap).

NOTE: memory ordering. Publication is "copy the record, then store the write cursor";
consumption is "load the write cursor, then copy the record, then store the read
cursor". Correctness relies on x86-64 TSO: stores are not reordered with other stores,
loads are not reordered with other loads, stores are not reordered with earlier loads,
and an aligned 8-byte store is atomic. So a reader that sees the new cursor sees the
whole record, and the writer never reuses bytes a reader is still copying. A cursor is
stored through an int64 memoryview (`words[i] = v`), which CPython executes as one
8-byte `memcpy` into an aligned slot, i.e. a single `mov`; `struct.pack_into("<q")`
would store byte by byte and could be read torn. The Python calls between the payload
copy and the cursor store are opaque to the C compiler, so it cannot reorder them.
On weakly ordered CPUs (ARM, POWER) this is NOT enough: the cursor store needs release
and the cursor load acquire semantics (a C extension with stdatomic, or a fence on
both sides); this package provides neither and must not be trusted there. The
cross-process checksum tests in tests/shm exercise the x86 guarantee.
"""

from __future__ import annotations

HEADER_BYTES = 8
WRAP = -1


def record_bytes(payload_bytes: int) -> int:
    """Bytes a record of `payload_bytes` occupies: header + payload rounded up to 8."""
    return (payload_bytes + 15) & -8
