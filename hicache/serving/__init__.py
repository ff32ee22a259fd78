"""A continuous-batching serving loop: the DCP MLA engine with HiCache embedded.

Each scheduler step, on every rank in lockstep:
  1. admit the next waiting request while fewer than ``max_running`` are active;
  2. ``HiCache.step()``: the one agreement collective (finished transfers, L3 lookups);
  3. prefill, in chunks, only the unmatched suffix of requests whose prefix is ready
     (``wait_layer`` before each layer overlaps the L2 load-back with compute);
  4. one decode token for every decoding request (one batched extend);
  5. finish requests that emitted all their tokens (insert, unlock, back up per policy).
Cache hits change nothing in the output: the same token ids for every mode.

A finished request is returned (and ``on_done`` called) only after the NEXT step's agreement
succeeded: a load that failed on some rank while its tokens were computed makes that step raise
on every rank first, so no token computed from failed KV ever reaches a caller.

Progress: a request waiting for L1 room (an agreed L3 restore, or its suffix pages) holds up
admission, and when nothing else progresses the youngest request that has not started is
preempted (re-queued), never the oldest: locked hits of active requests cannot starve every
restore. One exception keeps what finished requests left in L1 from being evicted by the
waiting request when the next queued request would hit it: after a request finished, the head
of the queue is matched, and it stays admitted ("overtakes") only when its new pages fit in
L1's free pages (no eviction), asked before it is admitted (admitting it would already load its
L2 hit into L1), whatever its L3 lookup finds (a page restored from L3 takes the L1 page its
prefill would have). It then returns all it takes when it finishes,
so the waiter loses no room, only time, and a waiting request is overtaken at most
``max_overtakes`` times (0: strict hold). And when requests finish, a request still waiting on
L3 (its read, or L1 room for its agreed restore) whose prompt they put in L1 beyond its hit is
matched again: it takes that L1 hit instead of evicting it to restore the same tokens from L3.
Preemptions, overtakes, re-matches and steps without progress are counted (``preemptions``,
``overtakes``, ``rematches``, ``blocked_steps``, ``longest_stall``), and so is the time spent
in each cache call (``cache_s``: admit, step, finish, wait_layer, and re-matches), which is
where issuing, running inline and waiting on copies shows up on the scheduler thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..config import HiCacheConfig
from ..engine.model import MLAModel, ModelConfig
from ..engine.runner import DCPRunner, RequestState
from ..errors import ConfigError, DeviceFullError, DivergenceError, TransferError
from . import hybrid as hybrid
from . import spec as spec_steps
from ..service import HiCache


def model_config(cfg: HiCacheConfig, seed: int = 0) -> ModelConfig:
    """The built-in engine's model for a policy file's [model] section."""
    m = cfg.model
    return ModelConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                       num_layers=m.num_layers, num_heads=m.num_heads,
                       kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.rope_dim,
                       intermediate_size=2 * m.hidden_size, dtype=m.dtype, seed=seed)


@dataclass
class Result:
    request_id: object
    prompt_len: int
    output: list[int]
    ttft_s: float
    hit: dict  # tokens per tier: {"l1", "l2", "l3"}
    tpot_s: float = 0.0  # (last token - first token) / (tokens - 1); 0 for one token
    decode_tpot_s: float = 0.0  # its decode steps' wall time / (tokens - 1): no prefill stalls
    spec: dict | None = None  # speculative serving: its counts and draft KV source


@dataclass(eq=False)  # identity: `in` and remove() never compare token arrays
class _Active:
    job: object  # request_id, tokens (int array), output_len (>= 1)
    prefix: object
    admitted: float
    state: RequestState | None = None
    output: list[int] = field(default_factory=list)
    ttft: float = 0.0
    room_seen: int = 0  # prefix.room_wait when last looked at
    stale_at: int | None = None  # Server.inserted when its suffix last found no L1 room
    overtaken: int = 0  # requests admitted past it while it waited for L1 room
    # hybrid models: positions whose KDA state the cache wants, and the snapshots taken there
    want: list = field(default_factory=list)
    snaps: dict = field(default_factory=dict)
    spec: object = None  # speculative serving: a serving_spec.RequestSpec
    first_at: float = 0.0  # when its first token came (TPOT)
    decode_s: float = 0.0  # wall time of the decode steps it was in (decode-only TPOT)


def _scope(job) -> tuple:
    """The scope arguments of a job for ``admit`` / ``peek``: ``(scope, public_tokens)`` of a
    ``hicache.workloads.Request`` in a scope, none for one in the shared scope."""
    scope, public = getattr(job, "scope", None), getattr(job, "public_tokens", 0)
    return (scope, public) if scope is not None or public else ()


class Server:
    """Runs jobs through a ``DCPRunner`` on ``cache``'s KV port (its L1 pool, writes checked)."""

    def __init__(self, model: MLAModel, cache: HiCache, *, backend: str = "a2a",
                 replicate_q: bool = True, group=None, chunk_tokens: int = 512,
                 max_running: int = 4, stall_steps: int = 200_000,
                 max_overtakes: int = 4, probe=None, spec=None) -> None:
        if chunk_tokens < 1 or max_running < 1:
            raise ConfigError(f"chunk_tokens and max_running must be >= 1, got {chunk_tokens} "
                              f"and {max_running}")
        if isinstance(max_overtakes, bool) or not isinstance(max_overtakes, int) \
                or max_overtakes < 0:
            raise ConfigError(f"max_overtakes must be an int >= 0, got {max_overtakes!r}")
        self.max_overtakes = max_overtakes
        self.probe = probe  # hicache.kvcheck.KVProbe: what --verify and the soak compare
        self.stall_steps = stall_steps
        self.cache = cache
        self._waiting_on: list = []
        self.runner = DCPRunner(model, cache.kv, backend=backend, replicate_q=replicate_q,
                                group=group, layer_hook=self._wait_layer)
        self.hybrid = hybrid.check(self.runner, cache)
        # speculative serving (a serving_spec.SpecServing): k drafts per request per round,
        # one batched verify; the draft runs on the cache's draft pool
        self.spec = spec
        self.draft_runner = spec_steps.draft_runner(spec, cache) if spec is not None else None
        self.rounds = 0  # batched target steps that decoded (plain or verify)
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.preemptions = 0    # requests re-queued so that an older one gets L1 room
        self.blocked_steps = 0  # steps in which a request waited for room and nothing ran
        self.longest_stall = 0  # the longest run of such steps
        self.inserted = 0       # requests finished into the cache so far (the tree grew)
        self.overtakes = 0      # requests admitted past one waiting for L1 room
        self.probes_returned = 0  # queue heads tried past a waiter and left queued (no room)
        # seconds in each cache call on the scheduler thread (copies issued, run inline or
        # waited for land in admit / finish / step / wait_layer)
        self.cache_s = {"admit": 0.0, "step": 0.0, "finish": 0.0, "wait_layer": 0.0,
                        "rematch": 0.0}
        self.rematches = 0      # requests matched again after waiting for room (_rematch)

    def _wait_layer(self, layer: int) -> None:
        t0 = time.perf_counter()
        for rid in self._waiting_on:
            self.cache.wait_layer(rid, layer)
        self.cache_s["wait_layer"] += time.perf_counter() - t0

    def _timed(self, call: str, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return getattr(self.cache, call)(*args, **kwargs)
        finally:
            self.cache_s[call] += time.perf_counter() - t0

    def run(self, jobs: Sequence, on_done: Callable[[Result], None] | None = None
            ) -> list[Result]:
        active: list[_Active] = []
        try:
            return self._run(jobs, on_done, active)
        except (TransferError, DivergenceError):
            # The failure was agreed (every rank raises at this step): forget the requests,
            # releasing their locks and pages, identically on every rank.
            for a in active:
                self.cache.abort(a.job.request_id)
            raise

    def _run(self, jobs: Sequence, on_done, active: list) -> list[Result]:
        cache = self.cache
        capacity = cache.config.l1.num_pages * cache.page_tokens
        waiting = deque(jobs)
        results: list[Result] = []
        finished: list[Result] = []  # returned once the next step's agreement is healthy
        admitted_at: dict = {}  # first admission: a preempted request's wait counts in its TTFT
        stalled = run = 0
        room: list[_Active] = []  # requests that found no L1 room at the last step
        probed = -1  # self.inserted when the queue head was last tried past a waiting request
        t_step = None
        while waiting or active or finished:
            now = time.perf_counter()
            if t_step is not None:  # what a request waiting for its L3 read waits at least
                cache.observe_step(now - t_step)
            t_step = now
            if waiting and len(active) < self.max_running:
                probed = self._admit_next(waiting, active, admitted_at, capacity, room, probed)
            # The step's one collective right after admission: a request whose L3 lookup found
            # nothing on any rank is ready in this same iteration. It raises on every rank if
            # any rank failed, before the tokens finished in the last iteration are returned.
            self._timed("step")
            emitted = self._release(finished, results, on_done)
            finished = []
            room = []
            started = self._start_ready(active, room)
            decoding = [a for a in active if a.state is not None and len(a.output) < a.job.output_len]
            if room and not started and not decoding:
                self._preempt(active, waiting)
            if decoding:
                self._decode(decoding)
            self._finish_done(active, finished)
            if finished:
                self._rematch_waiters(active)
            progress = started or decoding or emitted or finished
            run = self._count_blocked(room, progress, run)
            stalled = self._count_stalled(active, room, progress, stalled)
        return results

    def _admit_next(self, waiting: deque, active: list, admitted_at: dict, capacity: int,
                    room: list, probed: int) -> int:
        """Admit the head of the queue, unless a request waits for L1 room: then admit nobody
        until it got it, except a request that overtakes it (see the module docstring). Every
        input is replicated. Returns ``probed`` (``self.inserted`` when the head was last
        tried past a waiting request)."""
        waiters = [a for a in room if a in active]
        if not waiters:
            self._admit(waiting, active, admitted_at, capacity)
        elif self.inserted > probed and all(a.overtaken < self.max_overtakes for a in waiters):
            probed = self.inserted
            if self._fits(waiting[0]):
                self._admit(waiting, active, admitted_at, capacity)
                self.overtakes += 1
                for a in waiters:
                    a.overtaken += 1
            else:  # it would take room by eviction: it stays at the head of the queue
                self.probes_returned += 1
        return probed

    @staticmethod
    def _release(finished: list, results: list, on_done) -> int:
        """Return the requests finished in the last iteration (the step's agreement since
        succeeded); how many."""
        for r in finished:
            results.append(r)
            if on_done is not None:
                on_done(r)
        return len(finished)

    def _start_ready(self, active: list, room: list) -> int:
        """Prefill every request whose prefix is ready; add to ``room`` those that found no L1
        room (for their suffix, or for their agreed L3 restore). Returns how many started."""
        started = 0
        for a in [a for a in active if a.state is None and a.prefix.ready]:
            if a.stale_at is not None and self.inserted > a.stale_at and not self._rematch(a):
                continue  # matched afresh: its new hit waits on L3
            if self._prefill(a):
                started += 1
            else:
                room.append(a)  # no L1 pages for its suffix
        for a in active:
            if not a.prefix.ready and a.prefix.room_wait > a.room_seen:
                room.append(a)  # its agreed L3 restore found no L1 room this step
            a.room_seen = a.prefix.room_wait
        return started

    def _decode(self, decoding: list) -> None:
        """One token for every decoding request (one batched extend); speculative serving:
        up to k + 1 for each, verified in one batched target step. The step's wall time is
        added to each request's ``decode_s`` (its decode-only TPOT)."""
        self.rounds += 1
        t0 = time.perf_counter()
        self._step_tokens(decoding)
        dt = time.perf_counter() - t0
        for a in decoding:
            a.decode_s += dt

    def _step_tokens(self, decoding: list) -> None:
        if self.spec is not None:
            spec_steps.round_(self.runner, decoding, self.spec.num_draft_tokens, self.hybrid)
            return
        if self.hybrid:
            logits = hybrid.decode(self.runner, decoding)
        else:
            logits = self.runner.extend_batch([a.state for a in decoding],
                                              [[a.output[-1]] for a in decoding])
        for a, lg in zip(decoding, logits):
            a.output.append(int(lg[-1].argmax()))

    def _finish_done(self, active: list, finished: list) -> None:
        """Finish the requests that emitted all their tokens (insert, unlock, back up) and add
        their results to ``finished``."""
        for a in [a for a in active if a.state is not None
                  and len(a.output) >= a.job.output_len]:
            active.remove(a)
            fed = np.concatenate([a.job.tokens, np.asarray(a.output[:-1], dtype=np.int64)])
            snaps = hybrid.finished(self.runner, a) if self.hybrid else None
            self._timed("finish", a.job.request_id, fed, snaps, **spec_steps.finished(a))
            self.inserted += 1
            p = a.prefix
            n = len(a.output)
            tpot = (time.perf_counter() - a.first_at) / (n - 1) if n > 1 else 0.0
            finished.append(Result(a.job.request_id, len(a.job.tokens), a.output, a.ttft,
                                   {"l1": p.device_len, "l2": p.host_len, "l3": p.storage_len},
                                   tpot, a.decode_s / (n - 1) if n > 1 else 0.0,
                                   spec_steps.report(a)))

    def _rematch_waiters(self, active: list) -> None:
        """What finished requests inserted may be in L1 now what a request still waiting on L3
        (its read, or room for its restore) is about to restore or read: match it again before
        the next step restores it (evicting that very prefix to make room)."""
        for a in [a for a in active if not a.prefix.ready]:
            if self._hit_grew(a):
                self._rematch(a)

    def _count_blocked(self, room: list, progress, run: int) -> int:
        """Count a step in which a request waited for room and nothing progressed; returns the
        current run of such steps."""
        if room and not progress:
            self.blocked_steps += 1
            run += 1
            self.longest_stall = max(self.longest_stall, run)
            return run
        return 0

    def _count_stalled(self, active: list, room: list, progress, stalled: int) -> int:
        """Steps in a row without progress; past ``stall_steps`` no request can get L1 pages.
        A request still reading its L3 hit waits on the store (bounded by the prefetch policy
        and the store's timeouts), not on L1: no stall. The readiness it waits for is agreed,
        so every rank sees the same. Counted in steps, not seconds, so every rank gives up at
        the same step."""
        reading = any(not a.prefix.ready and a not in room for a in active)
        stalled = 0 if (progress or reading) else stalled + 1
        if stalled > self.stall_steps:
            raise ConfigError("no request can get L1 pages: l1.num_pages is too small "
                              f"for {len(active)} concurrent requests")
        return stalled

    def _admit(self, waiting: deque, active: list, admitted_at: dict, capacity: int) -> _Active:
        job = waiting.popleft()
        need = len(job.tokens) + job.output_len
        if need > capacity:
            raise ConfigError(f"request {job.request_id!r} needs {need} tokens of KV but "
                              f"L1 holds {capacity} (l1.num_pages)")
        t_admit = admitted_at.setdefault(job.request_id, time.perf_counter())
        a = _Active(job, self._timed("admit", job.request_id, job.tokens, *_scope(job)),
                    t_admit)
        active.append(a)
        return a

    def _fits(self, job) -> bool:
        """May ``job`` run before a request waiting for L1 room? Only if its new pages fit in
        L1's free pages: it evicts nothing the waiter could use, and once it finished its pages
        (hit and new) are evictable again, so the waiter lost no room. Asked before admission
        (``HiCache.peek`` changes nothing): admitting would already load its L2 hit, which
        takes L1 pages and may evict. Its L3 lookup is not known yet: what it restores from L3
        takes pages its prefill would take otherwise, so the count is the same (the prompt's
        and output's pages less its L1 hit)."""
        cache = self.cache
        need = -(-(len(job.tokens) + job.output_len) // cache.page_tokens)
        t0 = time.perf_counter()
        hit = cache.peek(job.tokens, *_scope(job))[0] // cache.page_tokens
        self.cache_s["admit"] += time.perf_counter() - t0
        free = cache.config.l1.num_pages - cache.stats()["pages"]["l1"]
        return need - hit <= free

    def _preempt(self, active: list, waiting: deque) -> None:
        """Nothing runs and a request waits for L1 room held by the locked hits of others:
        re-queue the youngest request that has not started (the same choice on every rank: the
        controller state is replicated). Never the oldest while others remain, so the oldest
        gets all the room it needs. Alone, a request whose suffix finds no room is admitted
        afresh (its match may be stale: a host hit another request recomputed is now on the
        device); alone and waiting on its restore, it keeps waiting (the restore gets room, or
        falls back to recompute after a bounded wait)."""
        idle = [a for a in active if a.state is None]
        if len(idle) > 1:
            victim = idle[-1]
        elif idle and idle[0].prefix.ready:
            victim = idle[0]
        else:
            return
        self.cache.abort(victim.job.request_id)
        active.remove(victim)
        waiting.appendleft(victim.job)
        self.preemptions += 1

    def _hit_grew(self, a: _Active) -> bool:
        """Does L1 now hold more of ``a``'s prompt than its hit? (Only then is matching a
        request that waits on L3 again worth it: its L3 read starts afresh.) Replicated: the
        same answer on every rank."""
        t0 = time.perf_counter()
        try:
            return self.cache.l1_hit_now(a.job.request_id) > a.prefix.hit_len
        finally:
            self.cache_s["rematch"] += time.perf_counter() - t0

    def _rematch(self, a: _Active) -> bool:
        """A request that waited for L1 room while others finished matches again: what they
        inserted may now be its hit (else its old match would make it evict that and prefill
        it a second time). The same decision on every rank. True when it is ready to prefill."""
        rid = a.job.request_id
        t0 = time.perf_counter()
        self.cache.abort(rid)
        a.prefix = self.cache.admit(rid, a.job.tokens, *_scope(a.job))
        self.cache_s["rematch"] += time.perf_counter() - t0
        self.rematches += 1
        a.stale_at = None
        a.room_seen = a.prefix.room_wait
        return a.prefix.ready

    def _prefill(self, a: _Active) -> bool:
        """Prefill the unmatched suffix; True when the request started decoding."""
        job, prefix = a.job, a.prefix
        try:
            self.cache.alloc(job.request_id, len(job.tokens) + job.output_len)
        except DeviceFullError:
            a.stale_at = self.inserted
            return False  # L1 is busy with running requests: retry after the next step
        state = a.state = RequestState(page_table=prefix.page_table, length=prefix.hit_len)
        suffix = torch.as_tensor(job.tokens[prefix.hit_len:], dtype=torch.int64)
        self._waiting_on = [job.request_id]
        seen = None  # speculative: each chunk's final hidden states go to the drafter
        if self.spec is not None:
            a.spec = spec_steps.start(self.draft_runner, a)
            seen = lambda lo: spec_steps.prefilled(self.runner, a, lo)  # noqa: E731
        t0 = time.perf_counter()
        try:
            if self.hybrid:  # restore the hit's KDA state, snapshot where the cache wants
                logits = hybrid.prefill(self.runner, self.cache, a, state, suffix,
                                        self.chunk_tokens, seen)
            else:
                for s in range(0, len(suffix), self.chunk_tokens):
                    lo = state.length
                    logits = self.runner.extend(state, suffix[s:s + self.chunk_tokens])
                    if seen is not None:
                        seen(lo)
        finally:
            self._waiting_on = []
        dt = time.perf_counter() - t0
        self.prefill_s += dt
        self.prefill_tokens += len(suffix)
        self.cache.observe_prefill(len(suffix), dt)
        a.output.append(int(logits[-1].argmax()))
        a.first_at = time.perf_counter()
        a.ttft = a.first_at - a.admitted
        if self.probe is not None:  # after the prefill: every layer of the hit has arrived
            self.probe.prefilled(job.request_id, job.tokens, prefix, logits[-1])
        if a.spec is not None:
            spec_steps.caught_up(a)
        return True
