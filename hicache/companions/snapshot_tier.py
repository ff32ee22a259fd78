"""The bytes of a hybrid model's KDA state snapshots on one rank: L1 (device) and L2 (host)
copies by slot id (the slots are the controller's, ``hicache.controller.snapshots``).

A snapshot is replicated (the same on every DCP rank), held as its engine tensors ``(conv,
rec)``: the short-convolution window ``[L, 3D, K-1]`` and the fp32 recurrent matrix
``[L, H, Dk, Dv]`` of every KDA layer. Its size is the STATE ``PageFormat``'s
(``hicache.companions.snapshot_format``); the pools are slot-indexed like the page pools, filled lazily.
The L3 copy is written by ``hicache.companions.snapshot_l3``. No collective; imports no controller, service
or engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.errors import UsageError

TIERS = ("l1", "l2", "l3")


@dataclass
class StateStats:
    """Snapshot bytes moved, per tier: ``written`` into it, ``read`` from it for a hit."""
    written: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    read: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    hits: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    lost_tokens: int = 0  # matched tokens past the deepest snapshot (recomputed)


def state_nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state)


class StateTier:
    """Slot -> ``(conv, rec)``: L1 tensors on ``device``, L2 copies on the host."""

    def __init__(self, fmt, l1_slots: int, l2_slots: int, device) -> None:
        self.format = fmt
        self.device = torch.device(device)
        self.l1: list = [None] * l1_slots
        self.l2: list = [None] * l2_slots
        self.stats = StateStats()
        self.l3 = None  # hicache.companions.snapshot_l3.StateL3 when L3 is on

    def close(self) -> None:
        l3, self.l3 = self.l3, None
        if l3 is not None:
            l3.close()

    def put(self, state, l1: int | None, l2: int | None) -> None:
        """Keep ``state`` (``(conv, rec)``) in L1 slot ``l1`` and a host copy in L2 slot
        ``l2`` (either may be None)."""
        conv, rec = state
        n = state_nbytes(state)
        if n != self.format.page_bytes:
            raise UsageError(f"a KDA snapshot of {n} bytes does not match the checkpoint's "
                             f"state format ({self.format.page_bytes} bytes)")
        if l1 is not None:
            self.l1[l1] = (conv.to(self.device), rec.to(self.device))
            self.stats.written["l1"] += n
        if l2 is not None:
            self.l2[l2] = (conv.to("cpu", copy=True), rec.to("cpu", copy=True))
            self.stats.written["l2"] += n

    def get(self, l1: int | None, l2: int | None):
        """``(state, tier)`` of a snapshot: from L1 when it has a slot there, else from L2
        (copied to the device)."""
        if l1 is not None:
            state, tier = self.l1[l1], "l1"
        elif l2 is not None:
            conv, rec = self.l2[l2]
            state, tier = (conv.to(self.device), rec.to(self.device)), "l2"
        else:
            raise UsageError("a snapshot with no copy was matched")
        self.stats.read[tier] += state_nbytes(state)
        self.stats.hits[tier] += 1
        return state, tier

    def bytes_held(self) -> dict:
        n = self.format.page_bytes
        return {"l1": n * sum(s is not None for s in self.l1),
                "l2": n * sum(s is not None for s in self.l2)}

    def report(self) -> dict:
        s = self.stats
        out = {"l3_corrupt": 0}
        if self.l3 is not None:
            s.written["l3"] = self.l3.written
            out["l3_corrupt"] = self.l3.store.stats.corrupt  # damaged or forged: misses
        return {"snapshot_bytes": self.format.page_bytes, "written_bytes": dict(s.written),
                "read_bytes": dict(s.read), "hits": dict(s.hits),
                "lost_tokens": s.lost_tokens, "held_bytes": self.bytes_held(), **out}
