"""Which engine replica a request goes to, on Ray Serve.

Each replica keeps its own prefix cache, so a request whose prompt starts like one a replica
has served (a shared system prompt, a conversation's next turn) is cheapest there: its leading
blocks are not computed again. :class:`PrefixAwareRouter` keeps an approximate map of the block
hashes each replica was sent, keyed as the paged KV cache keys them, and prefers the replica
holding the longest run of the prompt's leading blocks, unless the replicas' loads are uneven.
:class:`RoundRobinRouter` is the cache-blind baseline; Ray Serve's default (power of two
choices) is the other.

Routers run inside each caller's deployment handle (the ingress), on its event loop: they make
no remote calls and own no actors, so nothing outlives ``serve.shutdown``.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fastdraft.engine.block_manager import prefix_block_hashes

# The request's prompt token ids inside a pending ``generate(requests)`` call: the call's first
# argument is the list of (prompt token ids, sampling params, request id) of its choices.
_PROMPT_ARG = 0

# Requests whose prompt hashes the prefix router keeps while they wait to be routed.
MAX_PENDING = 4096

ROUTERS = {"pow2": None, "round-robin": "fastdraft.server.ray_routing:RoundRobinRouter",
           "prefix": "fastdraft.server.ray_routing:PrefixAwareRouter"}


def _prompt_token_ids(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    requests = pending_request.args[_PROMPT_ARG]
    return list(requests[0][0]) if requests else []


class RoundRobinRouter(RequestRouter):
    """Replicas in turn, whatever the request; a full replica passes its turn to the next."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[ordered[start]], ordered[start + 1:] + ordered[:start]]


class PrefixAwareRouter(RequestRouter):
    """Sends a request to the replica most likely to hold its prompt's leading blocks.

    For each replica the router remembers the block hashes of the prompts it sent there, least
    recently sent evicted first once the replica's KV cache (``num_blocks`` from its routing
    stats) could not hold more: an estimate, since the router cannot see evictions. Prompts are
    keyed by the replicas' block size (their routing stats; ``block_size`` until they report).

    * **Loads uneven** (ongoing requests differ by more than ``imbalance_abs`` and the busiest
      replica has more than ``imbalance_rel`` times the idlest's): power of two choices, as Ray's
      default router. Both conditions, as SGLang's cache-aware router: a ratio alone would trip
      on 1 request against 2, and a replica's batch absorbs a few more requests at almost no
      cost (a decode step's time barely grows with its batch), so that only a difference of
      about a batch's worth is worth a cache miss.
    * **Otherwise**, the replicas holding the longest run of the prompt's leading blocks; when
      that run is under ``min_match`` of the prompt's full blocks (nothing worth keeping
      together), the least loaded replicas, fewest remembered blocks first, so that new prefixes
      spread over the caches.

    A replica that cannot take the request (full) hands it to the next rank: the others by load.
    """

    def initialize_state(self, block_size: int = 16, imbalance_abs: int = 8, imbalance_rel: float = 1.5,
                         min_match: float = 0.1, default_num_blocks: int = 4096) -> None:
        if block_size < 1 or imbalance_abs < 0 or imbalance_rel < 1 or not 0 <= min_match <= 1:
            raise ValueError("block_size >= 1, imbalance_abs >= 0, imbalance_rel >= 1 and 0 <= min_match <= 1")
        self._block_size = block_size
        self._imbalance_abs = imbalance_abs
        self._imbalance_rel = imbalance_rel
        self._min_match = min_match
        self._default_num_blocks = default_num_blocks
        self._held: dict[ReplicaID, OrderedDict[bytes, None]] = {}  # replica -> block hashes, least recent first
        self._hashes: dict[str, list[bytes]] = {}  # pending request id -> its prompt's block hashes

    def _replicas_block_size(self) -> int:
        for replica in self.curr_replicas.values():
            if "block_size" in replica.routing_stats:
                return int(replica.routing_stats["block_size"])
        return self._block_size

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None:
            return []
        request_id = pending_request.metadata.internal_request_id
        hashes = self._hashes.get(request_id)
        if hashes is None:
            hashes = list(prefix_block_hashes(_prompt_token_ids(pending_request), self._replicas_block_size()))
            self._hashes[request_id] = hashes
            while len(self._hashes) > MAX_PENDING:  # requests cancelled before they were routed
                del self._hashes[next(iter(self._hashes))]
        return hashes

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _num_matched(self, replica: RunningReplica, hashes: list[bytes]) -> int:
        held = self._held.get(replica.replica_id)
        if not held:
            return 0
        return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def _is_imbalanced(self, loads: list[int]) -> bool:
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self._imbalance_abs and busiest > self._imbalance_rel * idlest

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._prompt_hashes(pending_request)
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: (loads[r.replica_id], random.random()))
        if len(candidate_replicas) > 1 and self._is_imbalanced(list(loads.values())):
            return [sorted(random.sample(candidate_replicas, 2), key=lambda r: loads[r.replica_id])]
        matched = {r.replica_id: self._num_matched(r, hashes) for r in candidate_replicas}
        best = max(matched.values())
        if hashes and best >= max(1, self._min_match * len(hashes)):
            first = [r for r in by_load if matched[r.replica_id] == best]
        else:
            least = loads[by_load[0].replica_id]
            first = sorted((r for r in by_load if loads[r.replica_id] == least),
                           key=lambda r: len(self._held.get(r.replica_id, ())))[:1]
        return [first, [r for r in by_load if r not in first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self._prompt_hashes(pending_request)
        self._hashes.pop(pending_request.metadata.internal_request_id, None)  # routed: no longer pending
        held = self._held.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        replica = self.curr_replicas.get(replica_id)
        stats = replica.routing_stats if replica is not None else {}
        capacity = int(stats.get("num_blocks", self._default_num_blocks))
        while len(held) > capacity:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._held if r not in alive]:
            del self._held[replica_id]
