"""The bytes of a hybrid model's KDA state snapshots on one rank: an L1 (device) pool and an L2
(host) pool of snapshot slots (the slots are the controller's, ``hicache.controller.snapshots``).

A snapshot is replicated (the same on every DCP rank), one page of the STATE ``PageFormat``
(``hicache.companions.snapshot_format``): per KDA layer one fp32 row, the short-convolution
window (widened exactly) then the recurrent matrix. The engine hands it over as ``(conv, rec)``
tensors; ``put`` writes it into its L1 slot, and its L2 copy is a backup job of the snapshots'
own ``TransferEngine`` (timed, per layer), polled and agreed with the target's copies (a
failure stops every rank at the same step); a slot is reused only after the copies reading or
writing it ended. ``get`` hands a copy back (a slot may be reused while the request restores).
The L3 copy is written by ``hicache.companions.snapshot_l3``. No collective; imports no
controller, service or engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.errors import TransferError, UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine
from hicache.layout import DCPLayout

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
    """Slot -> a snapshot: L1 slots on ``device``, L2 slots on the host."""

    def __init__(self, fmt, l1_slots: int, l2_slots: int, device, conv_elems: int,
                 pin: str = "auto") -> None:
        self.format, self.conv_elems = fmt, conv_elems
        self.device = torch.device(device)
        one = DCPLayout(1, 0, 1)  # a slot is one page of the STATE format
        self.l1 = DeviceKVPool.for_format(one, fmt, l1_slots, device=device)
        self.l2 = HostKVPool.for_format(one, fmt, max(l2_slots, 1), layout_kind="page_first",
                                        pin=pin)
        self.transfer = TransferEngine(self.l1, self.l2) if l2_slots else None
        self.l1_has = np.zeros(l1_slots, dtype=bool)
        self.l2_has = np.zeros(max(l2_slots, 1), dtype=bool)
        self._jobs: dict = {}  # ("l1"|"l2", slot) -> the copy in flight reading or writing it
        self.stats = StateStats()
        self.l3 = None  # hicache.companions.snapshot_l3.StateL3 when L3 is on

    def close(self) -> None:
        l3, self.l3 = self.l3, None
        if self.transfer is not None:
            self.transfer.close()
        if l3 is not None:
            l3.close()

    def _settle(self, tier: str, slot: int) -> None:
        """Wait for the copy that reads or writes ``slot`` (its failure is agreed already)."""
        job = self._jobs.pop((tier, slot), None)
        if job is not None:
            # only the slot's quiet matters here: the service tracks the job, agrees its
            # failure and stops every rank at the next step
            with contextlib.suppress(TransferError):
                job.wait()

    def put(self, state, l1: int | None, l2: int | None):
        """Keep ``state`` (``(conv, rec)``) in L1 slot ``l1`` and, with ``l2``, copy it to L2
        slot ``l2``: the copy job (to be tracked), or None."""
        conv, rec = state
        n = state_nbytes(state)
        if n != self.format.page_bytes:
            raise UsageError(f"a KDA snapshot of {n} bytes does not match the checkpoint's "
                             f"state format ({self.format.page_bytes} bytes)")
        layers = self.format.layers
        row = torch.cat([conv.detach().reshape(layers, -1).to(self.device, torch.float32),
                         rec.detach().reshape(layers, -1).to(self.device, torch.float32)], 1)
        if l1 is None:  # (the controller always gives one): the host copy directly
            if l2 is not None:
                self._settle("l2", l2)
                self.l2.buf[l2, :, 0] = row.cpu()
                self.l2_has[l2] = True
                self.stats.written["l2"] += n
            return None
        self._settle("l1", l1)
        self.l1.kv[:, l1] = row
        self.l1_has[l1] = True
        self.stats.written["l1"] += n
        if l2 is None:
            return None
        self._settle("l2", l2)
        job = self.transfer.backup([l1], [l2])
        self._jobs[("l1", l1)] = self._jobs[("l2", l2)] = job
        self.l2_has[l2] = True
        self.stats.written["l2"] += n
        return job

    def get(self, l1: int | None, l2: int | None):
        """``(state, tier)`` of a snapshot, a copy on the device: from L1 when it has a slot
        there, else from L2 (once its copy landed)."""
        if l1 is not None:
            row, tier = self.l1.kv[:, l1].clone(), "l1"
        elif l2 is not None:
            self._settle("l2", l2)
            row, tier = self.l2.buf[l2, :, 0].to(self.device, copy=True), "l2"
        else:
            raise UsageError("a snapshot with no copy was matched")
        self.stats.read[tier] += self.format.page_bytes
        self.stats.hits[tier] += 1
        return (row[:, :self.conv_elems], row[:, self.conv_elems:]), tier

    def bytes_held(self) -> dict:
        n = self.format.page_bytes
        return {"l1": n * int(self.l1_has.sum()), "l2": n * int(self.l2_has.sum())}

    def report(self) -> dict:
        s = self.stats
        out = {"l3_corrupt": 0}
        if self.l3 is not None:
            s.written["l3"] = self.l3.written
            out["l3_corrupt"] = self.l3.store.stats.corrupt  # damaged or forged: misses
        return {"snapshot_bytes": self.format.page_bytes, "written_bytes": dict(s.written),
                "read_bytes": dict(s.read), "hits": dict(s.hits),
                "lost_tokens": s.lost_tokens, "held_bytes": self.bytes_held(), **out}
