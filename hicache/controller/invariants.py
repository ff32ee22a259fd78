"""The controller's invariant check (tests, debug): every page owned once, every counter and
eviction order equal to what a walk of the tree recounts. Reads the controller; changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hicache.errors import InvariantError
from hicache.ids import TOKEN_BYTES


@dataclass
class _Seen:
    """What one walk of the tree found."""
    dev: set = field(default_factory=set)         # device pages: requests' and nodes'
    host: set = field(default_factory=set)        # host pages held by nodes
    dev_nodes: set = field(default_factory=set)
    host_nodes: set = field(default_factory=set)
    dev_pages: int = 0
    locked: int = 0
    host_valid: int = 0
    evicting: int = 0


def check(ctl) -> None:
    """Raise InvariantError naming the first inconsistency of ``ctl`` (a CacheController)."""
    seen = _Seen(dev=_request_pages(ctl))
    for n in ctl.iter_nodes():
        _check_node(ctl, n, seen)
    _check_pools(ctl, seen)
    _check_counters(ctl, seen)


def _request_pages(ctl) -> set:
    """The request pages (map and grants), checked disjoint."""
    seen: set[int] = set(np.flatnonzero(ctl._request_page).tolist())
    for g in ctl._grants:  # disjoint from each other and from the map
        gp = np.frombuffer(g, np.int64).tolist()
        if not len(gp) or not seen.isdisjoint(gp) or len(set(gp)) != len(gp):
            raise InvariantError("a grant holds pages another grant or the request-page "
                                 "map holds")
        seen.update(gp)
    return seen


def _own(pages, seen: set, what: str) -> None:
    for p in pages.tolist():
        if p in seen:
            raise InvariantError(f"{what} page {p} owned twice")
        seen.add(p)


def _check_node(ctl, n, seen: _Seen) -> None:
    if not n.alive:
        raise InvariantError(f"dead node {n.nid} still in the tree")
    if n.device is None and n.host is None:
        raise InvariantError(f"node {n.nid} holds no data")
    if len(n.tokens) != n.npages * ctl.page_tokens * TOKEN_BYTES:
        raise InvariantError(f"node {n.nid} token count != pages")
    if n.device is not None:
        seen.dev_nodes.add(n)
        seen.dev_pages += n.npages
        seen.locked += n.npages if n.lock_ref else 0
        if len(n.device) != n.npages or n.device.dtype != np.int64:
            raise InvariantError(f"node {n.nid} device page count or dtype")
        if n.parent.parent is not None and n.parent.device is None:
            raise InvariantError(f"node {n.nid} on device under a host-only parent")
        _own(n.device, seen.dev, "device")
    if n.host is not None:
        seen.host_nodes.add(n)
        seen.host_valid += n.npages if n.host_valid else 0
        if len(n.host) != n.npages:
            raise InvariantError(f"node {n.nid} host page count")
        if not n.host_valid and (not n.pending or n.device is None):
            raise InvariantError(f"node {n.nid} has an invalid host copy with no backup")
        _own(n.host, seen.host, "host")
    elif n.host_valid:
        raise InvariantError(f"node {n.nid} valid without host pages")
    if n.lock_ref < 0 or n.lock_ref < max((c.lock_ref for c in n.children.values()),
                                         default=0):
        raise InvariantError(f"node {n.nid} lock count {n.lock_ref} below a child's")
    for o in n.pending:
        if o not in ctl._ops or n not in ctl._ops[o].nodes:
            raise InvariantError(f"node {n.nid} pending on unknown op {o}")
    if n.evicting:
        seen.evicting += n.npages


def _check_pools(ctl, seen: _Seen) -> None:
    if seen.dev != set(ctl.device.used_ids().tolist()):
        raise InvariantError("device pool's allocated pages != pages held by the tree "
                             "and requests")
    if len(seen.dev) != ctl.device.num_used:
        raise InvariantError(f"device pages: {ctl.device.num_used} allocated, "
                             f"{len(seen.dev)} accounted for (leak)")
    if seen.host != set(ctl.host.used_ids().tolist()):
        raise InvariantError(f"host pool's allocated pages ({ctl.host.num_used}) != the "
                             f"{len(seen.host)} held by the tree")


def _check_counters(ctl, seen: _Seen) -> None:
    dev, hst = list(ctl._dev), list(ctl._hst)  # each node once, in eviction order
    if seen.dev_nodes != set(dev) or seen.host_nodes != set(hst) \
            or len(dev) != len(ctl._dev) or len(hst) != len(ctl._hst) \
            or len(ctl._dev) != len(seen.dev_nodes) or len(ctl._hst) != len(seen.host_nodes):
        raise InvariantError("tier eviction orders disagree with the tree")
    counted = (seen.dev_pages, seen.locked, seen.host_valid)
    if counted != (ctl._dev_pages, ctl._locked_dev_pages, ctl._host_valid_pages):
        raise InvariantError(f"page counters (device, locked, host valid) "
                             f"{(ctl._dev_pages, ctl._locked_dev_pages)}, "
                             f"{ctl._host_valid_pages} != {counted}")
    if seen.evicting != ctl._evicting_pages:
        raise InvariantError(f"evicting pages {ctl._evicting_pages} != {seen.evicting}")
