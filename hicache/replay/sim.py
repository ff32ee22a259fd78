"""The replay proper: a trace's requests through the real ``CacheController`` by arrival time.

Each request, at its arrival: matches its prompt (all but the last token, as ``HiCache.admit``
does) and locks the hit, loads its L2 hit back into L1, reads what follows from L3 where the
cost model says loading beats recomputing, and takes L1 pages for the rest of its prompt and
its decode (as the serving loop's ``alloc``). It stays in flight (its pages and lock held) for
its prefill and decode time, then caches prompt and decoded tokens' whole pages (``insert``,
releasing the lock; L2 backups as the write policy says, all agreed at once: there is one
rank), and writes them to L3. A request that finds no L1 room runs uncached (counted).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from ..controller import CacheController
from ..errors import DeviceFullError
from ..l3.cost import CostModel
from ..workloads.traces import Trace, TraceRequest
from .keys import Fillers, page_keys
from .l3 import L3Pages
from .offline import ReplayKeys

TIERS = ("l1", "l2", "l3")


@dataclass(frozen=True)
class ReplaySettings:
    """Capacities in pages of ``page_tokens`` (0: the tier is off), the controller's policy,
    and the service times that decide how long a request holds its pages."""
    page_tokens: int
    l1_pages: int
    l2_pages: int = 0
    l3_pages: int = 0
    eviction: str = "lru"                  # the policy file's [policy] eviction (checked there)
    write: str = "write_through"
    bytes_per_token: float = 70272.0       # per rank; DeepSeek-V3, TP 8, no DCP
    prefill_tokens_per_s: float = 10000.0
    decode_s_per_token: float = 0.02
    l2_read_bytes_per_s: float = 20e9
    l3_read_bytes_per_s: float = 5e9
    l3_overhead_s: float = 0.002
    max_output: int | None = None


@dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    uncached_requests: int = 0       # found no L1 room for their pages
    ttft_saved_s: float = 0.0
    evictions: dict = field(default_factory=dict)
    l3_traffic: dict = field(default_factory=dict)
    wall_s: float = 0.0
    keys: ReplayKeys | None = None

    @property
    def hit_ratio(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class _Flight:
    """A request in flight: its lock, its page table (hit pages, then its own), its tokens."""
    lock: object
    table: list
    own: list | None
    fed: np.ndarray
    keys: list[int]
    decoded: int        # tokens past the prompt, as HiCache.finish counts them (the learned
    #                     order classes the request by them)


class _Replay:
    def __init__(self, trace: Trace, s: ReplaySettings) -> None:
        self.s = s
        self.pt = s.page_tokens
        self.ctrl = CacheController(s.page_tokens, s.l1_pages, s.l2_pages,
                                    eviction=s.eviction, write=s.write)
        self.l3 = L3Pages(s.l3_pages) if s.l3_pages else None
        self.keys = ReplayKeys(s.page_tokens)
        self.fill = Fillers()
        self.res = ReplayResult()
        self.running: list = []  # heap of (finish time, index, _Flight)
        self.cost = CostModel(s.l3_read_bytes_per_s, s.prefill_tokens_per_s, s.l3_overhead_s)
        self.l2_cost = CostModel(s.l2_read_bytes_per_s, s.prefill_tokens_per_s)

    def finish_until(self, t: float) -> None:
        while self.running and self.running[0][0] <= t:
            self.finish(heapq.heappop(self.running)[2])

    def admit(self, r: TraceRequest) -> None:
        s, pt, ctrl = self.s, self.pt, self.ctrl
        toks = r.tokens()
        n_out = r.output_len if s.max_output is None else min(r.output_len, s.max_output)
        pkeys = page_keys(toks, pt)
        fed = np.concatenate([toks, self.fill.tokens(toks, pkeys, pt, max(n_out - 1, 0))])
        fkeys = page_keys(fed, pt) if len(fed) // pt > len(pkeys) else pkeys
        mkeys = fkeys[:(len(toks) - 1) // pt]
        self.keys.add(mkeys, fkeys, len(toks))
        m = ctrl.match(toks[:-1], lock=True)
        table = m.device_pages.tolist()
        l2 = 0
        if m.host_len and s.l2_pages:
            op = ctrl.load_back(m)
            if op is not None:
                l2 = m.host_len
                table += list(op.device_pages)
        l3 = self.l3_hit(mkeys, len(table))
        try:
            own = ctrl.alloc_device(-(-(len(toks) + n_out) // pt) - len(table))
        except DeviceFullError:
            own = None
            self.res.uncached_requests += 1
        self.settle()
        self.count(r, toks, m.device_len, l2, l3)
        uncached = len(toks) - (m.device_len + l2 + l3)
        end = (r.arrival_s + uncached / s.prefill_tokens_per_s + n_out * s.decode_s_per_token)
        heapq.heappush(self.running, (end, r.index, _Flight(m.lock, table, own, fed, fkeys,
                                                                 len(fed) - len(toks))))

    def l3_hit(self, mkeys: list[int], start: int) -> int:
        """Tokens read from L3 after the first ``start`` pages, where loading beats
        recomputing (the cost model's decision, as the service's ``l3_cost_model``)."""
        if self.l3 is None:
            return 0
        n = self.l3.hit(mkeys, start)
        tokens = n * self.pt
        if not n or not self.cost.should_load(tokens, int(tokens * self.s.bytes_per_token)):
            return 0
        self.l3.served(n)
        return tokens

    def count(self, r: TraceRequest, toks: np.ndarray, l1: int, l2: int, l3: int) -> None:
        res, bpt = self.res, self.s.bytes_per_token
        res.requests += 1
        res.prompt_tokens += len(toks)
        res.hit_tokens["l1"] += l1
        res.hit_tokens["l2"] += l2
        res.hit_tokens["l3"] += l3
        saved = self.cost.recompute_seconds(l1 + l2 + l3)
        if l2:
            saved -= l2 * bpt / self.s.l2_read_bytes_per_s
        if l3:
            saved -= self.cost.load_seconds(int(l3 * bpt))
        res.ttft_saved_s += saved

    def finish(self, f: _Flight) -> None:
        ctrl, pt = self.ctrl, self.pt
        if f.own is None:
            ctrl.unlock(f.lock)
        else:
            whole = len(f.fed) // pt
            table = f.table + f.own
            ctrl.insert(f.fed[:whole * pt], table[:whole], after=f.lock, decoded=f.decoded)
            if len(table) > whole:
                ctrl.free_device(table[whole:])
            if self.l3 is not None:
                self.l3.put(f.keys)
        self.settle()

    def settle(self) -> None:
        """Every transfer the controller asked for is done (one rank, instant copies)."""
        ctrl = self.ctrl
        ctrl.take_ops()
        ops = ctrl.inflight_ops()
        if ops:
            ctrl.complete(ops)

    def summary(self, wall: float) -> ReplayResult:
        st, res = self.ctrl.stats, self.res
        res.evictions = {"l1_pages": st.device_evicted_pages, "l2_pages": st.host_evicted_pages,
                         "dropped_pages": st.dropped_pages,
                         "l3_pages": self.l3.evicted if self.l3 else 0}
        res.l3_traffic = {"pages_written": self.l3.written if self.l3 else 0,
                          "pages_read": self.l3.read if self.l3 else 0,
                          "bytes_written": int((self.l3.written if self.l3 else 0) * self.pt
                                               * self.s.bytes_per_token),
                          "bytes_read": int((self.l3.read if self.l3 else 0) * self.pt
                                            * self.s.bytes_per_token)}
        res.wall_s = wall
        res.keys = self.keys
        return res


def replay(trace: Trace, settings: ReplaySettings, *, progress: bool = False,
           check: bool = False) -> ReplayResult:
    """Replay ``trace`` through a controller built from ``settings``; ``check``: run the
    controller's invariant check at the end (tests)."""
    rp = _Replay(trace, settings)
    bar = None
    if progress:
        import sys
        from tqdm import tqdm
        bar = tqdm(total=len(trace.requests), desc="replay", unit="req", leave=False,
                   file=sys.stderr, mininterval=0.5)
    t0 = time.perf_counter()
    for r in trace.requests:
        rp.finish_until(r.arrival_s)
        rp.admit(r)
        if bar is not None:
            bar.update(1)
    rp.finish_until(float("inf"))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if check:
        rp.ctrl.check()
    return rp.summary(wall)
