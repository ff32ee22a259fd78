"""Write and eviction policies of the controller, validated once into a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hicache.controller.tree import Node
from hicache.controller.types import ControllerError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "lfu")


class PolicyError(ControllerError):
    """A policy name or threshold that is not allowed."""


@dataclass(frozen=True)
class ControllerPolicy:
    """write: when device pages get a host copy; eviction: which unlocked leaf goes first;
    selective_threshold: uses (inserts) after which write_through_selective backs a node up;
    load_back_threshold: host hits shorter than this many tokens are recomputed instead."""
    write: str = "write_through"
    eviction: str = "lru"
    selective_threshold: int = 2
    load_back_threshold: int = 0

    def __post_init__(self) -> None:
        if self.write not in WRITE_POLICIES:
            raise PolicyError(f"write policy {self.write!r} is not one of {WRITE_POLICIES}")
        if self.eviction not in EVICTION_POLICIES:
            raise PolicyError(f"eviction policy {self.eviction!r} is not one of "
                              f"{EVICTION_POLICIES}")
        for name in ("selective_threshold", "load_back_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PolicyError(f"{name} must be an int >= 0, got {v!r}")

    def eviction_key(self) -> Callable[[Node], tuple]:
        """Sort key: smallest is evicted first. Ties break on node id (deterministic)."""
        if self.eviction == "lru":
            return lambda n: (n.last_access, n.nid)
        return lambda n: (n.hits, n.last_access, n.nid)
