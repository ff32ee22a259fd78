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
The controller is replicated bookkeeping; data moves per rank with no collective; the only
collective is the agreement's one all-reduce per ``step``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import distributed as hd
from . import preflight
from .config import ConfigError, HiCacheConfig
from .controller import BackupOp, CacheController, DeviceFullError, StepAgreement
from .controller.tree import as_tokens
from .l1.pool import DeviceKVPool, pick_device
from .l2.pool import HostKVPool, check_host_memory, check_node_memory
from .l2.transfer import DONE, FAILED, TransferEngine, TransferError
from .l3 import (AsyncWriter, CostModel, Namespace, Prefetcher, PrefetchPolicy, agree_prefetch,
                 chain_hashes, keys_for_rank, open_store, prefetch_signals, should_write)
from .l3.guard import GuardedStore

TIERS = ("l1", "l2", "l3")
RESTORE_RETRIES = 64  # steps an agreed L3 restore may wait for L1 room before recomputing
MODES = {"recompute": (), "l1": ("l1",), "l1+l2": ("l1", "l2"), "l1+l2+l3": ("l1", "l2", "l3")}
# done: the read finished before the agreed restore; timeout: the policy stopped waiting first;
# error: the read raised (a shorter hit); below_threshold: fewer than prefetch_min_tokens to read;
# recompute: the cost model said prefill is faster; cancelled: the request ended first.
PREFETCH_OUTCOMES = ("done", "timeout", "error", "below_threshold", "recompute", "cancelled")


class HiCacheError(ValueError):
    """Misuse of the cache API (unknown request, double admit, bad mode)."""


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

    @property
    def hit_len(self) -> int:
        return self.device_len + self.host_len + self.storage_len


@dataclass
class _Request:
    prefix: Prefix
    tokens: np.ndarray              # the prompt, int64
    lock: object = None
    load_job: object = None         # H2D job of the L2 hit
    chains: list = field(default_factory=list)      # L3 chain hashes of whole pages
    prefetch: object = None         # L3 PrefetchHandle
    staging: list = field(default_factory=list)     # reserved host buffers of the prefetch
    own_pages: list = field(default_factory=list)   # pages from alloc_device (not yet in tree)
    restore_tries: int = 0          # steps an agreed L3 restore waited for L1 room


@dataclass
class TierStats:
    hit_tokens: dict = field(default_factory=lambda: {t: 0 for t in TIERS})
    prompt_tokens: int = 0
    requests: int = 0
    bytes: dict = field(default_factory=lambda: {"d2h": 0, "h2d": 0, "l3_read": 0,
                                                 "l3_write": 0})
    transfer_s: dict = field(default_factory=lambda: {"d2h": 0.0, "h2d": 0.0})
    controller_s: float = 0.0      # inside the controller (match, lock, insert, evict, ...)
    agreement_s: float = 0.0       # the per-step collective, waiting on other ranks included
    steps: int = 0
    restore_wait_steps: int = 0    # steps agreed L3 restores waited for L1 room (all requests)
    restore_fallbacks: int = 0     # agreed L3 restores recomputed after RESTORE_RETRIES steps
    failed_copies: dict = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    # L3 prefetch outcomes, one per request that looked L3 up (see PREFETCH_OUTCOMES)
    prefetch: dict = field(default_factory=lambda: {o: 0 for o in PREFETCH_OUTCOMES})


