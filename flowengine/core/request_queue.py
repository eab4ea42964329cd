"""Requests kept in scheduling-policy order (DESIGN.md §4).

The scheduler keeps both its RUNNING and WAITING sets in one order: the policy key.
Under "fcfs" the key is (arrival_time, admission sequence number); under "priority" it
is (priority, arrival_time, sequence number), lower first, vLLM's rule. Running
requests are served from the front; the preemption victim is the last running one.
A preempted request keeps its key, so it goes back ahead of every waiting request that
arrived after it (the front of the queue under FCFS).

Pure Python: this module must not import torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from flowengine.config import SchedulingPolicy
from flowengine.request import Request

PolicyKey = tuple[float, ...]


def policy_key(policy: SchedulingPolicy, request: Request, seq: int) -> PolicyKey:
    """Sort key of `request` under `policy`; `seq` (unique) breaks ties by admission."""
    if policy == "priority":
        return (request.priority, request.arrival_time, seq)
    return (request.arrival_time, seq)


class RequestQueue:
    """Requests sorted by a unique key; insert and remove are O(log n) search + O(n) move."""

    def __init__(self) -> None:
        self._keys: list[PolicyKey] = []
        self._requests: list[Request] = []

    def add(self, key: PolicyKey, request: Request) -> None:
        index = bisect.bisect_left(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)

    def remove(self, key: PolicyKey) -> Request:
        """Remove and return the request stored under `key`. Raises KeyError if absent."""
        index = bisect.bisect_left(self._keys, key)
        if index == len(self._keys) or self._keys[index] != key:
            raise KeyError(key)
        del self._keys[index]
        return self._requests.pop(index)

    def last(self) -> Request:
        """The request that sorts last (lowest priority). Raises IndexError when empty."""
        return self._requests[-1]

    @property
    def requests(self) -> list[Request]:
        """The queue's own list of requests, in order, for fast iteration by index.

        NOTE: read it, never change it; `remove` shrinks it in place, so a loop by index
        stays valid when it removes the request at or after its index.
        """
        return self._requests

    def snapshot(self) -> list[Request]:
        """The requests in order, as a copy that is safe to iterate while editing."""
        return list(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)
