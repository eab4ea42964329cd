"""Errors raised by the shared-memory rings and channels."""

from __future__ import annotations


class RingError(Exception):
    """Base class of every error raised by `flowengine.shm`."""


class RecordTooLargeError(RingError, ValueError):
    """A record can never fit in the ring: its payload exceeds `max_payload_bytes`.

    Raised at once by the writer instead of waiting for room that cannot appear.
    """


class ChannelClosedError(RingError):
    """The writing side closed the channel and every record sent before has been read."""


class ReaderDetachedError(RingError):
    """This reader was marked dead (by the writer or the supervisor) and must re-attach.

    The writer no longer waits for a dead reader, so the records it had not read may
    already be overwritten; the reader raises instead of returning them.
    """
