"""Which API server process each request came from (`flowengine serve --api-server-count`).

Pure logic, no asyncio and no processes: `flowengine/actors/clients.py` wraps it around
the engine process's rings.

With N API server processes (clients), each has its own "requests" ring into the engine
process and its own "outputs" ring back (vLLM's `--api-server-count`: one engine core,
several frontends, each with its own socket to it). The engine core knows nothing of
them: the router records the client of every `NewRequest` it passes on and splits each
step's deltas by it. A request's entry ends with its finishing delta (every way a live
request ends gives one: stop, length, abort, error).

Rules, per client message:
- `NewRequest`: passed on and owned by its client. An id that another client's live
  request holds is refused with an "error" delta to the sender only (ids are uuid4 hex
  in every route, so this does not happen unless a caller picks its own ids).
- `AbortRequest`: only the sender's own ids pass (no client can abort another's).
- `ClientStart`: a client process started (a restarted one after a crash): every
  request the previous process of that index left in the engine is aborted.
"""

from __future__ import annotations

from collections.abc import Callable

from flowengine.messages import AbortRequest, ClientStart, NewRequest, RequestDelta, Shutdown


class ClientRouter:
    """Request ownership by client index, and the split of outputs by it.

    Args:
        num_clients: API server processes (>= 1); client 0 is the one that owns the
            engine (its supervisor, the Shutdown).
        is_live: whether the engine holds an unfinished request of this id.

    Raises ValueError when num_clients < 1.
    """

    def __init__(self, num_clients: int, is_live: Callable[[str], bool]) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.num_clients = num_clients
        self._is_live = is_live
        self._owner: dict[str, int] = {}

    def __len__(self) -> int:
        """Requests with an owner (sent and not yet finished)."""
        return len(self._owner)

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def admit(
        self, client: int, msg: NewRequest | AbortRequest | ClientStart | Shutdown
    ) -> tuple[NewRequest | AbortRequest | Shutdown | None, RequestDelta | None]:
        """What of `client`'s message reaches the engine core (None: nothing), and an
        error delta for `client` itself when its request is refused.

        Raises ValueError for a client index out of range or a Shutdown from a client
        other than 0."""
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} out of range [0, {self.num_clients})")
        if isinstance(msg, NewRequest):
            rid = msg.request_id
            owner = self._owner.get(rid)
            if owner is not None and owner != client and self._is_live(rid):
                return None, RequestDelta(
                    rid, [], finish_reason="error",
                    error=f"request id {rid!r} is in use by another API server process")
            self._owner[rid] = client
            return msg, None
        if isinstance(msg, AbortRequest):
            own = [rid for rid in msg.request_ids if self._owner.get(rid) == client]
            return (AbortRequest(own) if own else None), None
        if isinstance(msg, ClientStart):
            left = [rid for rid, owner in self._owner.items() if owner == client]
            return (AbortRequest(left) if left else None), None
        if client != 0:
            raise ValueError(f"{type(msg).__name__} from API server {client}; only 0 may stop "
                             "the engine")
        return msg, None

    def split(self, deltas: list[RequestDelta]) -> list[list[RequestDelta]]:
        """`deltas` by owning client (one list per client, in order); a request's entry
        ends with its finishing delta. A delta of an unknown id goes to client 0."""
        per_client: list[list[RequestDelta]] = [[] for _ in range(self.num_clients)]
        owner_of = self._owner
        for delta in deltas:
            if delta.finish_reason is None:
                per_client[owner_of.get(delta.req_id, 0)].append(delta)
            else:
                per_client[owner_of.pop(delta.req_id, 0)].append(delta)
        return per_client
