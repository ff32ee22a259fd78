"""``Snapshots``: a hybrid model's KDA state snapshots beside the striped MLA KV pages, as a
``Companion`` (``hicache.companions.base``; docs/hybrid.md). Allocated per snapshot position:
the controller's snapshot index (``hicache.controller.snapshots``, bookkeeping only) gives each
an L1 slot and an L2 slot; the bytes live in ``StateTier`` (``snapshot_tier``: pools, the L2
copy a job of its own transfer engine) and, once for the DCP group, in L3 (``snapshot_l3``).

- ``controller_options``: the controller's snapshot settings when the policy's ``model.path``
  is a hybrid checkpoint (DeepSeek checkpoints and the built-in model are untouched);
- ``cap`` / ``settle``: the hit is cut back to the deepest page holding a snapshot (the same on
  every rank: the controller is replicated); the tokens cut are counted as lost; the snapshot's
  tensors go in ``prefix.state`` for the engine to restore before its first extend;
- ``positions`` / ``finish``: where a request should snapshot, and the snapshots it hands over
  at ``finish`` (``snapshots=``: position -> ``(conv, rec)``), kept on the pages that end at
  their positions (L1, L2 copy, L3 once: queued for a background writer that ``TierIO`` polls
  and flushes with the target's); the positions go into the step's content digest;
- L3: at admission the deepest snapshot past the hit is looked up and read off admit; its
  position is agreed by name (``hybrid.at`` and ``hybrid.at_neg``: min and max over ranks), and
  the L3 pages restored are cut to it.

Imports no engine: a snapshot is a pair of tensors ``(conv, rec)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hicache.controller import SnapshotSettings
from hicache.errors import UsageError

from .base import Companion, Host
from .snapshot_format import conv_elems, snapshot_slots
from .snapshot_tier import StateTier

__all__ = ["Snapshots", "build", "controller_options"]


class _Req:
    """A request's snapshot: the one its L1/L2 hit ends at (``usable``, ``snap``), then the
    L3 lookup past it (its Future until resolved; ``l3``: ``(position, state or None)``)."""

    __slots__ = ("usable", "snap", "find", "l3")

    def __init__(self, usable: int, snap) -> None:
        self.usable, self.snap, self.find, self.l3 = usable, snap, None, None


class Snapshots(Companion):
    """This rank's KDA state snapshots in L1, L2 and L3."""

    name = "hybrid"
    finish_arg = "snapshots"

    def __init__(self, host: Host, tier: StateTier) -> None:
        self.host, self.tier, self.format = host, tier, tier.format
        self.signature = f"kda:{tier.format.describe()}"

    @property
    def l3(self):
        """This rank's view of the group's snapshots in L3 (``StateL3``), None without L3."""
        return self.tier.l3

    @property
    def writer(self):
        return self.tier.l3.writer if self.tier.l3 is not None else None

    # ---- match ---------------------------------------------------------------------------------
    def cap(self, host: Host, tokens: np.ndarray, req=None):
        """The hit ends at the deepest snapshot (read-only without ``req``)."""
        cached, usable, snap = host.ctrl.snaps.limit(tokens, hosted="l2" in host.tiers)
        if req is not None:
            if snap is not None:
                host.ctrl.snaps.use(snap)
            req.parts[self.name] = _Req(usable, snap)
            req.prefix.lost_len = cached - usable
        return usable

    def settle(self, host: Host, req) -> None:
        """After the L2 load-back: ``prefix.state`` becomes ``(position, conv, rec)`` of the
        hit's snapshot (None without a hit). A host part that was not loaded (under the
        threshold, no L1 room) ends the hit at the device part: cut back again to the deepest
        snapshot there (the lock still holds the whole match; the pages past the hit are
        recomputed into the request's own pages and freed as duplicates at ``finish``)."""
        prefix, part = req.prefix, req.parts[self.name]
        usable, snap, have = part.usable, part.snap, prefix.hit_len
        if have < usable:
            with host.timed():
                _, usable, snap = host.ctrl.snaps.limit(req.tokens[:have], hosted=False)
            prefix.lost_len += have - usable
            prefix.device_len = usable
            del prefix.page_table[usable // host.page_tokens:]
        prefix.state = None
        if snap is not None:
            (conv, rec), prefix.state_tier = self.tier.get(snap.l1, snap.l2)
            prefix.state = (usable, conv, rec)
        self.tier.stats.lost_tokens += prefix.lost_len

    def positions(self, host: Host, hit: int, end: int) -> list[int]:
        """Positions in ``(hit, end]`` whose KDA state a request should hand to ``finish``."""
        return host.ctrl.snaps.positions(hit, end)

    # ---- L3: written once for the group, agreed on every read ----------------------------------
    def start_read(self, host: Host, req) -> None:
        """Start looking for the deepest snapshot in L3 past the hit, within the KV pages this
        rank's store holds past it (one lookup), and reading it, on the snapshots' read thread;
        none found until ``resolve``."""
        part, pt, l3 = req.parts[self.name], host.page_tokens, self.tier.l3
        hit = req.prefix.hit_len
        part.l3 = (hit, None)
        chains = req.chains(req.tokens[:-1])
        if len(chains) <= hit // pt or l3 is None:
            return
        store, keys = host.io.l3, host.io.keys(chains[hit // pt:])

        def look():
            n = store.exists_prefix(keys)
            return l3.find(chains, hit, hit + n * pt) if n else (hit, None)
        part.find = l3.submit(look)

    def resolve(self, req, wait) -> None:
        part = req.parts[self.name]
        if part.find is not None:
            part.l3 = wait(part.find, (req.prefix.hit_len, None), "KDA snapshot")
            part.find = None

    def fields(self, req) -> dict[str, int]:
        """The snapshot position this rank found, as ``at`` and ``-at``: every rank found the
        same one only when both come back from the MIN as they went."""
        part = req.parts[self.name]
        p = part.l3[0] if part.l3 is not None and part.l3[1] is not None else req.prefix.hit_len
        return {"at": p, "at_neg": -p}

    def decide(self, host: Host, req, agreed: dict[str, int], pages: int) -> int:
        """Exactly the pages up to the agreed snapshot when every rank holds it and read them
        all, else none (recompute)."""
        lo, hi = agreed["at"], -agreed["at_neg"]
        need = (lo - req.prefix.hit_len) // host.page_tokens
        return need if lo == hi and need > 0 and pages >= need else 0

    def restore(self, host: Host, req, dev: list, pages: int):
        """The agreed L3 pages were restored: the request continues from the L3 snapshot."""
        if not pages:
            return None
        prefix, (p, state) = req.prefix, req.parts[self.name].l3
        prefix.state = (p, *state)
        prefix.state_tier = "l3"
        st = self.tier.stats
        st.hits["l3"] += 1
        st.read["l3"] += self.format.page_bytes
        gained = min(prefix.lost_len, prefix.storage_len)
        prefix.lost_len -= gained
        st.lost_tokens -= gained
        return None

    def drop(self, req) -> None:
        part = req.parts.get(self.name)
        if part is not None and part.find is not None:
            part.find.cancel()

    # ---- finish --------------------------------------------------------------------------------
    def check_finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        if value is not None and (not isinstance(value, Mapping) or not all(
                isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in value)):
            raise UsageError(f"finish of request {req.prefix.request_id!r}: snapshots must map "
                             f"int positions to (conv, rec), got {value!r:.80}")

    def digest(self, value) -> tuple:
        if not isinstance(value, Mapping):
            return ()
        return tuple(sorted(int(p) for p in value if isinstance(p, (int, np.integer))))

    def finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        """After the insert of ``arr[:end]`` (whole pages): keep the snapshots the controller
        wants, in the slots it gives them. A copy that fails is recorded (agreed at the next
        step) and the bookkeeping goes on as on every rank."""
        if not value:
            return
        with host.timed():
            placed = host.ctrl.snaps.attach(arr[:end], list(value))
        pt, l3 = host.page_tokens, self.tier.l3
        chains = req.chains(arr[:end]) if l3 is not None and placed else []
        for s in placed:
            state = value[s.pages * pt]
            try:
                job = self.tier.put(state, s.l1, s.l2)
                if job is not None:  # the L2 copy: polled and agreed like the target's
                    host.io.track(job)
                if l3 is not None:  # once for the group (the designated rank queues a copy)
                    l3.put(chains[s.pages - 1], state)
            except Exception as err:  # noqa: BLE001 (any copy failure: agreed, not raised here)
                host.record(err)

    def report(self) -> dict:
        return self.tier.report()

    def close(self) -> None:
        self.tier.close()


def controller_options(config, tiers) -> dict:
    """The controller's snapshot settings of ``config``'s hybrid checkpoint (none without one
    or any tier)."""
    if config.state_format is None or not tiers:
        return {}
    l1, l2 = snapshot_slots(config, "l2" in tiers)
    return {"snapshots": SnapshotSettings(l1, l2, config.hybrid.snapshot_every_pages)}


def build(host: Host) -> Snapshots | None:
    """The snapshots of ``host``'s hybrid checkpoint (None without one or any tier); with L3
    on, this rank's view of the group's snapshots in the store."""
    config = host.config
    fmt = config.state_format
    if fmt is None or not host.tiers:
        return None
    l1, l2 = snapshot_slots(config, "l2" in host.tiers)
    tier = StateTier(fmt, l1, l2, host.device, conv_elems(config), pin=config.l2.pin)
    if host.io.l3 is not None:
        from .snapshot_l3 import StateL3
        tier.l3 = StateL3(config, host.rank, host.replica, host.weights_signature, fmt,
                          conv_elems(config))
    return Snapshots(host, tier)
