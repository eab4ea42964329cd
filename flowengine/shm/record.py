"""Record format of the rings, and the memory-ordering contract that makes it lock-free.

A record is `[int64 payload length][payload, zero-padded to a multiple of 8 bytes]`,
so every header is an aligned int64. A record that does not fit before the end of the
buffer is preceded by a wrap marker (length -1) at the current position: the reader
jumps to the start of the next lap. The largest payload is capacity - 8 bytes (a
record that fills the whole buffer, written at the start of a lap).

NOTE: memory ordering. Publication is "copy the record, then store the write cursor";
consumption is "load the write cursor, then copy the record, then store the read
cursor". The per-record paths are C (_ring.c) with C11 atomics: the write cursor is
stored with release and loaded with acquire semantics, so a reader that sees the new
cursor sees the whole record, on any CPU; a read cursor is stored with release
semantics after the copies it frees. The rarer stores made from Python -- a wrap
marker and its cursor (RingWriter._try_send_slow), reader states at attach and detach
-- go through an int64 memoryview (`words[i] = v`), which CPython executes as one
aligned 8-byte store, and rely on x86-64 TSO: stores are not reordered with other
stores, loads not with other loads, stores not with earlier loads. On weakly ordered CPUs (ARM, POWER) those Python
stores would need fences too; this package does not provide them and must not be trusted
there. The cross-process checksum tests in tests/shm exercise the x86 guarantee.
"""

from __future__ import annotations

HEADER_BYTES = 8
WRAP = -1


def record_bytes(payload_bytes: int) -> int:
    """Bytes a record of `payload_bytes` occupies: header + payload rounded up to 8."""
    return (payload_bytes + 15) & -8
