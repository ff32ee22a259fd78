"""``HiCache``: the cache layer one rank of a serving engine embeds.

It owns this rank's L1 pool, L2 pool, transfer engine, L3 store (optional), the controller and
the per-step agreement. The engine calls, on EVERY rank, in the same order:

    prefix = hc.admit(rid, tokens)        # match L1/L2 (and start an L3 prefetch), lock the hit
    hc.step()                             # once per scheduler step: completions, agreement
    if prefix.ready: pages = hc.alloc(rid, n_tokens)   # slots for the unmatched suffix
    hc.wait_layer(rid, i)                 # before attention of layer i (H2D load-back overlap)
    hc.finish(rid, tokens)                # insert what was computed, unlock, back up per policy
    hc.stats(); hc.close()

A request's page table is ``prefix.page_table`` (hit pages first, then the pages ``alloc``
added); token i lives at virtual slot ``page_table[i // (P*c)] * (P*c) + i % (P*c)``.
The controller is replicated bookkeeping; data moves per rank with no collective
(``hicache/tier_io.py`` moves it: transfers, L3 reads and writes, restores); the only
collective is the agreement's one all-reduce per ``step``, plus one small agreed checkpoint at
construction and one at ``close`` (``hicache/outcome.py``), so a rank that fails there makes
every rank raise at the same point instead of leaving them in a collective.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from . import distributed as hd
from . import hybrid_cache, outcome, preflight
from .config import HiCacheConfig
from .controller import CacheController, LockHandle, StepAgreement
from . import minvec
from .errors import (ConfigError, DeviceFullError, DivergenceError, PeerError, TransferError,
                     UsageError)
from .ids import as_tokens
from .kvport import CheckedPort, checked_once, span_slots
from .l1.pool import DeviceKVPool, pick_device
from .l2.pool import HostKVPool
from .l3 import agree_prefetch, prefetch_signals
from .tier_io import PREFETCH_OUTCOMES, Job, L3Read, TierIO, Waits, join

log = logging.getLogger("hicache")
TIERS = ("l1", "l2", "l3")
RESTORE_RETRIES = 64  # steps an agreed L3 restore may wait for L1 room before recomputing
CACHE_MODES = {"recompute": (), "l1": ("l1",), "l1+l2": ("l1", "l2"),
               "l1+l2+l3": ("l1", "l2", "l3")}
__all__ = ["HiCache", "Prefix", "CACHE_MODES", "TIERS", "RESTORE_RETRIES", "PREFETCH_OUTCOMES"]


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
    # hybrid models (hicache.hybrid_cache): the KDA state after hit_len tokens, to restore
    # before the first extend ((hit_len, conv, rec); None: no hit), its tier, and the matched
    # tokens past the deepest snapshot (recomputed)
    state: object = None
    state_tier: str = ""
    lost_len: int = 0
    draft_len: int = 0              # spec: leading hit tokens whose draft KV was restored

    @property
    def hit_len(self) -> int:
        return self.device_len + self.host_len + self.storage_len


@dataclass
class _Request:
    prefix: Prefix
    tokens: np.ndarray              # the prompt, int64
    lock: Optional[LockHandle] = None
    # what wait_layer waits on: the H2D load of the L2 hit, loads an L1 hit depends on, the
    # L3 restore (None: nothing in flight for this request)
    load_job: Optional[Union[Job, Waits]] = None
    prefetch: Optional[L3Read] = None  # the L3 read, until its restore is agreed
    own_pages: list = field(default_factory=list)   # pages from alloc_device (not yet in tree)
    restore_tries: int = 0          # steps an agreed L3 restore waited for L1 room
    state_l3: object = None         # hybrid: (position, snapshot) found in L3 (hybrid_cache)
    state_find: object = None       # hybrid: the Future of that L3 lookup, until resolved
    draft_read: object = None       # spec: the L3 read of its draft pages (DraftRead)
    draft_future: object = None     # spec: the Future of that read, until resolved
    draft_agreed: int = 0           # spec: draft pages of that read every rank holds


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


class HiCache:
    """One rank's cache hierarchy. ``mode`` picks the tiers: recompute, l1, l1+l2, l1+l2+l3
    (default: l1+l2, plus l3 when the policy file enables it). ``weights_signature`` (default:
    the policy's ``[model] signature``) names the weights in the L3 keys, so a store written by
    other weights of the same shapes never hits; L3 refuses to start without one."""

    def __init__(self, config: HiCacheConfig, rank: int = 0, group=None, *,
                 mode: str | None = None, device: str | torch.device | None = None,
                 replica: tuple[int, int] = (0, 1), debug: bool = False,
                 weights_signature: str | None = None, draft=None) -> None:
        # Construction is agreed: whatever fails here on one rank (a preflight check, a pool,
        # the L3 store, a bad argument), every rank still takes the construction's collectives
        # (the control group, then one checkpoint) and then every rank raises at that point;
        # what was built is closed on every rank.
        self._closed = True  # until built: close() has nothing to do
        self.io: TierIO | None = None
        self.draft_spec, self.draft = draft, None  # spec: a DraftSpec -> DraftPages
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        error: BaseException | None = None
        try:
            self._build(config, rank, group, world, mode, device, replica, debug,
                        weights_signature)
        except BaseException as e:  # agreed below, then raised on this rank
            error = e
        try:
            # the control plane runs on CPU tensors: over a gloo twin of an NCCL group (made
            # once, by every rank: a collective of its own under NCCL)
            self.control_group = hd.control_group(group) if world > 1 else group
            digest = 0
            if error is None:
                self.agreement = StepAgreement(group=self.control_group, debug=debug,
                                               local=world == 1)
                digest = self._settings_digest()
            h = outcome.checkpoint("HiCache construction", error, group,
                                   header=[digest, -digest], detail=True)
            if h[0] != -h[1]:
                raise DivergenceError(
                    "HiCache construction: the ranks' replicated settings differ (mode, page "
                    "size, L1/L2 pages, policy, debug: the controllers would diverge); build "
                    "every rank's HiCache from the same policy file")
        except BaseException:
            self._discard()
            raise
        self._closed = False

    def _build(self, config: HiCacheConfig, rank: int, group, world: int, mode: str | None,
               device, replica: tuple[int, int], debug: bool,
               weights_signature: str | None) -> None:
        """This rank's part of the construction (no collective): checks, pools, controller,
        transfers and L3 store."""
        mode, weights_signature = self._check_args(config, world, mode, replica,
                                                   weights_signature)
        self.weights_signature = weights_signature
        self.config, self.rank, self.group, self.mode = config, rank, group, mode
        # (id, count) among the TP replicas of this shard that share this rank's L3 store (one
        # writer per page per store: l3.store_replica computes it from the ranks' nodes)
        self.replica = replica
        self.tiers = CACHE_MODES[mode]
        host_pages = self._build_pools(config, rank, device)
        snapshots, self.states = hybrid_cache.build(config, self.tiers, self.l1.device)
        self.ctrl = CacheController(self.page_tokens, config.l1.num_pages, host_pages,
                                    policy=config.policy, snapshots=snapshots)
        self._init_request_state(config)
        # the bytes: transfers, L3 store, writer, prefetcher, restores (hicache/tier_io.py)
        self.io = TierIO(config, rank, self.l1, self.l2, self.page_tokens, self._record,
                         replica=replica, l3="l3" in self.tiers,
                         weights_signature=weights_signature)
        self.transfer = self.io.transfer
        self.namespace = self.io.namespace
        hybrid_cache.open_l3(self, config, replica, weights_signature)
        if self.draft_spec is not None:  # spec: the draft's companion pages in every tier
            from .draft_pages import build_draft_pages
            self.draft = self.io.draft = build_draft_pages(
                self.draft_spec, config, rank, device, host_pages, "l3" in self.tiers,
                weights_signature)

    @staticmethod
    def _check_args(config: HiCacheConfig, world: int, mode: str | None,
                    replica: tuple[int, int], weights_signature: str | None
                    ) -> tuple[str, str]:
        """The constructor's arguments checked against the config (UsageError, ConfigError):
        the mode and weights signature, defaults filled in."""
        if mode is None:
            mode = "l1+l2+l3" if config.l3.enabled else "l1+l2"
        if mode not in CACHE_MODES:
            raise UsageError(f"unknown mode {mode!r}; expected one of {', '.join(CACHE_MODES)}")
        if weights_signature is None:
            weights_signature = config.model.signature or _checkpoint_signature(config, mode)
        if not isinstance(weights_signature, str):
            raise UsageError(f"weights_signature must be a str, got {weights_signature!r}")
        if "l3" in CACHE_MODES[mode] and not weights_signature:
            raise ConfigError(
                "model.signature: L3 is enabled but no weights signature is set, so another "
                "checkpoint of the same shapes could be served this one's KV; set [model] "
                "signature (a checkpoint hash or revision) or pass HiCache(weights_signature=...)")
        if world != config.parallel.dcp:
            raise UsageError(f"the process group has {world} ranks but parallel.dcp is "
                             f"{config.parallel.dcp}: one HiCache per DCP rank")
        if not (len(replica) == 2 and 0 <= replica[0] < replica[1]):
            raise UsageError(f"replica must be (id, count) with 0 <= id < count, got {replica}")
        return mode, weights_signature

    def _build_pools(self, config: HiCacheConfig, rank: int, device) -> int:
        """Preflight checks, then this rank's L1 and L2 pools; the L2 pages the controller
        manages (0 without an L2 tier)."""
        # the checks check-config and hicache-bench run (engine needs aside); this rank's pools
        machine = preflight.Machine.detect()
        preflight.validate(config, tiers=self.tiers, ranks=1, engine=False, machine=machine)
        self.layout = config.layout(rank)
        self.page_tokens = self.layout.page_tokens
        host_pages = config.l2_num_pages if "l2" in self.tiers else 0
        # every rank of this node pins its L2 (and holds its L1 when that is on the host):
        # together against the node's total, since its siblings may have allocated already
        need = preflight.memory_need(config, hd.local_world_size(), l2="l2" in self.tiers,
                                     cuda=pick_device(device).type != "cpu")
        if self.draft_spec is not None:  # spec: the draft's pools beside the target's
            from .draft_pages import draft_need
            need = draft_need(need, config, self.draft_spec, host_pages)
        preflight.check_node_memory(need, machine.host_total, "is the node's total")
        fmt = config.page_format  # every pool size below is the format's
        self.l1 = DeviceKVPool.for_format(self.layout, fmt, config.l1.num_pages, device=device)
        self.l2 = HostKVPool.for_format(self.layout, fmt, max(host_pages, 1),
                                        layout_kind=config.l2.layout, pin=config.l2.pin)
        return host_pages

    def _init_request_state(self, config: HiCacheConfig) -> None:
        """Empty request bookkeeping, statistics and failure state."""
        self._reqs: dict[object, _Request] = {}
        self._pending: list[_Request] = []                   # requests waiting on L3
        self._stats = TierStats()
        # Failures: ``_fault`` is this rank's first failure not yet agreed (it rides as the
        # health flag in the next step's all-reduce); ``_failed`` is the agreed failure, after
        # which the cache is stopped on every rank alike (see ``step``).
        self._fault: BaseException | None = None
        self._failed: BaseException | None = None
        self._owned = np.zeros(config.l1.num_pages, dtype=bool)  # pages of admitted requests
        self._released = 0  # times owned pages were released (ends a remembered write check)
        self._writable: np.ndarray | None = None  # the last write's pages found owned ...
        self._writable_at = -1                     # ... at this count of releases

    def _settings_digest(self) -> int:
        """A 60-bit hash of what the replicated controller depends on (equal on every rank)."""
        c, p = self.config, self.config.policy
        key = (self.mode, self.page_tokens, c.l1.num_pages, self.ctrl.host.num_pages,
               repr(p), self.agreement.debug,  # the whole [policy]: every key drives a
               self.weights_signature if self.l3 is not None else "",  # replicated choice
               repr(c.hybrid),
               self.draft_spec.signature if self.draft_spec is not None else "")  # spec
        raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") >> 4

    def _discard(self) -> None:
        """Construction failed (on some rank): close what this rank built, drop its pools."""
        io, self.io = self.io, None
        if io is not None:
            io.close()
        for part in (getattr(self, "states", None), getattr(self, "draft", None)):
            if part is not None:  # the snapshots' and the draft's pools, writers and stores
                part.close()
        self.l1 = self.l2 = self.ctrl = self.transfer = None

    @property
    def l3(self):
        """This rank's L3 store (a ``GuardedStore``), None without L3 or after ``close``."""
        return self.io.l3

    @property
    def observer(self):
        """Event-time observer (hicache.metrics.HiCacheMetrics): observe(name, seconds, label)."""
        return self.io.observer

    @observer.setter
    def observer(self, obs) -> None:
        self.io.observer = obs

    # ---- the engine's API ---------------------------------------------------------------------
    def admit(self, request_id, tokens) -> Prefix:
        """Match ``tokens`` (the prompt) and lock the hit. The last prompt token is never a hit
        (its logits are needed). L2 hits start loading now; an L3 hit is prefetched and becomes
        usable after the next ``step`` on which every rank has it (``prefix.ready``)."""
        self._check_usable("admit")
        if request_id in self._reqs:
            raise UsageError(f"request {request_id!r} is already admitted")
        arr = as_tokens(tokens)
        if arr.size == 0:
            raise UsageError(f"request {request_id!r} has no tokens")
        prefix = Prefix(request_id, int(arr.size))
        req = _Request(prefix, arr)
        self._reqs[request_id] = req
        self._stats.requests += 1
        if self.tiers:
            if self.states is not None:  # hybrid: cut back to the deepest snapshot
                m = hybrid_cache.match(self, arr, prefix)
            else:
                with self._timed():
                    m = self.ctrl.match(arr[:-1], lock=True)
            req.lock = m.lock
            prefix.device_len = m.device_len
            prefix.page_table = m.device_pages.tolist()
            if m.host_len and "l2" in self.tiers:
                with self._timed():
                    op = self.ctrl.load_back(m)
                if op is not None:
                    prefix.host_len = m.host_len
                    prefix.page_table += list(op.device_pages)
                    # the loaded pages now hold these positions
                    self.io.map_chains(prefix.page_table, arr[:prefix.hit_len])
            if self.states is not None:  # no L2 load-back: end at a snapshot in L1
                hybrid_cache.settle(self, arr, prefix)
            loads = self.io.launch(self.ctrl.take_ops())
            req.load_job = loads[-1] if loads else None
            if m.wait_ops:  # device pages still being loaded for an earlier request
                req.load_job = Waits(self.io.jobs_of(m.wait_ops)
                                     + ([req.load_job] if req.load_job else []))
            if self.draft is not None:  # spec: L1/L2 presence came with the loads
                prefix.draft_len = self.draft.present_pages(prefix.page_table, arr) \
                    * self.page_tokens
            if self.l3 is not None:
                req.prefetch = self.io.start_prefetch(request_id, arr, prefix.hit_len)
                if req.prefetch is not None:  # companion reads: started, resolved at a step
                    self._pending.append(req)
                    if self.states is not None:
                        hybrid_cache.find_l3(self, req, arr)
                    if self.draft is not None:
                        req.draft_future = self._read_draft(arr, prefix)
        prefix.ready = req.prefetch is None
        if prefix.ready:
            self._count_hits(prefix)
        self._note("admit", request_id, arr)
        return prefix

    def _note(self, what: str, request_id, tokens: np.ndarray | None = None, *more) -> None:
        """Fold what this rank just did into the step's agreed digest (``StepAgreement.note``):
        ranks that admit other tokens or ids, allocate other lengths or finish otherwise raise
        ``DivergenceError`` at the next step."""
        if self.agreement.local:
            return
        if tokens is not None:
            more = (int(tokens.size),
                    f"{xxhash.xxh3_64_intdigest(np.ascontiguousarray(tokens)):016x}") + more
        self.agreement.note(what, repr(request_id), *more)

    def l1_hit_now(self, request_id) -> int:
        """Tokens of the admitted request's prompt that L1 holds from its start now (what
        ``admit`` would find on the device if called again; its last token is never a hit).
        Replicated like the controller: every rank returns the same. A request waiting for L1
        room is worth re-admitting (``abort`` then ``admit``) when this exceeds its
        ``prefix.hit_len``: a request that finished meanwhile put its prefix on the device."""
        self._check_usable("l1_hit_now")
        return self.peek(self._req(request_id).tokens)[0]

    def peek(self, tokens) -> tuple[int, int]:
        """``(device_len, host_len)``: the L1 and L2 hit ``admit(tokens)`` would find now, with
        nothing changed (no lock, no load, no LRU touch): a scheduler asks it before admitting
        a request only if it fits. Replicated like the controller."""
        self._check_usable("peek")
        arr = as_tokens(tokens)
        if not self.tiers or arr.size == 0:
            return 0, 0
        with self._timed():
            dev, host = self.ctrl.peek(arr[:-1])
            if self.states is not None:
                usable = hybrid_cache.usable_len(self, arr[:-1])
                dev, host = min(dev, usable), max(0, min(host, usable - dev))
        return dev, (host if "l2" in self.tiers else 0)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports prefill speed; with the store's read speed it decides whether an
        L3 hit is worth loading (a disk-backed hit can be slower than recomputing)."""
        self.io.observe_prefill(tokens, seconds)

    def observe_step(self, seconds: float) -> None:
        """The engine reports how long a scheduler step took. A request whose L3 read is in
        flight at its admission starts its prefill a step later than a recompute would (its
        read is agreed at the next step): the cost model counts that step in a load's cost, so
        a short L3 hit is recomputed rather than waited for."""
        self.io.observe_step(seconds)

    def alloc(self, request_id, n_tokens: int) -> list[int]:
        """Grow the request's page table to hold ``n_tokens`` tokens in all; the new pages.
        Raises DeviceFullError (retry after a ``step``) when L1 has no room even after eviction."""
        self._check_usable("alloc")
        req = self._req(request_id)
        if not req.prefix.ready:
            raise UsageError(f"alloc for request {request_id!r} before prefix.ready: its L3 "
                             "restore is not agreed yet (call step() until it is ready)")
        need = -(-n_tokens // self.page_tokens) - len(req.prefix.page_table)
        if need <= 0:
            self._note("alloc", request_id, None, n_tokens, 0)
            return []
        with self._timed():
            pages = self.ctrl.alloc_device(need)
        self.io.unmap(pages)
        self.kv.forget(pages)
        if self.draft is not None:
            self.draft.forget(pages)
        self.io.launch(self.ctrl.take_ops())
        self._owned[pages] = True
        req.own_pages += pages
        req.prefix.page_table += pages
        self._note("alloc", request_id, None, n_tokens, len(pages))
        return pages

    @functools.cached_property
    def kv(self) -> CheckedPort:
        """The engine's KV port (``hicache.kvport``): this rank's L1 with its layout, device and
        dtype; a write is refused (HiCacheError) unless every page it touches is one ``alloc``
        gave an admitted request (never a cached page). Hand it to the engine, not ``l1``."""
        return CheckedPort(self.l1, self._check_writable)

    def _check_writable(self, pages: np.ndarray) -> None:
        self._check_usable("write_kv")
        at = self._released  # read before the check: a release during it ends the memo
        if pages is self._writable and at == self._writable_at:
            return  # the same write's next layer, and no page was released since
        bad = pages[~self._owned[pages]]
        if bad.size:
            raise UsageError(f"write_kv into device page {int(bad[0])}, which no admitted "
                             "request owns (a cached page or a free one): only pages "
                             "from alloc() take new KV")
        if checked_once(pages):
            self._writable, self._writable_at = pages, at

    def write_kv(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Keep this rank's owned rows of ``rows`` ([n, kv_dim]) at virtual ``slots``. Every
        slot must lie in a page ``alloc`` gave an admitted request (never a cached page).
        The same path as ``kv.write``."""
        self._check_usable("write_kv")
        return self.kv.write(layer, slots, rows)

    def check(self) -> None:
        """Check the controller's invariants (tree, locks, pools); raises on the first broken."""
        self.ctrl.check()

    @property
    def request_pages(self) -> int:
        """Device pages held by admitted requests and not in the cache tree (0 when idle)."""
        return len(self.ctrl.request_pages)

    def leaks(self) -> dict:
        """At a quiet point (no request admitted): pages of each tier in use but not held by the
        cache tree, and open locks (requests' and tree nodes'); all 0 when nothing leaked.
        Checks the controller's invariants first."""
        self.check()
        nodes = list(self.ctrl.iter_nodes())
        dev = sum(len(nd.device) for nd in nodes if nd.device is not None)
        host = sum(len(nd.host) for nd in nodes if nd.host is not None)
        return {"l1": self.ctrl.device.num_used - dev, "l2": self.ctrl.host.num_used - host,
                "locks": self.stats()["locks"] + sum(1 for nd in nodes if nd.lock_ref > 0)}

    def wait_layer(self, request_id, layer: int) -> None:
        """Before attention of ``layer``: wait until the request's loaded pages hold it. A load
        that failed does NOT raise here (the engine is between collectives, and the other ranks
        would wait in the next one): it is recorded, the rank computes on whatever the pages
        hold, and every rank raises at the next ``step()``, before any token is returned."""
        job = self._req(request_id).load_job
        if job is not None:
            try:
                job.wait_layer(layer)
            except TransferError as err:
                self._record(err)

    def snapshot_positions(self, request_id, end: int) -> list[int]:
        """Hybrid models: the positions in ``(hit, end]`` whose KDA state the engine should
        hand to ``finish`` (empty for other models). Replicated."""
        return hybrid_cache.positions(self, request_id, end)

    def finish(self, request_id, tokens, snapshots=None, draft_len: int = 0) -> None:
        """The request is done; ``tokens`` are those whose KV is in its pages (prompt plus the
        generated tokens that were fed back). Whole pages are cached; the rest is freed.
        ``snapshots`` (hybrid models): position -> the KDA state ``(conv, rec)`` after it.
        ``draft_len`` (spec): the leading tokens whose draft KV the drafter wrote; the
        request's own whole pages below it keep their draft pages."""
        if self._closed:
            raise UsageError("finish after close()")
        req = self._reqs.get(request_id)
        if req is None:
            raise UsageError(f"finish of unknown request {request_id!r}")
        arr = as_tokens(tokens)
        self._check_finish(request_id, req, arr)  # everything that can refuse, before any change
        del self._reqs[request_id]
        self._note("finish", request_id, arr)
        if req.prefetch is not None:  # finished before its prefetch resolved
            self.io.cancel_prefetch(req.prefetch)
            self._pending.remove(req)
            for f in (req.draft_future, req.state_find):  # companion reads: dropped
                if f is not None:
                    f.cancel()  # one running ends on its thread; its result is dropped
        if req.load_job is not None:
            try:
                req.load_job.wait()
            except TransferError as err:  # agreed at the next step; the bookkeeping goes on
                self._record(err)
        self._owned[req.own_pages] = False
        self._released += 1  # a write checked before may touch these pages no more
        table = req.prefix.page_table
        whole = min(arr.size // self.page_tokens, len(table))
        if self._failed is not None:  # stopped: insert nothing, only release
            with self._timed():
                if req.lock is not None:
                    self.ctrl.unlock(req.lock)
                if req.own_pages:
                    self.ctrl.free_device(req.own_pages)
            return
        if self.draft is not None:
            self._mark_drafts(req, min(int(draft_len), whole * self.page_tokens), arr)
        if self.tiers:
            end = whole * self.page_tokens  # the insert releases the lock (walks on from it)
            with self._timed():
                res = self.ctrl.insert(arr[:end], table[:whole], after=req.lock)
            self.io.map_chains(res.device_pages.tolist(), arr[:end])
            if self.states is not None:
                hybrid_cache.attach(self, arr[:end], snapshots)
            own = set(req.own_pages)
            tail = [p for p in table[whole:] if p in own]
            self.io.launch(self.ctrl.take_ops())
        else:
            tail = req.own_pages
        if tail:
            with self._timed():
                self.ctrl.free_device(tail)

    def _check_finish(self, request_id, req: _Request, arr: np.ndarray) -> None:
        """UsageError (the request stays admitted, nothing changed) unless ``arr`` may be
        cached for the request: it starts with the admitted prompt, has no negative id, and
        every token past the hit that has a page has KV written at every layer (tokens past
        the page table have nowhere to be and are never cached) (``CheckedPort.unwritten``): a
        page is never cached with rows nobody wrote. A stopped cache caches nothing: only the
        prompt is checked then."""
        n = min(arr.size, req.tokens.size)
        if not np.array_equal(arr[:n], req.tokens[:n]):
            bad = int(np.flatnonzero(arr[:n] != req.tokens[:n])[0])
            raise UsageError(f"finish of request {request_id!r}: token {bad} is {int(arr[bad])} "
                             f"but the admitted prompt has {int(req.tokens[bad])} there")
        if arr.size and arr.min() < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise UsageError(f"finish of request {request_id!r}: token {bad} is {int(arr[bad])};"
                             " token ids are non-negative")
        w, table = self.page_tokens, req.prefix.page_table
        start, end = req.prefix.hit_len, min(int(arr.size), len(table) * w)  # past: no page
        if self._failed is not None or end <= start:
            return
        slots = span_slots(table[start // w:], start, end, w)
        first = self.kv.unwritten(slots)
        if first >= 0:
            raise UsageError(
                f"finish of request {request_id!r}: token {start + first} of {arr.size} has no "
                "KV written at every layer; pass only the tokens whose KV the engine wrote "
                f"(the first {start + first} here)")

    def abort(self, request_id) -> None:
        """Drop an admitted request and cache nothing from it (preemption); a later ``admit``
        of the same request starts afresh and is counted once."""
        if self._closed:
            raise UsageError("abort after close()")
        req = self._req(request_id)
        s, p = self._stats, req.prefix
        s.requests -= 1
        if p.ready:
            s.prompt_tokens -= p.prompt_len
            s.hit_tokens["l1"] -= p.device_len
            s.hit_tokens["l2"] -= p.host_len
            s.hit_tokens["l3"] -= p.storage_len
        self.finish(request_id, [])

    def step(self) -> list:
        """Once per scheduler step on every rank: launch new transfers, agree (one all-reduce)
        on finished transfers and L3 prefetches, apply what every rank finished. Returns the
        prefixes that became ready in this step.

        The same all-reduce carries this rank's health: a copy that failed (or could not be
        issued), a load that failed under ``wait_layer``, an L3 write error. If any rank is
        unhealthy, every rank raises ``TransferError`` here, at the same step, and the cache is
        stopped on every rank: ``finish``/``abort`` then only release locks and pages, every
        other call raises the same error, ``close`` cleans up. Build a new HiCache to go on.
        When the agreement itself finds the ranks diverged (their in-flight ops or extras
        differ, or a rank passed it bad arguments), every rank raises ``DivergenceError`` at
        the same step and the cache stops the same way."""
        self._check_usable("step")
        self.io.launch(self.ctrl.take_ops())
        done = self.io.poll()  # one state read per copy; failures recorded here
        handles = [r.prefetch.handle for r in self._pending]
        signals = prefetch_signals(handles)
        self._resolve_reads(signals)
        extras = [int(self._fault is None)] + signals
        if self.draft is not None:  # spec: draft pages read, MIN-agreed
            extras += [getattr(r.draft_read, "pages", 0) for r in self._pending]
        if self.states is not None and handles:  # hybrid: the snapshot each L3 read ends at
            extras += hybrid_cache.l3_signals(self._pending)
        t0 = time.perf_counter()
        try:
            res = self.ctrl.agree(self.agreement, done, extras)
        except DivergenceError as err:  # raised on every rank at this step: stop alike
            self._halt(err)
            raise
        dt = time.perf_counter() - t0
        self._stats.agreement_s += dt  # the collective, waits included
        if self.observer is not None:
            self.observer.observe("agreement", dt)
        if res.extras[0] == 0:
            self._stop()
        self.io.complete(res.done_ops)
        ready = []
        n = 1 + 2 * len(handles)
        decisions = agree_prefetch(handles, agreed=list(res.extras[1:n])) if handles else []
        m = n + (len(handles) if self.draft is not None else 0)
        agreed_drafts = list(res.extras[n:m]) or [0] * len(handles)
        if self.states is not None and handles:
            decisions = hybrid_cache.l3_decisions(self, self._pending, decisions,
                                                  res.extras[m:])
        for req, (ok, pages), nd in zip(list(self._pending), decisions, agreed_drafts):
            req.draft_agreed = nd
            if ok and self._restore(req, pages):
                self._pending.remove(req)
                ready.append(req.prefix)
        self.io.launch(self.ctrl.take_ops())
        self._stats.steps += 1
        return ready

    def drain(self) -> None:
        """Wait for every local transfer, ``step`` so all ranks apply them (collective), flush
        the L3 writes that followed, and ``step`` once more so a write error on one rank stops
        every rank alike."""
        self._check_usable("drain")
        self.io.wait_all()  # a failure is reported by the step below, on every rank at once
        self.step()
        if self.io.writer is not None:  # replicated: every rank takes this branch
            self.io.flush_writes()
            self.step()

    def prefix(self, request_id) -> Prefix:
        return self._req(request_id).prefix

    def stats(self) -> dict:
        s, io = self._stats, self.io.stats
        ctrl = self.ctrl.stats
        out = {
            "requests": s.requests, "prompt_tokens": s.prompt_tokens,
            "hit_tokens": dict(s.hit_tokens),
            "miss_tokens": s.prompt_tokens - sum(s.hit_tokens.values()),
            "bytes": dict(io.bytes, l3_read=0, l3_write=0),
            "gbps": {d: (io.bytes[d] / io.transfer_s[d] / 1e9 if io.transfer_s[d] else 0.0)
                     for d in ("d2h", "h2d")},
            "evictions": {"l1": ctrl.device_evicted_pages, "l2": ctrl.host_evicted_pages,
                          "l3": 0},
            "corrupt": 0, "l3_errors": 0, "controller_s": s.controller_s, "steps": s.steps,
            "agreement_s": s.agreement_s,
            "restore_wait_steps": s.restore_wait_steps, "restore_fallbacks": s.restore_fallbacks,
            "pages": {"l1": self.ctrl.device.num_used, "l2": self.ctrl.host.num_used},
            # list() copies in one step: a metrics scrape may call stats() from another thread
            "locks": sum(1 for r in list(self._reqs.values()) if r.lock is not None),
            "failed_copies": dict(io.failed_copies), "prefetch": dict(io.prefetch),
            "transfer_s": dict(io.transfer_s),
            # copy ops the controller issued: backups (d2h) and L2 load-backs (h2d)
            "copy_ops": {"d2h": ctrl.backups, "h2d": ctrl.loads},
        }
        if self.states is not None:  # hybrid models: KDA state snapshots
            out["hybrid"] = self.states.report()
        if self.draft is not None:  # spec: the draft's companion pages, by tier
            out["draft"] = self.draft.report()
        if self.l3 is not None:
            l3 = self.l3.stats
            out["evictions"]["l3"] = l3.evictions
            out["corrupt"] = l3.corrupt
            out["l3_auth_failures"] = l3.auth_failures  # forged or stale values (misses)
            out["l3_where"] = self.l3.where  # the store, no password
            out["l3_error"] = self.l3.first_error  # the first failure or unavailable call
            out["l3_errors"] = l3.errors  # calls that found the store unavailable (misses)
            out["bytes"]["l3_read"] = l3.bytes_read
            out["bytes"]["l3_write"] = l3.bytes_written
            out["l3_failures"] = self.l3.failures  # store errors raised (the first ends L3)
            out["transfer_s"].update(l3_read=l3.read_s, l3_write=l3.write_s)
        return out

    def close(self, flush: bool = True) -> None:
        """Finish transfers, apply them and flush their L3 writes (``drain``). Every rank calls
        ``close``, and the flush is agreed first (one collective): only when every rank closes
        with ``flush`` does any rank flush. ``flush=False`` (after an error) never raises on
        this rank, and makes every other rank skip the flush too and raise ``PeerError`` naming
        this rank. A stopped cache (an agreed failure) only waits for local copies, with no
        collective. Safe to call twice."""
        self._close(flush, None)

    def __enter__(self) -> "HiCache":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving the block by an exception is agreed like ``close(flush=False)``: the other
        ranks skip their flush and raise ``PeerError`` (rank, exception class) at their own
        close, or ``DivergenceError`` at the step they are in; this rank's exception goes on."""
        self._close(exc_type is None, exc)

    def _close(self, flush: bool, error: BaseException | None) -> None:
        if self._closed:
            return
        try:
            if self._agree_close(flush, error) and (self.ctrl.inflight_ops()
                                                    or self.io.writer is not None):
                self.drain()  # replicated condition: every rank takes this branch
        finally:
            self._closed = True
            self.io.close()  # copies stop before the pools go; failures were reported already
            if self.states is not None:
                self.states.close()
            if self.draft is not None:
                self.draft.close()

    def _agree_close(self, flush: bool, error: BaseException | None) -> bool:
        """Whether every rank flushes (the same answer on every rank), raising ``PeerError`` on
        a rank that closes normally when another does not. One all-reduce, of the same size as
        every agreement's (``minvec.CLOSE``): a rank still stepping gets the closing rank's
        fault (or the close kind) and raises ``DivergenceError`` at that step, instead of a
        mismatched collective."""
        if self._failed is not None:  # stopped at an agreed step: alike on every rank
            return False
        a = self.agreement
        if a.local:
            return flush and error is None
        code = outcome.code_of(error) if error is not None else 0 if flush else \
            outcome.SKIP_FLUSH
        try:
            res = hd.agree_min_on(a._ctl, a.rank, (), (), code=code, kind=minvec.CLOSE)
        except hd.KindMismatch as e:
            if code:  # this rank is failing already: its own error goes on
                return False
            if e.other == minvec.STEP:
                raise DivergenceError("HiCache close: another rank is still stepping while "
                                      "this rank closes; every rank stops here (no flush)"
                                      ) from None
            raise hd.KindMismatch(e.kind, e.rank, e.other, e.other_rank, e.fault,
                                  where="HiCache close") from None
        except Exception:
            if code:
                return False
            raise
        if code:
            return False
        if res.fault is not None:
            rank, first = res.fault
            raise PeerError("HiCache close", rank,
                            outcome.describe(first) or f"fault {first}") from None
        return True

    # ---- internals ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self):
        """Time the controller calls inside (the figure hicache-bench reports per request)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._stats.controller_s += time.perf_counter() - t0

    def _record(self, err: BaseException) -> None:
        """This rank failed: keep going in lockstep, say so at the next step's agreement."""
        if self._fault is None:
            self._fault = err

    def _stop(self) -> None:
        """Some rank is unhealthy (agreed): stop this cache and raise, on every rank alike."""
        step = self._stats.steps
        if self._fault is not None:
            err = TransferError(f"step {step}: this rank failed: {self._fault}")
            cause = self._fault
        else:
            err = TransferError(f"step {step}: a transfer failed on another rank of the DCP "
                                "group; stopping at the same step")
            cause = None
        err.__cause__ = cause
        self._halt(err)
        raise err

    def _halt(self, err: BaseException) -> None:
        """Stop this cache after the agreed failure ``err`` (every rank stops at this step):
        ``finish``/``abort`` then only release, other calls raise, ``close`` cleans up."""
        self._failed = err
        for req in self._pending:  # nothing more is restored
            req.prefetch.handle.cancel(wait=False)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"{what} after close()")
        if self._failed is not None:  # the same kind of error as the agreed failure
            kind = DivergenceError if isinstance(self._failed, DivergenceError) else TransferError
            raise kind(f"{what}: the cache stopped after a failure "
                       f"({self._failed})") from self._failed

    def _req(self, request_id) -> _Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise UsageError(f"unknown request {request_id!r}") from None

    def _restore(self, req: _Request, pages: int) -> bool:
        """Every rank holds ``pages`` prefetched pages: copy them into fresh device pages (a
        transfer job: ``wait_layer`` waits for it like for a load). False (retry at a later
        step) while L1 has no room; after ``RESTORE_RETRIES`` steps the tokens are recomputed
        instead. Both decisions follow the replicated controller state."""
        prefix = req.prefix
        try:
            with self._timed():
                dev = self.ctrl.alloc_device(pages)
            self.io.unmap(dev)
        except DeviceFullError:
            req.restore_tries += 1
            prefix.room_wait = req.restore_tries
            self._stats.restore_wait_steps += 1
            if req.restore_tries <= RESTORE_RETRIES:
                self.io.launch(self.ctrl.take_ops())
                return False
            dev, pages = [], 0
            self._stats.restore_fallbacks += 1
        self.io.launch(self.ctrl.take_ops())
        if self.draft is not None:  # spec: the agreed draft pages come with the target's
            self._restore_drafts(req, dev, pages)
        if pages:
            req.load_job = join(req.load_job, self.io.restore(req.prefetch, dev))
            self.kv.fill(dev)
            self._owned[dev] = True
            req.own_pages += dev
            prefix.page_table += dev
            prefix.storage_len = pages * self.page_tokens
            if self.states is not None:
                hybrid_cache.restored_l3(self, req)
        self.io.end_prefetch(req.prefetch)
        req.prefetch = None
        prefix.ready = True
        self._count_hits(prefix)
        return True

    # ---- spec: the draft's companion pages (hicache/draft_pages.py) ----------------------------
    def _read_draft(self, arr: np.ndarray, prefix: Prefix):
        """Start reading the L3 draft pages after the L1/L2 hit, when that hit has all its draft
        pages: a Future (``DraftPages.start_read_l3``), resolved by ``_resolve_reads``."""
        if prefix.draft_len < prefix.hit_len:
            return None
        from .l3 import chain_hashes
        w, first = self.page_tokens, prefix.hit_len // self.page_tokens
        chains = chain_hashes(arr[:-1], w)[first:]
        nxt = arr[(np.arange(first, first + len(chains)) + 1) * w]  # the token after each
        return self.draft.start_read_l3(chains, nxt)

    def _resolve_reads(self, signals: list) -> None:
        """The companion reads (draft pages, KDA snapshot) of each request whose target
        prefetch is ready on this rank (``signals``: ``prefetch_signals``), waited for within
        the prefetch's deadline: only a step where every rank is ready restores, so each rank
        then contributes what its read found (a timeout or an error: nothing, which the MIN
        makes a miss on every rank alike)."""
        for i, req in enumerate(self._pending):
            if not signals[2 * i]:
                continue
            if req.draft_future is not None:
                req.draft_read = self._await(req.draft_future, None, "draft pages", req)
                req.draft_future = None
            if self.states is not None:
                hybrid_cache.resolve_l3(req, lambda f, d, what: self._await(f, d, what, req))

    @staticmethod
    def _await(future, default, what: str, req: _Request):
        """``future``'s result within the request's prefetch deadline, else ``default``."""
        bound = req.prefetch.handle.policy.deadline_s(int(req.tokens.size))
        try:
            return future.result(timeout=bound)
        except Exception as err:  # noqa: BLE001 (a timeout or the read's error: a miss here)
            future.cancel()
            log.warning("L3 read of the %s of request %r: %s (recomputed)", what,
                        req.prefix.request_id, err or type(err).__name__)
            return default

    def _restore_drafts(self, req: _Request, dev: list, pages: int) -> None:
        """The agreed L3 draft pages (at most the target's restored ``pages``) into ``dev``;
        they extend ``draft_len`` only when the L1/L2 hit had all its draft pages."""
        self.draft.forget(dev)
        n = self.draft.restore(req.draft_read, dev, min(pages, req.draft_agreed))
        if req.prefix.draft_len == req.prefix.hit_len:
            req.prefix.draft_len += n * self.page_tokens
        req.draft_read = None

    def _mark_drafts(self, req: _Request, draft_len: int, arr: np.ndarray) -> None:
        """The request's own pages wholly below ``draft_len`` hold their draft KV (with the
        token after each page, -1 past ``arr``)."""
        w, own = self.page_tokens, set(req.own_pages)
        idx = [i for i, p in enumerate(req.prefix.page_table[:draft_len // w]) if p in own]
        self.draft.mark([req.prefix.page_table[i] for i in idx],
                        [int(arr[(i + 1) * w]) if (i + 1) * w < arr.size else -1 for i in idx])

    def _count_hits(self, prefix: Prefix) -> None:
        """Counted once the prefix is final, so hit + miss == prompt tokens of ready requests
        (a request still waiting on L3 is in neither)."""
        self._stats.prompt_tokens += prefix.prompt_len
        hits = self._stats.hit_tokens
        hits["l1"] += prefix.device_len
        hits["l2"] += prefix.host_len
        hits["l3"] += prefix.storage_len


def _checkpoint_signature(config: HiCacheConfig, mode: str) -> str:
    """With L3 on and no signature given, the checkpoint ``[model] path`` names (by content,
    never by path: the engine's own ``MLAModel.weights_signature()`` for it); else ""."""
    if not config.model.path or "l3" not in CACHE_MODES[mode]:
        return ""
    from .checkpoints.signature import weights_signature
    return f"mla-file:{weights_signature(config.model.path)}"
