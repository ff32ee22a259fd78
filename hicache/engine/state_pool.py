"""The request-indexed KDA state pool of one rank (replicated on every DCP rank, not striped).

    pool = KDAStatePool(hybrid, conv_dtype, device, slots=8)
    slot = pool.slot_for(state)        # a new request (length 0) gets a zeroed slot
    conv, rec = pool.conv[j, slot], pool.rec[j, slot]     # KDA layer j's state of the request
    pool.commit(slot, updates, length)                    # after a whole extend step
    snap = pool.snapshot(slot); pool.restore(state, snap) # one request's state, every KDA layer

Tensors: ``conv`` [L, S, 3D, K-1] in the model dtype (the convolution's last inputs, as the KV
rows are stored in the model dtype) and ``rec`` [L, S, H, Dk, Dv] fp32, for the L KDA layers and
S slots; the pool doubles S when every slot is taken. Each slot records how many tokens its state
has absorbed (``length``): an extend must start where the state ends, so a request whose KV
came back from a cache tier without its KDA state is refused (``UsageError``) instead of
running on a wrong state. A slot is freed by ``release(state)`` or when its ``RequestState`` is
garbage-collected. The engine writes a request's next state only after every layer of a step
succeeded (``commit``), so a failed step leaves the state as it was.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hicache.errors import UsageError


@dataclass(frozen=True)
class StateSnapshot:
    """One request's KDA state over every KDA layer after ``length`` tokens."""

    length: int
    conv: torch.Tensor  # [L, 3D, K-1] model dtype
    rec: torch.Tensor  # [L, H, Dk, Dv] fp32

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.rec.numel() * self.rec.element_size())


def _release(pool_ref, key: int) -> None:
    pool = pool_ref()
    if pool is not None:
        pool._free_key(key)


class KDAStatePool:
    def __init__(self, hybrid, conv_dtype: torch.dtype, device, slots: int = 8) -> None:
        self.hybrid = hybrid
        self.layers = len(hybrid.kda_layers)
        self.conv = torch.zeros(self.layers, slots, *hybrid.conv_state_shape(), dtype=conv_dtype,
                                device=device)
        self.rec = torch.zeros(self.layers, slots, *hybrid.rec_state_shape(),
                               dtype=torch.float32, device=device)
        self.length = [0] * slots
        self.free = list(range(slots - 1, -1, -1))
        self.owner: dict[int, int] = {}  # id(RequestState) -> slot

    @property
    def slots(self) -> int:
        return self.conv.shape[1]

    @property
    def used(self) -> int:
        return len(self.owner)

    def _grow(self) -> None:
        n = self.slots
        self.conv = torch.cat([self.conv, torch.zeros_like(self.conv)], 1)
        self.rec = torch.cat([self.rec, torch.zeros_like(self.rec)], 1)
        self.length += [0] * n
        self.free = list(range(2 * n - 1, n - 1, -1)) + self.free

    def _alloc(self, state) -> int:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.conv[:, slot].zero_()
        self.rec[:, slot].zero_()
        self.length[slot] = 0
        self.owner[id(state)] = slot
        weakref.finalize(state, _release, weakref.ref(self), id(state))
        return slot

    def _free_key(self, key: int) -> None:
        slot = self.owner.pop(key, None)
        if slot is not None:
            self.free.append(slot)

    def release(self, state) -> None:
        """Free the slot of ``state`` (no-op when it holds none)."""
        self._free_key(id(state))

    def slot_for(self, state) -> int:
        """The slot of ``state``; a new one (zeroed) when ``state.length == 0``."""
        slot = self.owner.get(id(state))
        if slot is None:
            if state.length:
                raise UsageError(
                    f"request at position {state.length} has no KDA state on this rank (its "
                    "KV was placed without the linear-attention state: a hybrid model needs "
                    "the state snapshot of the same position)")
            return self._alloc(state)
        if self.length[slot] != state.length:
            raise UsageError(f"request is at position {state.length} but its KDA state holds "
                             f"{self.length[slot]} tokens (KDA state cannot be rewound)")
        return slot

    def commit(self, slot: int, updates: list, length: int) -> None:
        """Store a step's states: ``updates[j] = (conv, rec)`` of KDA layer j; now ``length``."""
        for j, (conv, rec) in enumerate(updates):
            self.conv[j, slot] = conv.to(self.conv.dtype)
            self.rec[j, slot] = rec
        self.length[slot] = length

    def snapshot(self, state) -> StateSnapshot:
        """A copy of the state of ``state`` (every KDA layer)."""
        slot = self.slot_for(state)
        return StateSnapshot(self.length[slot], self.conv[:, slot].clone(),
                             self.rec[:, slot].clone())

    def restore(self, state, snap: StateSnapshot) -> None:
        """Give ``state`` (at ``snap.length`` positions) the snapshot's KDA state."""
        if state.length != snap.length:
            raise UsageError(f"snapshot after {snap.length} tokens restored into a request at "
                             f"position {state.length}")
        slot = self.owner.get(id(state))
        if slot is None:
            slot = self._alloc(state)
        self.commit(slot, list(zip(snap.conv, snap.rec)), snap.length)
