"""The hybrid-model part of ``HiCache`` (``hicache.service``): KDA state snapshots beside the
striped MLA KV pages (docs/hybrid.md).

- ``build``: the controller's snapshot settings and this rank's ``StateTier`` when the policy's
  ``model.path`` is a hybrid checkpoint (else ``(None, None)``: DeepSeek checkpoints and the
  built-in model are untouched);
- ``match``: the hit is cut back to the deepest page holding a snapshot (the same on every rank:
  the controller is replicated); the tokens cut are counted as lost; the snapshot's tensors go
  in ``prefix.state`` for the engine to restore before its first extend;
- ``positions`` / ``attach``: where a request should snapshot, and the snapshots it hands over
  at ``finish`` kept on the pages that end at their positions (L1, L2 copy, L3 once: queued
  for a background writer that ``TierIO`` polls and flushes with the target's).

Imports no engine: a snapshot is a pair of tensors ``(conv, rec)``.
"""

from __future__ import annotations

import numpy as np

from .controller import SnapshotSettings
from .hybrid_sizes import conv_elems, snapshot_slots
from .state_tier import StateTier


def build(config, tiers, device) -> tuple[SnapshotSettings | None, StateTier | None]:
    """The snapshot pools of ``config``'s hybrid checkpoint (none without one or any tier)."""
    fmt = config.state_format
    if fmt is None or not tiers:
        return None, None
    l1, l2 = snapshot_slots(config, "l2" in tiers)
    settings = SnapshotSettings(l1, l2, config.hybrid.snapshot_every_pages)
    return settings, StateTier(fmt, l1, l2, device)


def match(hc, arr: np.ndarray, prefix):
    """``ctrl.match(arr[:-1], lock=True)`` cut back to the deepest snapshot (``settle`` then
    fills ``prefix.state``)."""
    ctrl = hc.ctrl
    with hc._timed():
        cached, usable, snap = ctrl.snaps.limit(arr[:-1], hosted="l2" in hc.tiers)
        m = ctrl.match(arr[:usable], lock=True)
        if snap is not None:
            ctrl.snaps.use(snap)
    prefix.state = (usable, snap)
    prefix.lost_len = cached - usable
    return m


