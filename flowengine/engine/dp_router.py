"""Data-parallel routing: which engine replica serves a request (issue #18).

Pure logic, no asyncio and no processes: `flowengine/engine/dp_client.py` wraps it.

Load of a replica: the requests it holds unfinished as the frontend counts them (sent
and not yet finished or aborted: its waiting + running + those on their way), or the
waiting + running of the replica's last reported `SchedulerStats` when that is higher
(stats lag a step behind, the frontend's count never does). Ties go to the replica with
the lower KV cache usage, then the lower index.

Prefix affinity: the frontend keeps a bounded LRU map from chained hashes of a
prompt's full leading blocks (`block_size` tokens each, at most `max_prefix_blocks`) to
the replica last sent that prefix. A replica that is restarting gets no new request
while another live replica is not restarting. A request whose prefix is held by a
replica goes
there, unless that replica's load exceeds the least loaded one's by more than
`max_imbalance` requests (so one hot prefix cannot pile all work on one replica). The
map only approximates the replicas' prefix caches (it does not see evictions); a wrong
guess costs a cache miss, never a wrong result.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from flowengine.messages import SchedulerStats


@dataclass
class ReplicaLoad:
    """What the router knows of one replica."""

    num_unfinished: int = 0  # sent by this frontend, not finished/aborted
    num_waiting: int = 0  # last reported
    num_running: int = 0  # last reported
    kv_cache_usage: float = 0.0  # last reported, 0..1
    is_alive: bool = True
    is_paused: bool = False  # restarting: new requests go elsewhere while others serve
    num_routed_total: int = 0  # requests ever sent to it (tests, benchmarks)

    @property
    def load(self) -> int:
        return max(self.num_unfinished, self.num_waiting + self.num_running)


class NoLiveReplicaError(RuntimeError):
    """Every replica is down for good."""


class DPRouter:
    """Picks a replica per request and tracks which replica holds which request.

    Args:
        num_replicas: data_parallel_size (>= 1).
        block_size: KV block size in tokens (the prefix hash granularity).
        max_prefix_blocks: leading blocks hashed per prompt (0 turns affinity off).
        max_prefix_entries: size of the prefix map (LRU).
        max_imbalance: how many more requests than the least loaded replica the
            prefix's replica may hold and still get the request.
    Raises ValueError for num_replicas < 1 or block_size < 1.
    """

    def __init__(self, num_replicas: int, block_size: int = 16, *,
                 max_prefix_blocks: int = 8, max_prefix_entries: int = 16384,
                 max_imbalance: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_prefix_entries = max_prefix_entries
        self.max_imbalance = max_imbalance
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._prefix: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> replica

    # ------------------------------------------------------------------ routing
    def prefix_hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """Chained hashes of the full leading blocks (block i's hash covers blocks
        0..i, and the cache salt: salted prompts share no prefix with others)."""
        hashes: list[int] = []
        parent = hash(salt)
        num_blocks = min(len(token_ids) // self.block_size, self.max_prefix_blocks)
        for i in range(num_blocks):
            block = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, block))
            hashes.append(parent)
        return hashes

    def route(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Pick the replica for a new request, record it, and return its index.

        A request id already routed (a resubmission) keeps its replica while that
        replica is alive. Raises NoLiveReplicaError when no replica is alive.
        """
        known = self._owner.get(request_id)
        if known is not None and self.replicas[known].is_alive:
            return known
        live = [i for i, r in enumerate(self.replicas) if r.is_alive]
        if not live:
            raise NoLiveReplicaError("every data-parallel replica is down")
        # A restarting replica gets new work only when every live one is restarting.
        live = [i for i in live if not self.replicas[i].is_paused] or live
        least = min(live, key=self._key)
        chosen = least
        hashes = self.prefix_hashes(token_ids, salt)
        # Longest held prefix first: the deepest block hash that maps to a live replica.
        for h in reversed(hashes):
            holder = self._prefix.get(h)
            if holder is not None and holder in live:
                if self.replicas[holder].load - self.replicas[least].load <= self.max_imbalance:
                    chosen = holder
                break
        for h in hashes:
            self._prefix[h] = chosen
            self._prefix.move_to_end(h)
        while len(self._prefix) > self.max_prefix_entries:
            self._prefix.popitem(last=False)
        if known is not None:
            self.replicas[known].num_unfinished -= 1
        self._owner[request_id] = chosen
        replica = self.replicas[chosen]
        replica.num_unfinished += 1
        replica.num_routed_total += 1
        return chosen

    def _key(self, i: int) -> tuple[int, float, int]:
        r = self.replicas[i]
        return (r.load, r.kv_cache_usage, i)

    # ------------------------------------------------------------------ bookkeeping
    def owner(self, request_id: str) -> int | None:
        """The replica holding the request, or None (finished, aborted, unknown)."""
        return self._owner.get(request_id)

    def finish(self, request_id: str) -> int | None:
        """The request finished or was aborted: forget it. Returns its replica."""
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.replicas[i].num_unfinished -= 1
        return i

    def request_ids_of(self, replica: int) -> set[str]:
        """Ids of the unfinished requests held by `replica`."""
        return {rid for rid, i in self._owner.items() if i == replica}

    def set_paused(self, replica: int, is_paused: bool) -> None:
        """A replica restarting (paused) keeps its requests but gets no new ones while
        another live replica is not paused."""
        self.replicas[replica].is_paused = is_paused

    def update_stats(self, replica: int, stats: SchedulerStats) -> None:
        r = self.replicas[replica]
        r.num_waiting, r.num_running = stats.num_waiting, stats.num_running
        r.kv_cache_usage = stats.kv_cache_usage

    def mark_dead(self, replica: int) -> set[str]:
        """The replica is down for good: no new request goes there, and its prefixes
        are forgotten. Returns the ids it held (to resubmit elsewhere: `route` picks a
        live replica for them)."""
        r = self.replicas[replica]
        r.is_alive = False
        r.num_waiting = r.num_running = 0
        for h in [h for h, i in self._prefix.items() if i == replica]:
            del self._prefix[h]
        return self.request_ids_of(replica)

    @property
    def num_alive(self) -> int:
        return sum(r.is_alive for r in self.replicas)
