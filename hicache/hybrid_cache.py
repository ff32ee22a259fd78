"""The hybrid-model part of ``HiCache`` (``hicache.service``): KDA state snapshots beside the
striped MLA KV pages (docs/hybrid.md).

- ``build``: the controller's snapshot settings and this rank's ``StateTier`` when the policy's
  ``model.path`` is a hybrid checkpoint (else ``(None, None)``: DeepSeek checkpoints and the
  built-in model are untouched);
- ``match``: the hit is cut back to the deepest page holding a snapshot (the same on every rank:
  the controller is replicated); the tokens cut are counted as lost; the snapshot's tensors go
  in ``prefix.state`` for the engine to restore before its first extend;
- ``positions`` / ``attach``: where a request should snapshot, and the snapshots it hands over
  at ``finish`` kept on the pages that end at their positions (L1, L2 copy, L3 once).

Imports no engine: a snapshot is a pair of tensors ``(conv, rec)``.
"""

from __future__ import annotations

import numpy as np

from .controller import SnapshotSettings
from .hybrid_sizes import snapshot_slots
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
    for s in placed:
        try:
            hc.states.put(snapshots[s.pages * pt], s.l1, s.l2)
        except Exception as err:  # noqa: BLE001 (any copy failure: agreed, not raised here)
            hc._record(err)
