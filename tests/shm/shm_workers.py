"""Code that runs in spawned processes for the ring tests, and the checked record format.

A test record is `[seq u64][body length u32][crc32 u32][body]`; the body is a slice of
a fixed random pool that depends on seq, and the CRC is seeded with seq. A reader that
saw half a record, a stale record, or a record twice fails the check.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import secrets
import struct
import time
import zlib
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from flowengine.shm import (
    Channel,
    ChannelClosedError,
    RingReader,
    RingSegment,
    RingWriter,
)
from flowengine.shm.segment import SHM_DIR

# Every ring of a test session is named /fe-<SESSION_TAG>x<n>-<ring>, so the leak check
# (conftest.py) only looks at our own names: other test runs on the machine (other
# engineers, CI shards) cannot make it fail. Spawned children draw their own tag and
# never use it.
SESSION_TAG = "t" + secrets.token_hex(3)

_HEAD = struct.Struct("<QII")
_POOL = random.Random(1234).randbytes(1 << 17)
MAX_BODY_BYTES = 1 << 16


def session_entries() -> list[str]:
    """Entries of /dev/shm (segments and semaphores) created by this test session."""
    prefixes = (f"fe-{SESSION_TAG}", f"sem.fe-{SESSION_TAG}")
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(prefixes))


def make_record(seq: int, body_bytes: int) -> bytes:
    """A checked record of `body_bytes` (<= 65536) whose content depends on `seq`."""
    start = (seq * 7919) % (len(_POOL) - MAX_BODY_BYTES)
    body = _POOL[start : start + body_bytes]
    return _HEAD.pack(seq, body_bytes, zlib.crc32(body, seq & 0xFFFFFFFF)) + body


def check_record(data: bytes, expected_seq: int | None) -> int:
    """Verify a record; return its seq. Raises AssertionError with what was wrong."""
    seq, body_bytes, crc = _HEAD.unpack_from(data)
    if expected_seq is not None and seq != expected_seq:
        raise AssertionError(f"expected seq {expected_seq}, got {seq}")
    if body_bytes != len(data) - _HEAD.size:
        raise AssertionError(f"seq {seq}: length field {body_bytes}, got {len(data) - _HEAD.size}")
    if zlib.crc32(memoryview(data)[_HEAD.size :], seq & 0xFFFFFFFF) != crc:
        raise AssertionError(f"seq {seq}: checksum mismatch (torn or overwritten record)")
    return seq


def verify_reader(
    name: str,
    reader_index: int,
    conn: Connection,
    stall_after: int | None = None,
    sleep_every: int = 0,
    batched: bool = False,
) -> None:
    """Read checked records until the writer closes; report ("ok", count, first, last).

    batched: read with `recv_many` (every published record per call, as the engine's
    channels do) instead of `recv`.
    stall_after: after that many records report ("stalled", n) and hang (to be killed).
    sleep_every: sleep 1 ms every that many records (a slow reader: backpressure).
    The first record may have any seq (a re-attached reader); after it, seqs must be
    consecutive. Errors are reported as ("error", message).
    """
    try:
        reader = RingReader.attach(name, reader_index)
        conn.send(("attached", reader_index))
        count, first, expected = 0, None, None
        while True:
            try:
                batch = reader.recv_many(60) if batched else [reader.recv(timeout_s=60)]
            except ChannelClosedError:
                break
            for data in batch:
                seq = check_record(data, expected)
                first = seq if first is None else first
                expected = seq + 1
                count += 1
                if stall_after is not None and count == stall_after:
                    conn.send(("stalled", count))
                    time.sleep(3600)
                if sleep_every and count % sleep_every == 0:
                    time.sleep(0.001)
        reader.close()
        conn.send(("ok", count, first, None if expected is None else expected - 1))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def run_reader(name: str, reader_index: int = 0, **kwargs: object) -> tuple[Any, Connection]:
    """Start verify_reader in a spawned process once attached; return (process, pipe end)."""
    ours, theirs = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(
        target=verify_reader, args=(name, reader_index, theirs), kwargs=kwargs
    )
    process.start()
    assert ours.poll(60), "reader process did not start"
    assert ours.recv() == ("attached", reader_index)
    return process, ours


def finish(process: Any, conn: Connection) -> tuple:
    """The reader's final report, after it exited cleanly."""
    assert conn.poll(120), "reader process did not report"
    result = conn.recv()
    process.join(30)
    assert process.exitcode == 0, process.exitcode
    return result


def create_and_vanish(ring_name: str, run_id: str, conn: Connection, clean_exit: bool) -> None:
    """Create a segment, report its name, then exit: cleanly (atexit runs) or like a crash."""
    segment = RingSegment.create(ring_name, capacity_bytes=4096, run_id=run_id)
    conn.send(segment.name)
    if clean_exit:
        return  # the interpreter exits normally: the owner's atexit hook must unlink
    os._exit(0)  # no atexit, no finally: what SIGKILL leaves behind


class Ping(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A test message shaped like the engine's: ids, tokens, optional fields."""

    seq: int
    token_ids: list[int]
    text: str = ""
    logprob: float | None = None


class Summary(msgspec.Struct, array_like=True, gc=False):
    count: int
    token_sum: int
    last_text: str


def sum_pings(in_name: str, out_name: str) -> None:
    """Receive Pings until closed; answer one Summary on the other ring."""
    inbox = Channel(RingReader.attach(in_name), Ping)
    outbox = Channel(RingWriter.attach(out_name), Summary)
    count = token_sum = 0
    last_text = ""
    while True:
        try:
            ping = inbox.recv(timeout_s=60)
        except ChannelClosedError:
            break
        assert ping.seq == count, (ping.seq, count)
        count += 1
        token_sum += sum(ping.token_ids)
        last_text = ping.text
    outbox.send(Summary(count, token_sum, last_text))
    outbox.close()
    inbox.close()


def claim_and_release(name: str, duration_s: float, conn: Connection) -> None:
    """Attach to reader slot 0 and detach again, as fast as possible, for `duration_s`;
    send back how many attachments were made (the slot-lock race test)."""
    segment = RingSegment.attach(name)
    n = 0
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            reader = RingReader(segment)
            n += 1
            reader.close()
    finally:
        segment.close()
    conn.send(n)
