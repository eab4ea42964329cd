"""Typed channels: msgspec Structs over a ring end, and the interface both channel kinds share.

Messages are encoded with `msgspec.msgpack` against the declared type: decoding
validates the message and can only ever build plain data (no pickle anywhere: a peer
that can write a ring must not be able to run code in the reader).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from flowengine.shm.reader import RingReader
from flowengine.shm.writer import RingWriter

T = TypeVar("T")


class MessageChannel(Protocol[T]):
    """What an actor needs from a channel; `Channel` and `InprocChannel` both provide it.

    Errors: ChannelClosedError (peer closed and drained, or send after close),
    TimeoutError (timeout_s elapsed), RecordTooLargeError (encoded message too large).
    """

    def send(self, msg: T, timeout_s: float | None = None) -> None: ...
    def try_send(self, msg: T) -> bool: ...
    async def send_async(self, msg: T) -> None: ...
    def recv(self, timeout_s: float | None = None) -> T: ...
    def try_recv(self) -> T | None: ...
    async def recv_async(self) -> T: ...
    def close(self) -> None: ...


class Channel(Generic[T]):
    """One end of a ring carrying messages of `msg_type` (a Struct or a union of Structs).

    Args:
        ring: a RingWriter/BroadcastWriter (sending end) or RingReader (receiving end).
        msg_type: the decoded type, e.g. `StepPlan` or `NewRequest | AbortRequest`.

    Receiving takes every record published so far in one `RingReader.recv_many` call
    and hands them out one per call, so a burst costs one ring read, not one per
    message. Sending encodes into one reused buffer (`Encoder.encode_into`).
    Raises (at use): TypeError when receiving on a writer or sending on a reader;
    msgspec.ValidationError / DecodeError if a peer sent bytes of another schema.
    """

    def __init__(self, ring: RingWriter | RingReader, msg_type: type[T] | Any) -> None:
        self.ring = ring
        self.msg_type = msg_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)
        # Reused for every send that finds room at once: the ring copies it before
        # returning, so no bytes object is allocated per message.
        self._buf = bytearray()
        # Records already taken off the ring by one `recv_many`, not yet decoded: one
        # ring read serves a burst of messages (decoded one by one, so an invalid
        # message fails at its own turn).
        self._received: deque[bytes] = deque()

    def _writer(self) -> RingWriter:
        if not isinstance(self.ring, RingWriter):
            raise TypeError(f"channel over {self.ring.name} is its receiving end; it cannot send")
        return self.ring

    def _reader(self) -> RingReader:
        if not isinstance(self.ring, RingReader):
            raise TypeError(f"channel over {self.ring.name} is its sending end; it cannot receive")
        return self.ring

    def send(self, msg: T, timeout_s: float | None = None) -> None:
        """Encode and send, waiting while the ring is full (see RingWriter.send)."""
        writer = self._writer()
        self._encoder.encode_into(msg, self._buf)
        writer.send(self._buf, timeout_s)

    def try_send(self, msg: T) -> bool:
        """Encode and send if there is room now; False if the ring is full."""
        writer = self._writer()
        self._encoder.encode_into(msg, self._buf)
        return writer.try_send(self._buf)

    async def send_async(self, msg: T) -> None:
        """Encode and send without blocking the event loop."""
        writer = self._writer()
        self._encoder.encode_into(msg, self._buf)
        if not writer.try_send(self._buf):
            # Waiting may suspend us, and another task may send meanwhile: wait with a
            # copy of our own.
            await writer.send_async(bytes(self._buf))

    def recv(self, timeout_s: float | None = None) -> T:
        """Receive and decode the next message (see RingReader.recv for errors)."""
        received = self._received
        if not received:
            received.extend(self._reader().recv_many(timeout_s))
        return self._decoder.decode(received.popleft())

    def try_recv(self) -> T | None:
        """The next message, or None if none is waiting."""
        received = self._received
        if not received:
            received.extend(self._reader().try_recv_many())
            if not received:
                return None
        return self._decoder.decode(received.popleft())

    async def recv_async(self) -> T:
        """Receive and decode without blocking the event loop; cancellable (a cancelled
        call consumes nothing)."""
        received = self._received
        if not received:
            received.extend(await self._reader().recv_many_async())
        return self._decoder.decode(received.popleft())

    def close(self) -> None:
        """Close the ring end (a writer marks the ring closed for its readers)."""
        self.ring.close()