class HiCache:
    """One rank's cache hierarchy. ``mode`` picks the tiers: recompute, l1, l1+l2, l1+l2+l3
    (default: l1+l2, plus l3 when the policy file enables it). ``weights_signature`` (default:
    the policy's ``[model] signature``) names the weights in the L3 keys, so a store written by
    other weights of the same shapes never hits; L3 refuses to start without one."""

    def __init__(self, config: HiCacheConfig, rank: int = 0, group=None, *,
                 mode: str | None = None, device: str | torch.device | None = None,
                 replica: tuple[int, int] = (0, 1), debug: bool = False,
                 weights_signature: str | None = None) -> None:
        if mode is None:
            mode = "l1+l2+l3" if config.l3.enabled else "l1+l2"
        if mode not in MODES:
            raise HiCacheError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        if weights_signature is None:
            weights_signature = config.model.signature
        if not isinstance(weights_signature, str):
            raise HiCacheError(f"weights_signature must be a str, got {weights_signature!r}")
        if "l3" in MODES[mode] and not weights_signature:
            raise ConfigError(
                "model.signature: L3 is enabled but no weights signature is set, so another "
                "checkpoint of the same shapes could be served this one's KV; set [model] "
                "signature (a checkpoint hash or revision) or pass HiCache(weights_signature=...)")
        self.weights_signature = weights_signature
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if world != config.parallel.dcp:
            raise HiCacheError(f"the process group has {world} ranks but parallel.dcp is "
                               f"{config.parallel.dcp}: one HiCache per DCP rank")
        self.config, self.rank, self.group, self.mode = config, rank, group, mode
        if not (len(replica) == 2 and 0 <= replica[0] < replica[1]):
            raise HiCacheError(f"replica must be (id, count) with 0 <= id < count, got {replica}")
        # (id, count) among the TP replicas of this shard that share this rank's L3 store (one
        # writer per page per store: l3.store_replica computes it from the ranks' nodes)
        self.replica = replica
        self._prefill_tok_s = 0.0
        self.tiers = MODES[mode]
        # the checks check-config and hicache-bench run (engine needs aside); this rank's pools
        preflight.validate(config, tiers=self.tiers, ranks=1, engine=False)
        m = config.model
        self.layout = config.layout(rank)
        self.page_tokens = self.layout.virtual_page_size
        host_pages = config.l2_num_pages if "l2" in self.tiers else 0
        # every rank of this node pins its L2 (and holds its L1 when that is on the host)
        l1_host = config.l1.num_pages * config.page_bytes_per_rank \
            if pick_device(device).type == "cpu" else 0
        check_node_memory(host_pages * config.page_bytes_per_rank, l1_host,
                          hd.local_world_size())
        self.l1 = DeviceKVPool(self.layout, m.num_layers, m.kv_dim, m.torch_dtype,
                               config.l1.num_pages, device=device)
        if host_pages:
            check_host_memory(host_pages * self.l1.bytes_per_page)
        self.l2 = HostKVPool(self.layout, m.num_layers, m.kv_dim, m.torch_dtype,
                             max(host_pages, 1), layout_kind=config.l2.layout, pin=config.l2.pin)
        self.transfer = TransferEngine(self.l1, self.l2, io_backend=config.io.backend)
        p = config.policy
        self.ctrl = CacheController(self.page_tokens, config.l1.num_pages, host_pages,
                                    write=p.write, eviction=p.eviction,
                                    selective_threshold=p.selective_threshold,
                                    load_back_threshold=p.load_back_threshold)
        # the control plane runs on CPU tensors: over a gloo twin of an NCCL group (made once)
        self.control_group = hd.control_group(group) if world > 1 else group
        self.agreement = StepAgreement(group=self.control_group, debug=debug, local=world == 1)
        self._reqs: dict[object, _Request] = {}
        self._jobs: dict[int, tuple] = {}   # op id -> (op, job, L3 chains of its device pages)
        self._pending: list = []                             # requests waiting on L3
        self._chain_of_page: dict[int, tuple] = {}  # device page -> (L3 chain, index in prefix)
        self._stats = TierStats()
        self._closed = False
        # Failures: ``_fault`` is this rank's first failure not yet agreed (it rides as the
        # health flag in the next step's all-reduce); ``_failed`` is the agreed failure, after
        # which the cache is stopped on every rank alike (see ``step``).
        self._fault: BaseException | None = None
        self._failed: BaseException | None = None
        self._owned = np.zeros(config.l1.num_pages, dtype=bool)  # pages of admitted requests
        # Event-time observer (hicache.metrics.HiCacheMetrics): observe(name, seconds, label).
        self.observer = None
        self.l3 = self._writer = self._prefetcher = None
        if "l3" in self.tiers:
            self._open_l3()

    # ---- L3 -----------------------------------------------------------------------------------
    def _open_l3(self) -> None:
        c = self.config
        self.namespace = Namespace.from_config(c, model=self.weights_signature)
        # a failing store ends L3 on this rank, never the run (hicache/l3/guard.py)
        self.l3 = GuardedStore(lambda: open_store(c.l3, self.namespace, self.rank), c.l3,
                               self.rank, self.namespace)
        self._writer = AsyncWriter(self.l3)
        p = c.policy
        self._prefetcher = Prefetcher(self.l3, PrefetchPolicy(
            p.prefetch, p.prefetch_timeout_s, p.prefetch_timeout_per_1k_s, p.prefetch_min_tokens))

    def _keys(self, chains: Sequence[bytes]) -> list[bytes]:
        return keys_for_rank(chains, self.namespace, self.rank)

    # ---- the engine's API ---------------------------------------------------------------------
    def admit(self, request_id, tokens) -> Prefix:
        """Match ``tokens`` (the prompt) and lock the hit. The last prompt token is never a hit
        (its logits are needed). L2 hits start loading now; an L3 hit is prefetched and becomes
        usable after the next ``step`` on which every rank has it (``prefix.ready``)."""
        self._check_usable("admit")
        if request_id in self._reqs:
            raise HiCacheError(f"request {request_id!r} is already admitted")
        arr = as_tokens(tokens)
        if arr.size == 0:
            raise HiCacheError(f"request {request_id!r} has no tokens")
        prefix = Prefix(request_id, int(arr.size))
        req = _Request(prefix, arr)
        self._reqs[request_id] = req
        self._stats.requests += 1
        if self.tiers:
            m = self._ctl(self.ctrl.match, arr[:-1])
            req.lock = self._ctl(self.ctrl.lock, m)
            prefix.device_len = m.device_len
            prefix.page_table = m.device_pages.tolist()
            if m.host_len and "l2" in self.tiers:
                op = self._ctl(self.ctrl.load_back, m)
                if op is not None:
                    prefix.host_len = m.host_len
                    prefix.page_table += list(op.device_pages)
                    if self.l3 is not None:  # the loaded pages now hold these positions
                        self._map_chains(prefix.page_table, arr[:prefix.hit_len])
            self._launch(self.ctrl.take_ops(), owner=req)
            if m.wait_ops:  # device pages still being loaded for an earlier request
                req.load_job = _Waits([self._jobs[o][1] for o in m.wait_ops if o in self._jobs]
                                      + ([req.load_job] if req.load_job else []))
            if self.l3 is not None:
                self._start_prefetch(req)
        prefix.ready = req.prefetch is None
        if prefix.ready:
            self._count_hits(prefix)
        return prefix

    def _start_prefetch(self, req: _Request) -> None:
        """Look the pages after the L1/L2 hit up in L3 and start reading them. Whether a request
        waits on L3 depends only on replicated facts (its tokens, the hit, the policy), never on
        this rank's store, so every rank keeps the same pending list; what this rank found is
        MIN-agreed in ``step`` (a rank that lacks a page, or would rather recompute, says 0)."""
        req.chains = chain_hashes(req.tokens[:-1], self.page_tokens)
        first = req.prefix.hit_len // self.page_tokens
        min_tokens = self.config.policy.prefetch_min_tokens
        if (len(req.chains) - first) * self.page_tokens < max(1, min_tokens):
            if len(req.chains) > first:
                self._stats.prefetch["below_threshold"] += 1
            return
        keys = self._keys(req.chains[first:])
        n = self.l3.exists_prefix(keys)
        if n and n * self.page_tokens < min_tokens:
            self._stats.prefetch["below_threshold"] += 1
            n = 0
        elif n and not self._worth_loading(n):
            self._stats.prefetch["recompute"] += 1
            n = 0
        shape = self.namespace.shard_shape
        req.staging = [torch.empty(shape, dtype=self.l1.dtype) for _ in range(n)]
        req.prefetch = self._prefetcher.start(req.prefix.request_id, keys[:n], req.staging)
        self._pending.append(req)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine reports prefill speed; with the store's read speed it decides whether an
        L3 hit is worth loading (a disk-backed hit can be slower than recomputing)."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self._prefill_tok_s = rate if not self._prefill_tok_s else (
                0.8 * self._prefill_tok_s + 0.2 * rate)

    def _worth_loading(self, pages: int) -> bool:
        if not self.config.policy.l3_cost_model:
            return True
        st = self.l3.stats
        if not self._prefill_tok_s or st.bytes_read <= 0 or st.read_s <= 0:
            return True  # nothing measured yet: try the store
        model = CostModel.from_stats(st, self._prefill_tok_s)
        return model.should_load(pages * self.page_tokens, pages * self.namespace.shard_bytes)

    def alloc(self, request_id, n_tokens: int) -> list[int]:
        """Grow the request's page table to hold ``n_tokens`` tokens in all; the new pages.
        Raises DeviceFullError (retry after a ``step``) when L1 has no room even after eviction."""
        self._check_usable("alloc")
        req = self._req(request_id)
        if not req.prefix.ready:
            raise HiCacheError(f"alloc for request {request_id!r} before prefix.ready: its L3 "
                               "restore is not agreed yet (call step() until it is ready)")
        need = -(-n_tokens // self.page_tokens) - len(req.prefix.page_table)
        if need <= 0:
            return []
        pages = self._ctl(self.ctrl.alloc_device, need)
        self._unmap(pages)
        self._launch(self.ctrl.take_ops())
        self._owned[pages] = True
        req.own_pages += pages
        req.prefix.page_table += pages
        return pages

    def write_kv(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Keep this rank's owned rows of ``rows`` ([n, kv_dim]) at virtual ``slots``. Every
        slot must lie in a page ``alloc`` gave an admitted request (never a cached page)."""
        self._check_usable("write_kv")
        v = self.l1._slots(slots)  # int64 [n] on the CPU, range-checked
        if v.numel():
            pages = np.unique((v // self.page_tokens).numpy())
            bad = pages[~self._owned[pages]]
            if bad.size:
                raise HiCacheError(f"write_kv into device page {int(bad[0])}, which no admitted "
                                   "request owns (a cached page or a free one): only pages "
                                   "from alloc() take new KV")
        return self.l1.write(layer, v, rows)

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

    def finish(self, request_id, tokens) -> None:
        """The request is done; ``tokens`` are those whose KV is in its pages (prompt plus the
        generated tokens that were fed back). Whole pages are cached; the rest is freed."""
        if self._closed:
            raise HiCacheError("finish after close()")
        req = self._reqs.get(request_id)
        if req is None:
            raise HiCacheError(f"finish of unknown request {request_id!r}")
        arr = as_tokens(tokens)
        n = min(arr.size, req.tokens.size)
        if not np.array_equal(arr[:n], req.tokens[:n]):
            bad = int(np.flatnonzero(arr[:n] != req.tokens[:n])[0])
            raise HiCacheError(f"finish of request {request_id!r}: token {bad} is {int(arr[bad])} "
                               f"but the admitted prompt has {int(req.tokens[bad])} there")
        del self._reqs[request_id]
        if req.prefetch is not None:  # finished before its prefetch resolved
            req.prefetch.cancel()
            self._stats.prefetch["cancelled"] += bool(req.prefetch.keys)
            self._pending.remove(req)
        if req.load_job is not None:
            try:
                req.load_job.wait()
            except TransferError as err:  # agreed at the next step; the bookkeeping goes on
                self._record(err)
        self._owned[req.own_pages] = False
        table = req.prefix.page_table
        whole = min(arr.size // self.page_tokens, len(table))
        if self._failed is not None:  # stopped: insert nothing, only release
            if req.lock is not None:
                self._ctl(self.ctrl.unlock, req.lock)
            if req.own_pages:
                self._ctl(self.ctrl.free_device, req.own_pages)
            return
        if self.tiers:
            res = self._ctl(self.ctrl.insert, arr[:whole * self.page_tokens], table[:whole])
            if self.l3 is not None:
                self._map_chains(res.device_pages.tolist(), arr[:whole * self.page_tokens])
            own = set(req.own_pages)
            tail = [p for p in table[whole:] if p in own]
            self._ctl(self.ctrl.unlock, req.lock)
            self._launch(self.ctrl.take_ops())
        else:
            tail = req.own_pages
        if tail:
            self._ctl(self.ctrl.free_device, tail)

    def abort(self, request_id) -> None:
        """Drop an admitted request and cache nothing from it (preemption); a later ``admit``
        of the same request starts afresh and is counted once."""
        if self._closed:
            raise HiCacheError("abort after close()")
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
        other call raises the same error, ``close`` cleans up. Build a new HiCache to go on."""
        self._check_usable("step")
        self._launch(self.ctrl.take_ops())
        done = set()
        for o, (_op, job, _c) in self._jobs.items():
            state = job.status()  # one read: a copy failing meanwhile is never seen as done
            if state == DONE:
                done.add(o)
            elif state == FAILED:
                self._record(_job_error(job))
                self._stats.failed_copies["d2h" if isinstance(_op, BackupOp) else "h2d"] += 1
        if self._writer is not None and self._writer.error is not None:
            self._record(self._writer.error)
        handles = [r.prefetch for r in self._pending]
        t0 = time.perf_counter()
        res = self.ctrl.agree(self.agreement, done,
                              [int(self._fault is None)] + prefetch_signals(handles))
        dt = time.perf_counter() - t0
        self._stats.agreement_s += dt  # the collective, waits included
        if self.observer is not None:
            self.observer.observe("agreement", dt)
        if res.extras[0] == 0:
            self._stop()
        for o in res.done_ops:
            self._finished(*self._jobs.pop(o))
        ready = []
        decisions = agree_prefetch(handles, agreed=list(res.extras[1:])) if handles else []
        for req, (ok, pages) in zip(list(self._pending), decisions):
            if ok and self._restore(req, pages):
                self._pending.remove(req)
                ready.append(req.prefix)
        self._launch(self.ctrl.take_ops())
        self._stats.steps += 1
        return ready

    def drain(self) -> None:
        """Wait for every local transfer, ``step`` so all ranks apply them (collective), flush
        the L3 writes that followed, and ``step`` once more so a write error on one rank stops
        every rank alike."""
        self._check_usable("drain")
        for _op, job, _c in list(self._jobs.values()):
            try:
                job.wait()
            except TransferError:
                pass  # reported by the step below, on every rank at once
        self.step()
        if self._writer is not None:  # replicated: every rank takes this branch
            try:
                self._writer.flush()
            except Exception as err:
                self._record(err)
            self.step()

    def prefix(self, request_id) -> Prefix:
        return self._req(request_id).prefix

    def stats(self) -> dict:
        s = self._stats
        ctrl = self.ctrl.stats
        out = {
            "requests": s.requests, "prompt_tokens": s.prompt_tokens,
            "hit_tokens": dict(s.hit_tokens),
            "miss_tokens": s.prompt_tokens - sum(s.hit_tokens.values()),
            "bytes": dict(s.bytes),
            "gbps": {d: (s.bytes[d] / s.transfer_s[d] / 1e9 if s.transfer_s[d] else 0.0)
                     for d in ("d2h", "h2d")},
            "evictions": {"l1": ctrl.device_evicted_pages, "l2": ctrl.host_evicted_pages,
                          "l3": 0},
            "corrupt": 0, "l3_errors": 0, "controller_s": s.controller_s, "steps": s.steps,
            "agreement_s": s.agreement_s,
            "restore_wait_steps": s.restore_wait_steps, "restore_fallbacks": s.restore_fallbacks,
            "pages": {"l1": self.ctrl.device.num_used, "l2": self.ctrl.host.num_used},
            # list() copies in one step: a metrics scrape may call stats() from another thread
            "locks": sum(1 for r in list(self._reqs.values()) if r.lock is not None),
            "failed_copies": dict(s.failed_copies), "prefetch": dict(s.prefetch),
            "transfer_s": dict(s.transfer_s),
        }
        if self.l3 is not None:
            l3 = self.l3.stats
            out["evictions"]["l3"] = l3.evictions
            out["corrupt"] = l3.corrupt
            out["l3_errors"] = l3.errors  # calls that found the store unavailable (misses)
            out["bytes"]["l3_read"] = l3.bytes_read
            out["bytes"]["l3_write"] = l3.bytes_written
            out["l3_failures"] = self.l3.failures  # store errors raised (the first ends L3)
            out["transfer_s"].update(l3_read=l3.read_s, l3_write=l3.write_s)
        return out

    def close(self, flush: bool = True) -> None:
        """Finish transfers, apply them and flush their L3 writes (``drain``: every rank calls
        ``close``). ``flush=False`` (after an error), or a stopped cache, only waits for local
        copies and never raises. Safe to call twice."""
        if self._closed:
            return
        try:
            if flush and self._failed is None and (self.ctrl.inflight_ops()
                                                   or self._writer is not None):
                self.drain()  # replicated condition: every rank takes this branch
        finally:
            self._closed = True
            for _op, job, _c in list(self._jobs.values()):
                try:  # copies must stop before the pools go; a failure was reported already
                    job.wait()
                except Exception:
                    pass
            try:
                if self._writer is not None:
                    self._writer.close()  # flushed by drain; an error was agreed there
            except Exception:
                pass  # only reachable after a failure (flush=False or stopped): reported
            finally:
                if self._prefetcher is not None:
                    self._prefetcher.close()
                    self.l3.close()
                self._writer = self._prefetcher = self.l3 = None
                self.transfer.close()

    def __enter__(self) -> "HiCache":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(flush=exc_type is None)

    # ---- internals ----------------------------------------------------------------------------
    def _map_chains(self, pages: Sequence[int], tokens: np.ndarray) -> None:
        """Device page i of a prefix holds page i of ``tokens``: remember its L3 chain hash, so
        a later backup of the page writes it under the right key."""
        for i, (page, chain) in enumerate(zip(pages, chain_hashes(tokens, self.page_tokens))):
            self._chain_of_page[page] = (chain, i)

    def _unmap(self, pages: Sequence[int]) -> None:
        """Pages handed out afresh hold nothing yet: no backup may use an old key for them."""
        for p in pages:
            self._chain_of_page.pop(p, None)

    def _ctl(self, fn, *args):
        """Call the controller, timing it (the figure hicache-bench reports per request)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
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
        self._failed = err
        for req in self._pending:  # nothing more is restored
            req.prefetch.cancel(wait=False)
        raise err

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise HiCacheError(f"{what} after close()")
        if self._failed is not None:
            raise TransferError(f"{what}: the cache stopped after a failure "
                                f"({self._failed})") from self._failed

    def _req(self, request_id) -> _Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise HiCacheError(f"unknown request {request_id!r}") from None

    def _launch(self, ops: Iterable, owner: _Request | None = None) -> None:
        """Issue the controller's ops. An op that cannot even be issued (CUDA out of memory for
        its index tensors, a CuPy error) becomes a failed job: the op stays in flight like on
        every other rank, and the failure is agreed at the next step."""
        for op in ops:
            backup = isinstance(op, BackupOp)
            try:
                if backup:
                    job = self.transfer.backup(list(op.device_pages), list(op.host_pages))
                else:
                    job = self.transfer.load(list(op.host_pages), list(op.device_pages))
            except Exception as err:
                self._record(err)
                job = _FailedJob(err)
            if backup:
                chains = [self._chain_of_page.get(p) for p in op.device_pages]
                self._jobs[op.op_id] = (op, job, chains)
            else:
                self._jobs[op.op_id] = (op, job, None)
                if owner is not None:
                    owner.load_job = job

    def _finished(self, op, job, chains) -> None:
        if self.observer is not None:
            self.observer.observe("transfer", job.seconds, job.direction)
        if isinstance(op, BackupOp):
            self._stats.bytes["d2h"] += job.nbytes
            self._stats.transfer_s["d2h"] += job.seconds
            if self._writer is not None:
                pairs = [(c[0], h) for c, h in zip(chains, op.host_pages)
                         if c is not None and should_write(c[1], *self.replica)]
                if pairs:
                    keys = self._keys([c for c, _ in pairs])
                    try:
                        self._writer.submit(keys, [self.l2.read_page(h).clone()
                                                   for _, h in pairs])
                    except Exception as err:  # agreed at the next step
                        self._record(err)
        else:
            self._stats.bytes["h2d"] += job.nbytes
            self._stats.transfer_s["h2d"] += job.seconds

    def _restore(self, req: _Request, pages: int) -> bool:
        """Every rank holds ``pages`` prefetched pages: copy them into fresh device pages.
        False (retry at a later step) while L1 has no room; after ``RESTORE_RETRIES`` steps the
        tokens are recomputed instead. Both decisions follow the replicated controller state."""
        prefix = req.prefix
        try:
            dev = self._ctl(self.ctrl.alloc_device, pages)
            self._unmap(dev)
        except DeviceFullError:
            req.restore_tries += 1
            prefix.room_wait = req.restore_tries
            self._stats.restore_wait_steps += 1
            if req.restore_tries <= RESTORE_RETRIES:
                self._launch(self.ctrl.take_ops())
                return False
            dev, pages = [], 0
            self._stats.restore_fallbacks += 1
        self._launch(self.ctrl.take_ops())
        if pages:
            rows = self.layout.page_rows(torch.tensor(dev))
            try:
                data = torch.stack(req.staging[:pages])  # [n, L, P, D]
                self.l1.kv[:, rows] = data.permute(1, 0, 2, 3).reshape(
                    self.l1.kv.shape[0], -1, self.l1.kv.shape[-1]).to(self.l1.device)
            except Exception as err:  # e.g. out of device memory: agreed at the next step
                self._record(err)
            self._owned[dev] = True
            req.own_pages += dev
            prefix.page_table += dev
            prefix.storage_len = pages * self.page_tokens
        h = req.prefetch
        fin = h.finished  # read first: a finished read's error is final
        outcome = "timeout" if not fin else "done" if h.error is None else "error"
        h.cancel(wait=False)  # pages past the agreed count are not needed
        if h.keys:  # this rank found pages in L3 and read them
            self._stats.prefetch[outcome] += 1
            if self.observer is not None:
                self.observer.observe("restore", time.monotonic() - h.started)
        req.prefetch = None
        req.staging = []
        prefix.ready = True
        self._count_hits(prefix)
        return True

    def _count_hits(self, prefix: Prefix) -> None:
        """Counted once the prefix is final, so hit + miss == prompt tokens of ready requests
        (a request still waiting on L3 is in neither)."""
        self._stats.prompt_tokens += prefix.prompt_len
        hits = self._stats.hit_tokens
        hits["l1"] += prefix.device_len
        hits["l2"] += prefix.host_len
        hits["l3"] += prefix.storage_len


def _job_error(job) -> TransferError:
    """The TransferError a failed job's ``wait`` raises."""
    try:
        job.wait()
    except TransferError as err:
        return err
    return TransferError("a transfer failed")  # unreachable for a FAILED job


class _FailedJob:
    """An op whose copy could not be issued: failed from the start, like a copy that raised."""

    def __init__(self, err: BaseException) -> None:
        self.error = TransferError(f"could not issue the transfer: {err!r}")
        self.error.__cause__ = err
        self.nbytes, self.seconds = 0, 0.0

    def status(self) -> str:
        return FAILED

    def wait(self, timeout: float | None = None) -> None:
        raise self.error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        raise self.error


class _Waits:
    """Several jobs seen as one (a match that depends on loads still in flight)."""

    def __init__(self, jobs: list) -> None:
        self.jobs = jobs

    def wait_layer(self, layer: int) -> None:
        for j in self.jobs:
            j.wait_layer(layer)

    def wait(self) -> None:
        for j in self.jobs:
            j.wait()