def settle(hc, arr: np.ndarray, prefix) -> None:
    """After the L2 load-back: ``prefix.state`` becomes ``(position, conv, rec)`` of the hit's
    snapshot (None without a hit). A host part that was not loaded (under the threshold, no L1
    room) ends the hit at the device part: cut back again to the deepest snapshot there (the
    lock still holds the whole match; the pages past the hit are recomputed into the request's
    own pages and freed as duplicates at ``finish``)."""
    usable, snap = prefix.state
    have = prefix.hit_len
    if have < usable:
        with hc._timed():
            _, usable, snap = hc.ctrl.snaps.limit(arr[:have], hosted=False)
        prefix.lost_len += have - usable
        prefix.device_len = usable
        del prefix.page_table[usable // hc.page_tokens:]
    prefix.state = None
    if snap is not None:
        (conv, rec), prefix.state_tier = hc.states.get(snap.l1, snap.l2)
        prefix.state = (usable, conv, rec)
    hc.states.stats.lost_tokens += prefix.lost_len


def usable_len(hc, arr: np.ndarray) -> int:
    """The hit ``match`` would keep (``HiCache.peek``: read-only)."""
    return hc.ctrl.snaps.limit(arr, hosted="l2" in hc.tiers)[1]


def positions(hc, request_id, end: int) -> list[int]:
    """Positions in ``(hit, end]`` whose KDA state the request should hand to ``finish``."""
    if hc.states is None:
        return []
    return hc.ctrl.snaps.positions(hc.prefix(request_id).hit_len, end)


def attach(hc, arr: np.ndarray, snapshots) -> None:
    """After the insert of ``arr`` (whole pages): keep ``snapshots`` (position -> ``(conv,
    rec)``) the controller wants, in the slots it gives them. A copy that fails is recorded
    (agreed at the next step) and the bookkeeping goes on as on every rank."""
    if not snapshots:
        return
    with hc._timed():
        placed = hc.ctrl.snaps.attach(arr, list(snapshots))
    pt = hc.page_tokens
    l3 = hc.states.l3
    for s in placed:
        state = snapshots[s.pages * pt]
        try:
            hc.states.put(state, s.l1, s.l2)
        except Exception as err:  # noqa: BLE001 (any copy failure: agreed, not raised here)
            hc._record(err)
        if l3 is not None:  # once for the group (the designated rank queues a copy)
            try:
                l3.put(arr[:s.pages * pt], state)
            except Exception as err:  # noqa: BLE001 (agreed at the next step, like a copy's)
                hc._record(err)


# ---- L3 (hicache.state_l3): snapshots written once for the group, agreed on every read -------
def open_l3(hc, config, replica, weights_signature: str) -> None:
    """With L3 on: this rank's view of the group's snapshots in the store."""
    if hc.states is None or hc.io.l3 is None:
        return
    from .state_l3 import StateL3
    hc.states.l3 = l3 = StateL3(config, hc.rank, replica, weights_signature, hc.states.format,
                                conv_elems(config))
    if l3.writer is not None:  # its errors agreed, its writes flushed with the target's
        hc.io.companions.append(l3.writer)


def find_l3(hc, req, arr: np.ndarray) -> None:
    """At admission: start looking for the deepest snapshot in L3 past the hit, within the KV
    pages this rank's store holds past it (one lookup), and reading it, on the snapshots' read
    thread: ``req.state_find`` (a Future), ``req.state_l3`` none found until ``resolve_l3``."""
    from .l3.keys import chain_hashes
    hit, l3, pt = req.prefix.hit_len, hc.states.l3, hc.page_tokens
    req.state_l3 = (hit, None)
    chains = chain_hashes(arr[:-1], pt)[hit // pt:]
    if not chains or l3 is None:
        return
    store, keys = hc.io.l3, hc.io.keys(chains)

    def look():
        n = store.exists_prefix(keys)
        return l3.find(arr, hit, hit + n * pt) if n else (hit, None)
    req.state_find = l3.submit(look)


def resolve_l3(req, wait) -> None:
    """Before the step's agreement, once the request's target prefetch is ready on this rank:
    ``req.state_l3`` becomes what the read found (``wait(future, default)``: the bounded wait;
    a timeout or an error is no snapshot, which the agreement makes a miss on every rank)."""
    if req.state_find is not None:
        req.state_l3 = wait(req.state_find, (req.prefix.hit_len, None), "KDA snapshot")
        req.state_find = None


def l3_signals(pending) -> list[int]:
    """Per request waiting on L3: ``[p, -p]`` (MIN-reduced: every rank found the same
    snapshot position ``p`` only when both come back as they went)."""
    out: list[int] = []
    for req in pending:
        p = req.state_l3[0] if req.state_l3[1] is not None else req.prefix.hit_len
        out += [p, -p]
    return out


def l3_decisions(hc, pending, decisions, agreed) -> list:
    """The agreed L3 pages cut to the agreed snapshot: exactly the pages up to it when every
    rank holds the same snapshot and read them all, else none (recompute)."""
    out = []
    for i, (req, (ok, pages)) in enumerate(zip(pending, decisions)):
        lo, hi = agreed[2 * i], -agreed[2 * i + 1]
        need = (lo - req.prefix.hit_len) // hc.page_tokens
        out.append((ok, need if lo == hi and need > 0 and pages >= need else 0))
    return out


def restored_l3(hc, req) -> None:
    """The agreed L3 pages were restored: the request continues from the L3 snapshot."""
    prefix, (p, state) = req.prefix, req.state_l3
    prefix.state = (p, *state)
    prefix.state_tier = "l3"
    st = hc.states.stats
    st.hits["l3"] += 1
    st.read["l3"] += hc.states.format.page_bytes
    gained = min(prefix.lost_len, prefix.storage_len)
    prefix.lost_len -= gained
    st.lost_tokens -= gained
