"""A request's records in ``HiCache`` (``hicache.service``): what ``admit`` found
(``Prefix``, the engine's), the service's own record of it (``Request``: its lock, loads, L3
read, companions' parts and its pages' chain hashes), and the service's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from hicache.controller import LockHandle
from hicache.l3 import chain_hashes
from hicache.tenancy import ScopeHits
from hicache.tier_io import Job, L3Read, Waits

TIERS = ("l1", "l2", "l3")
__all__ = ["Prefix", "Request", "TierStats", "TIERS"]


@dataclass
class Prefix:
    """What ``admit`` found for a request. ``ready`` turns True once every rank agreed on the
    storage part (at once when there is none); then ``hit_len`` tokens need no prefill."""

    request_id: object
    prompt_len: int
    device_len: int = 0             # L1 hit
    host_len: int = 0               # L2 hit being loaded back (H2D)
    storage_len: int = 0            # L3 hit restored (agreed by all ranks)
    page_table: list = field(default_factory=list)  # widened device page ids
    ready: bool = False
    room_wait: int = 0              # steps the agreed L3 restore has waited for L1 room
    # hybrid models (hicache.companions.snapshots): the KDA state after hit_len tokens, to
    # restore before the first extend ((hit_len, conv, rec); None: no hit), its tier, and the
    # matched tokens past the deepest snapshot (recomputed)
    state: object = None
    state_tier: str = ""
    lost_len: int = 0
    draft_len: int = 0              # spec: leading hit tokens whose draft KV was restored

    @property
    def hit_len(self) -> int:
        return self.device_len + self.host_len + self.storage_len


@dataclass
class Request:
    """The service's record of an admitted request."""

    prefix: Prefix
    tokens: np.ndarray              # the prompt, int32 (ids.TOKEN: what the controller keeps)
    lock: Optional[LockHandle] = None
    # what wait_layer waits on: the H2D load of the L2 hit, loads an L1 hit depends on, the
    # L3 restore (None: nothing in flight for this request)
    load_job: Optional[Union[Job, Waits]] = None
    prefetch: Optional[L3Read] = None  # the L3 read, until its restore is agreed
    own_pages: list = field(default_factory=list)   # pages from alloc_device (not yet in tree)
    restore_tries: int = 0          # steps an agreed L3 restore waited for L1 room
    parts: dict = field(default_factory=dict)  # each companion's state of it, by name
    page_tokens: int = 1            # P*c: the widened page its chains hash
    scope: object = None            # its hicache.scope.Scope (None: the shared scope)
    _chains: list = field(default_factory=list, repr=False)

    def chains(self, tokens: np.ndarray) -> list[bytes]:
        """The chain hash of every whole page of ``tokens`` (the prompt, or what ``finish``
        caches: both start with the prompt), computed once per request: the one place a
        request's pages get their L3 identity (the target's keys, the companions' keys), its
        scope mixed in at its first scoped page."""
        w = self.page_tokens
        n = tokens.size // w
        if len(self._chains) < n:
            self._chains = chain_hashes(tokens[:n * w], w, self.scope)
        return self._chains[:n]


@dataclass
class TierStats:
    """The service's own counters (bytes, copy times and prefetch outcomes: ``TierIO.stats``)."""
    hit_tokens: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    prompt_tokens: int = 0
    requests: int = 0
    controller_s: float = 0.0      # inside the controller (match, lock, insert, evict, ...)
    agreement_s: float = 0.0       # the per-step collective, waiting on other ranks included
    steps: int = 0
    restore_wait_steps: int = 0    # steps agreed L3 restores waited for L1 room (all requests)
    restore_fallbacks: int = 0     # agreed L3 restores recomputed after RESTORE_RETRIES steps
    scope_hits: ScopeHits = field(default_factory=ScopeHits)  # hits by public / scoped
