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
(``hicache/tier_io.py``); the only collective is the agreement's one all-reduce per ``step``,
plus one agreed checkpoint at construction and one at ``close`` (``hicache/facade``). What is
kept beside the target KV (a draft's pages, KDA snapshots) are companions
(``hicache/companions``): the service loops over them and knows none by name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from .companions import (Host, agreed_of, build_all, controller_options,
                         step_fields)
from .config import HiCacheConfig
from .controller import CacheController
from .errors import DivergenceError, TransferError, UsageError
from .facade import lifecycle, report, restore
from .facade.lifecycle import CACHE_MODES
from .facade.finish import check_finish
from .facade.request import TIERS, Prefix, Request, TierStats
from .ids import tree_tokens
from .facade.owners import PageOwners
from .facade.restore import RESTORE_RETRIES
from .kvport import CheckedPort
from .l3 import agree_prefetch, prefetch_signals
from .tier_io import PREFETCH_OUTCOMES, TierIO, Waits
from . import at_exit, tenancy

log = logging.getLogger("hicache")
__all__ = ["HiCache", "Prefix", "CACHE_MODES", "TIERS", "RESTORE_RETRIES", "PREFETCH_OUTCOMES"]


class HiCache:
    """One rank's cache hierarchy. ``mode`` picks the tiers: recompute, l1, l1+l2, l1+l2+l3
    (default: l1+l2, plus l3 when the policy file enables it). ``weights_signature`` (default:
    the policy's ``[model] signature``) names the weights in the L3 keys, so a store written by
    other weights of the same shapes never hits; L3 refuses to start without one.

    Companions (``hicache.companions``) keep state beside the target KV under the same page
    ids: KDA snapshots when the policy names a hybrid checkpoint, a draft's KV pages with
    ``draft`` (a ``DraftSpec``), and any kind ``companions`` makes (factories ``Host ->
    Companion``); ``companion(name)`` gives one, ``finish`` takes each one's value by its
    ``finish_arg`` keyword, ``stats()[name]`` its report."""

    def __init__(self, config: HiCacheConfig, rank: int = 0, group=None, *,
                 mode: str | None = None, device: str | torch.device | None = None,
                 replica: tuple[int, int] = (0, 1), debug: bool = False,
                 weights_signature: str | None = None, draft=None, companions=()) -> None:
        # Construction is agreed (``lifecycle.agree_construction``): a failure on one rank is
        # raised on every rank, what was built is closed on every rank.
        self._closed = True  # until built: close() has nothing to do
        self.io: TierIO | None = None
        self.draft_spec, self._extra = draft, tuple(companions)  # what the companions are
        self.companions: list = []
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        error: BaseException | None = None
        try:
            self._build(config, rank, group, world, mode, device, replica, debug,
                        weights_signature)
        except BaseException as e:  # agreed below, then raised on this rank
            error = e
        lifecycle.agree_construction(self, error, group, world, debug)
        self._closed = False
        at_exit.close_at_exit(self)  # still open when the interpreter exits: closed first

    def _build(self, config: HiCacheConfig, rank: int, group, world: int, mode: str | None,
               device, replica: tuple[int, int], debug: bool,
               weights_signature: str | None) -> None:
        """This rank's part of the construction (no collective): checks, pools, controller,
        transfers and L3 store."""
        mode, weights_signature = lifecycle.check_args(config, world, mode, replica,
                                                       weights_signature)
        self.weights_signature = weights_signature
        self.config, self.rank, self.group, self.mode = config, rank, group, mode
        # (id, count) among the TP replicas of this shard that share this rank's L3 store (one
        # writer per page per store: l3.store_replica computes it from the ranks' nodes)
        self.replica = replica
        self.tiers = CACHE_MODES[mode]
        host_pages = lifecycle.build_pools(self, config, rank, device)
        self.ctrl = CacheController(self.page_tokens, config.l1.num_pages, host_pages,
                                    policy=config.policy,
                                    **controller_options(config, self.tiers))
        self._init_request_state(config)
        # KV events (group rank 0, [events] endpoint): the controller's tier changes, L3 writes
        self.events = tenancy.open_events(config, rank, replica, self.page_tokens, self.ctrl)
        # the bytes: transfers, L3 store, writer, prefetcher, restores (hicache/tier_io.py)
        self.io = TierIO(config, rank, self.l1, self.l2, self.page_tokens, self._record,
                         replica=replica, l3="l3" in self.tiers,
                         weights_signature=weights_signature)
        self.io.events = self.events
        self.transfer = self.io.transfer
        self.namespace = self.io.namespace
        self._host = Host(config, rank, replica, self.page_tokens, self.tiers, self.ctrl,
                          self.io, self.l1.device, weights_signature, self._record,
                          self._timed, self._pages.owned, self._pages.held,
                          self._check_usable)
        # what the cache keeps beside the target KV, in every tier (hicache.companions)
        self.companions = self.io.companions = build_all(self._host, self.draft_spec,
                                                         host_pages, self._extra)

    def _settings_digest(self) -> int:  # what every rank's controller depends on, hashed
        return lifecycle.settings_digest(self)

    def _discard(self) -> None:  # construction failed (on some rank): close what was built
        lifecycle.discard(self)

    def _init_request_state(self, config: HiCacheConfig) -> None:
        """Empty request bookkeeping, statistics and failure state."""
        self._reqs: dict[object, Request] = {}
        self._pending: list[Request] = []                   # requests waiting on L3
        self._stats = TierStats()
        self.events = None
        # Failures: ``_fault`` is this rank's first failure not yet agreed (it rides as the
        # health flag in the next step's all-reduce); ``_failed`` is the agreed failure, after
        # which the cache is stopped on every rank alike (see ``step``).
        self._fault: BaseException | None = None
        self._failed: BaseException | None = None
        self._pages = PageOwners(config.l1.num_pages, self._check_usable)
        self._owned = self._pages.owned  # pages admitted requests own (alloc, restore)

    def companion(self, name: str):
        """The companion named ``name`` (``"draft"``, ``"hybrid"``, ...), or None."""
        return next((c for c in self.companions if c.name == name), None)

    @property
    def draft(self):
        """The draft's pages (``companions.draft.DraftPages``; the drafter writes ``kv``)."""
        return self.companion("draft")

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
    def admit(self, request_id, tokens, scope=None, public_tokens: int = 0) -> Prefix:
        """Match ``tokens`` (the prompt) and lock the hit. The last prompt token is never a hit
        (its logits are needed). L2 hits start loading now; an L3 hit is prefetched and becomes
        usable after the next ``step`` on which every rank has it (``prefix.ready``).

        ``scope`` (bytes or str; None: ``[tenancy] default_scope``, else the shared scope):
        the request matches and caches pages only in its scope, in every tier; its first
        ``public_tokens`` (rounded down to whole pages) are matched and cached in the shared
        scope (a system prompt every tenant sends, prefilled once)."""
        self._check_usable("admit")
        if request_id in self._reqs:
            raise UsageError(f"request {request_id!r} is already admitted")
        arr = tree_tokens(tokens)
        if arr.size == 0:
            raise UsageError(f"request {request_id!r} has no tokens")
        sc = tenancy.request_scope(self.config, scope, public_tokens, self.page_tokens)
        prefix = Prefix(request_id, int(arr.size))
        req = Request(prefix, arr, page_tokens=self.page_tokens, scope=sc)
        self._reqs[request_id] = req
        self._stats.requests += 1
        if self.tiers:
            with self._timed():  # a companion may end the hit earlier (at a snapshot)
                end = self._cap(arr[:-1], req)
                m = self.ctrl.match(arr[:end], lock=True, scope=sc)
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
                    self.io.map_chains(prefix.page_table, req.chains(arr[:prefix.hit_len]))
            loads = self.io.launch(self.ctrl.take_ops())
            for c in self.companions:  # their part of the hit (presence came with the loads)
                c.settle(self._host, req)
            self._pages.hold(prefix.page_table)
            req.load_job = loads[-1] if loads else None
            if m.wait_ops:  # device pages still being loaded for an earlier request
                req.load_job = Waits(self.io.jobs_of(m.wait_ops)
                                     + ([req.load_job] if req.load_job else []))
            if self.l3 is not None:
                req.prefetch = self.io.start_prefetch(request_id, req.chains(arr[:-1]),
                                                      prefix.hit_len)
                if req.prefetch is not None:  # companion reads: started, resolved at a step
                    self._pending.append(req)
                    for c in self.companions:
                        c.start_read(self._host, req)
        prefix.ready = req.prefetch is None
        if prefix.ready:
            report.count_hits(self._stats, req)
        self._note("admit", request_id, arr, *tenancy.scope_note(sc))
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
        req = self._req(request_id)
        return self._peek(req.tokens, req.scope)[0]

    def peek(self, tokens, scope=None, public_tokens: int = 0) -> tuple[int, int]:
        """``(device_len, host_len)``: the L1 and L2 hit ``admit(tokens, scope,
        public_tokens)`` would find now, with nothing changed (no lock, no load, no LRU
        touch): a scheduler asks it before admitting a request only if it fits. Replicated
        like the controller."""
        self._check_usable("peek")
        return self._peek(tokens, tenancy.request_scope(self.config, scope, public_tokens,
                                                        self.page_tokens))

    def _peek(self, tokens, sc) -> tuple[int, int]:
        arr = tree_tokens(tokens)
        if not self.tiers or arr.size == 0:
            return 0, 0
        with self._timed():
            dev, host = self.ctrl.peek(arr[:-1], sc)
            usable = self._cap(arr[:-1], scope=sc)
            dev, host = min(dev, usable), max(0, min(host, usable - dev))
        return dev, (host if "l2" in self.tiers else 0)

    def _cap(self, query: np.ndarray, req: Request | None = None, scope=None) -> int:
        """The longest hit of ``query`` every companion can serve (with ``req``: admission,
        where a companion remembers what it found; without: in ``scope``)."""
        end = int(query.size)
        for c in self.companions:
            cap = c.cap(self._host, query, req, scope)
            if cap is not None:
                end = min(end, cap)
        return end

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
        for c in self.companions:  # afresh: none of their data either
            c.forget(pages)
        self.io.launch(self.ctrl.take_ops())
        self._pages.take(pages)
        req.own_pages += pages
        req.prefix.page_table += pages
        self._note("alloc", request_id, None, n_tokens, len(pages))
        return pages

    @functools.cached_property
    def kv(self) -> CheckedPort:
        """The engine's KV port (``hicache.kvport``): this rank's L1 with its layout, device and
        dtype; a write is refused (HiCacheError) unless every page it touches is one ``alloc``
        gave an admitted request (never a cached page). Hand it to the engine, not ``l1``."""
        return CheckedPort(self.l1, self._pages.check_writable)

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
        """At a quiet point (no request admitted): pages of each tier in use but not held by
        the cache tree, and open locks (requests' and tree nodes'); all 0 when nothing leaked.
        Checks the controller's invariants first."""
        return report.leaks_of(self)

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
        hand to ``finish`` (empty for other models). Replicated. (The serving loop's name for
        ``companion("hybrid").positions``.)"""
        snaps = self.companion("hybrid")
        if snaps is None:
            return []
        return snaps.positions(self._host, self.prefix(request_id).hit_len, end)

    def finish(self, request_id, tokens, snapshots=None, **handed) -> None:
        """The request is done; ``tokens`` are those whose KV is in its pages (prompt plus the
        generated tokens that were fed back). Whole pages are cached; the rest is freed. Each
        companion takes its value by its ``finish_arg`` keyword, in the step's content digest:
        ``snapshots`` (hybrid; also 3rd positional): position -> the KDA state ``(conv, rec)``
        after it; ``draft_len`` (spec): the leading tokens whose draft KV the drafter wrote at
        every draft layer (the request's own whole pages below it keep their draft pages)."""
        if self._closed:
            raise UsageError("finish after close()")
        req = self._reqs.get(request_id)
        if req is None:
            raise UsageError(f"finish of unknown request {request_id!r}")
        arr = tree_tokens(tokens)
        if snapshots is not None:
            handed["snapshots"] = snapshots
        # everything that can refuse, before any change
        values = check_finish(request_id, req, arr, handed, kv=self.kv, host=self._host,
                              companions=self.companions, stopped=self._failed is not None)
        del self._reqs[request_id]
        self._note("finish", request_id, arr,
                   *(v for c in self.companions for v in c.digest(values[c.name])))
        if req.prefetch is not None:  # finished before its prefetch resolved
            self.io.cancel_prefetch(req.prefetch)
            self._pending.remove(req)
            for c in self.companions:  # their reads: dropped
                c.drop(req)
        if req.load_job is not None:
            try:
                req.load_job.wait()
            except TransferError as err:  # agreed at the next step; the bookkeeping goes on
                self._record(err)
        self._pages.release(req.own_pages, req.prefix.page_table)
        self._insert(req, arr, values)

    def _insert(self, req: Request, arr: np.ndarray, values: dict) -> None:
        """Cache the whole pages of ``arr`` (companions: their ``values``), free the rest."""
        table = req.prefix.page_table
        whole = min(arr.size // self.page_tokens, len(table))
        if self._failed is not None:  # stopped: insert nothing, only release
            with self._timed():
                if req.lock is not None:
                    self.ctrl.unlock(req.lock)
                if req.own_pages:
                    self.ctrl.free_device(req.own_pages)
            return
        if self.tiers:
            end = whole * self.page_tokens  # the insert releases the lock (walks on from it)
            with self._timed():
                res = self.ctrl.insert(arr[:end], table[:whole], after=req.lock,
                                       scope=req.scope,
                                       decoded=max(arr.size - req.tokens.size, 0))
            self.io.map_chains(res.device_pages.tolist(), req.chains(arr[:end]))
            for c in self.companions:
                c.finish(self._host, req, arr, end, values[c.name])
            own = set(req.own_pages)
            tail = [p for p in table[whole:] if p in own]
            self.io.launch(self.ctrl.take_ops())
        else:
            tail = req.own_pages
        if tail:
            with self._timed():
                self.ctrl.free_device(tail)

    def abort(self, request_id) -> None:
        """Drop an admitted request and cache nothing from it (preemption); a later ``admit``
        of the same request starts afresh and is counted once."""
        if self._closed:
            raise UsageError("abort after close()")
        req = self._req(request_id)
        self._stats.requests -= 1
        if req.prefix.ready:
            report.count_hits(self._stats, req, -1)
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
        fields = step_fields(self.companions, self._pending, signals)
        extras = [int(self._fault is None)] + signals + fields.pack()
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
        agreed = fields.unpack(res.extras[n:])
        for i, (req, (ok, pages)) in enumerate(zip(list(self._pending), decisions)):
            for c in self.companions:  # each may cut the pages restored (by its own fields)
                pages = c.decide(self._host, req, agreed_of(agreed, c.name, i), pages)
            if ok and self._restore(req, pages):
                self._pending.remove(req)
                ready.append(req.prefix)
        self.io.launch(self.ctrl.take_ops())
        self._stats.steps += 1
        if self.events is not None:  # this step's tier changes: one batch
            self.events.flush(time.time())
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

    def purge_l3(self) -> int:
        """Delete this cache's target pages from L3 (every rank its own; call on every rank at
        the same point, like ``step``): the queued L3 writes land first (``drain``), and the
        KV events say the pages are gone (``hicache.tenancy.purge_l3``). This rank's count."""
        self._check_usable("purge_l3")
        if self.l3 is None:
            raise UsageError("purge_l3: this cache has no L3 tier")
        self.drain()
        return tenancy.purge_l3(self)

    def prefix(self, request_id) -> Prefix:  # what admit found, updated as steps agree
        return self._req(request_id).prefix

    def stats(self) -> dict:
        """Hits, bytes, copy times, evictions, pages and locks (``hicache.facade.report``);
        each companion's report under its name, the L3 store's with L3 on."""
        return report.stats_of(self)

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
            if lifecycle.agree_close(self, flush, error) and (self.ctrl.inflight_ops()
                                                    or self.io.writer is not None):
                self.drain()  # replicated condition: every rank takes this branch
        finally:
            lifecycle.close_local(self)

    def _close_at_exit(self) -> None:
        """Still open at interpreter exit: closed locally first (``hicache.at_exit``)."""
        if not self._closed:
            lifecycle.close_local(self)

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

    def _req(self, request_id) -> Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise UsageError(f"unknown request {request_id!r}") from None

    def _restore(self, req: Request, pages: int) -> bool:  # hicache.facade.restore
        return restore.restore(self, req, pages)
