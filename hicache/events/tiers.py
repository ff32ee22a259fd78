"""Tier changes as KV events: the controller's L1/L2 changes and this group's L3 writes, each
page named by its chain hash (the hash ``hicache.l3.keys`` keys L3 with, the scope mixed in),
collected per step and published as one batch at the step's end.

- ``BlockStored``: pages arriving in a tier, with their parent page's hash (None for a chain's
  first page), their token ids, ``block_size`` = page tokens and the tier's medium. Where a
  scope enters the chain (its first scoped page), ``extra_keys`` holds the scope's public digest
  (``hicache.scope.public_digest``) for that page and None for the others; the scope itself
  never leaves.
- ``BlockRemoved``: pages leaving a tier (L1 eviction or demotion, L2 eviction, an L3 purge;
  an L3 page the store evicted or another process purged, once a lookup finds it missing).
- ``AllBlocksCleared``: a cache that starts, or closes, holding nothing in L1 and L2.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from hicache.events import wire
from hicache.ids import TOKEN
from hicache.l3.keys import CHAIN_SEED, chain_on
from hicache.scope import mix, public_digest


L2_KEPT = 1 << 16  # L2 pages whose L3 write may still come (older ones are not announced)


class TierEvents:
    """One DCP group's events (kept on the rank that publishes). ``publisher``: a
    ``hicache.events.publisher.Publisher`` (or anything with ``publish(events, ts)``)."""

    def __init__(self, publisher, page_tokens: int) -> None:
        self.publisher, self.page_tokens = publisher, page_tokens
        self._events: list = []
        self._lock = threading.Lock()          # L3 writes resolve on the writer's thread
        # chain -> (parent, tokens, extra) of L2 pages an L3 write may announce (the newest)
        self._l2: OrderedDict[bytes, tuple] = OrderedDict()
        self.l3_chains: set[bytes] = set()     # pages this group announced in L3

    # ---- the controller's listener -----------------------------------------------------------
    def on_tier(self, stored: bool, tier: str, node) -> None:
        chains, parent = self._chains(node)
        if not stored:
            self._add(wire.BlockRemoved(chains, wire.MEDIUM[tier]))
            return
        tokens = np.frombuffer(node.tokens, TOKEN)
        extra = None
        if node.scope:
            extra = [(public_digest(node.scope),)] + [None] * (len(chains) - 1)
        self._add(self._stored(chains, parent, tokens, extra, tier))
        if tier == "l2":  # what an L3 write of these pages will announce
            pt = self.page_tokens
            with self._lock:
                for i, c in enumerate(chains):
                    self._l2[c] = (chains[i - 1] if i else parent, tokens[i * pt:(i + 1) * pt],
                                   extra[i] if extra else None)
                while len(self._l2) > L2_KEPT:
                    self._l2.popitem(last=False)

    def _stored(self, chains, parent, tokens: np.ndarray, extra, tier: str):
        return wire.BlockStored(chains, parent, tokens.tolist(), self.page_tokens, None,
                                wire.MEDIUM[tier], None, extra)

    def _chains(self, node) -> tuple[list[bytes], "bytes | None"]:
        """The chain hash of each of ``node``'s pages and the hash before its first (None at a
        chain's start), computing and keeping each node's last hash on the way."""
        todo, n = [], node
        while n.parent is not None and (n is node or n.chain is None):
            todo.append(n)
            n = n.parent
        prev = n.chain if n.parent is not None else None
        out: list[bytes] = []
        for x in reversed(todo):
            start = prev if prev is not None else CHAIN_SEED
            if x.scope:
                start = mix(start, x.scope)
            out = chain_on(start, np.frombuffer(x.tokens, TOKEN), self.page_tokens, 0)
            x.chain = out[-1]
            if x is not node:
                prev = x.chain
        return out, prev

    # ---- L3 ----------------------------------------------------------------------------------
    def on_l3_write(self, chains: Sequence[bytes], future) -> None:
        """This group wrote ``chains`` to L3 (``future``: the writer's, a tuple of stored
        flags): announce the pages stored once it resolves."""
        chains = list(chains)
        future.add_done_callback(lambda f: self._l3_done(chains, f))

    def _l3_done(self, chains: list[bytes], future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        runs, run = [], []
        with self._lock:
            metas = [self._l2.pop(c, None) for c in chains]
        for c, ok, meta in zip(chains, future.result(), metas):
            if not ok or meta is None or c in self.l3_chains:
                if run:
                    runs.append(run)
                run = []
                continue
            run.append((c, meta))
        if run:
            runs.append(run)
        for run in runs:
            tokens = np.concatenate([m[1] for _, m in run])
            extra = [m[2] for _, m in run]
            with self._lock:
                self.l3_chains.update(c for c, _ in run)
            self._add(self._stored([c for c, _ in run], run[0][1][0], tokens,
                                   extra if any(extra) else None, "l3"))

    def l3_found(self, chains: Sequence[bytes]) -> None:
        """This group found ``chains`` in L3 (announced by whichever group wrote them)."""
        with self._lock:
            self.l3_chains.update(chains)

    def l3_missing(self, chains: Sequence[bytes]) -> None:
        """A lookup found ``chains`` missing from L3: those this group announced or found there
        are gone (the store evicted them, or another process purged them) and are announced so;
        the others were never in a router's view."""
        with self._lock:
            gone = [c for c in chains if c in self.l3_chains]
            self.l3_chains.difference_update(gone)
        if gone:
            self._add(wire.BlockRemoved(gone, wire.MEDIUM["l3"]))

    def l3_purged(self, named: Sequence[bytes] = ()) -> None:
        """L3 lost this group's namespace: ``named`` (the pages the purge's keys name) and every
        page this group announced or found there are gone."""
        with self._lock:
            gone, self.l3_chains = sorted(self.l3_chains.union(named)), set()
        if gone:
            self._add(wire.BlockRemoved(gone, wire.MEDIUM["l3"]))

    def cleared(self) -> None:
        self._add(wire.AllBlocksCleared())

    # ---- batches -----------------------------------------------------------------------------
    def _add(self, event) -> None:
        with self._lock:
            self._events.append(event)

    def flush(self, ts: float) -> int:
        """Publish what this step collected as one batch; returns how many events."""
        with self._lock:
            events, self._events = self._events, []
        if events:
            self.publisher.publish(events, ts)
        return len(events)
