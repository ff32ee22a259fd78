"""Seeded fault injection for the soak (``hicache-bench --faults SEED``).

``FaultInjector(seed, rank, world)`` is created once per rank and ``install``-ed on every
``HiCache`` the soak starts (a fresh one after each failure). It wraps instance attributes only
(``cache.step``, the copy backend's ``copy``, the L3 store's ``get``): a cache that was
never installed on runs no injector code at all.

The schedule is drawn per ``step`` from a generator seeded with ``seed`` on every rank, so all
ranks draw the same plan in lockstep; an injection names its target rank and only that rank acts.
Kinds (a seeded shuffle of all of them, repeated, with seeded gaps in steps):

    d2h_fail        the target rank's next D2H copy raises (the step agrees a failure: restart)
    h2d_fail        the target rank's next H2D copy raises (a load-back: wait_layer records it)
    slow_copy       the target rank's next copy sleeps first
    l3_corrupt      stored values of the target rank get a flipped byte (checksum: a miss)
    l3_delete       the target rank's next L3 read finds its pages deleted just before
    l3_error        the target rank's store is unavailable for its next L3 reads: they answer
                    as misses and count in ``stats.errors`` (the L3 contract for a store that
                    errors: no raise)
    l3_restart      (Redis, with ``server``) the target rank kills the L3 server by PID
                    (SIGKILL); it restarts it ``restart_after`` steps later
    late_step       the target rank arrives late at this step's collective
    kv_corrupt      (opt-in mutation, never drawn by default) rows of some of the target
                    rank's L2 pages are overwritten with noise: KV that no checksum sees (L2
                    has none; L3 values backed up from it carry a valid one). The soak's KV
                    and logit comparison must report it (``hicache.kvcheck``)
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("d2h_fail", "h2d_fail", "slow_copy", "l3_corrupt", "l3_delete", "l3_error",
         "l3_restart", "late_step", "kv_corrupt")
OPT_IN = ("l3_restart", "kv_corrupt")  # drawn only when asked for
L3_KINDS = ("l3_corrupt", "l3_delete", "l3_error", "l3_restart")


class InjectedFault(OSError):
    """The error an injected fault raises (its message names the fault)."""


@dataclass
class FaultConfig:
    seed: int
    gap_steps: tuple[int, int] = (20, 60)    # steps between two injections
    slow_s: tuple[float, float] = (0.02, 0.2)
    late_s: tuple[float, float] = (0.02, 0.3)
    corrupt_values: int = 3
    error_reads: int = 2
    restart_after: int = 10                  # l3_restart: steps the server stays down
    kinds: tuple[str, ...] = tuple(k for k in KINDS if k not in OPT_IN)


@dataclass
class _Armed:
    fail: dict = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    slow: list = field(default_factory=list)   # seconds for the next copies
    delete_reads: int = 0
    error_reads: int = 0


class FaultInjector:
    """One rank's view of the seeded fault plan; counts what it actually injected."""

    def __init__(self, config: FaultConfig, rank: int, world: int, server=None) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.config, self.rank, self.world = config, rank, world
        self.server = server      # a hicache.l3.localserver.LocalServer this soak started
        self._restart_at = None   # step at which the killed server comes back
        self._rng = random.Random(config.seed)   # identical on every rank
        self._local = random.Random(config.seed * 7919 + rank)  # this rank's own draws
        self._order: list[str] = []
        self._next = self._gap()
        self._step = 0
        self._armed = _Armed()
        self._lock = threading.Lock()
        self.planned: Counter = Counter()    # every rank: the plan (same on all ranks)
        self.injected: Counter = Counter()   # this rank: faults that took effect
        self.l3_misses = 0                   # L3 reads this rank's faults cut short
        self.events: list[tuple[int, str, int]] = []  # (step, kind, target rank) of the plan

    # ---- the plan -----------------------------------------------------------------------------
    def _gap(self) -> int:
        return self._rng.randint(*self.config.gap_steps)

    def _draw(self) -> tuple[str, int]:
        if not self._order:
            self._order = list(self.config.kinds)
            self._rng.shuffle(self._order)
        return self._order.pop(), self._rng.randrange(self.world)

    def on_step(self, cache) -> None:
        """Called before each ``step`` on every rank (in lockstep)."""
        self._step += 1
        if self._restart_at is not None and self._step >= self._restart_at:
            self._restart_at = None
            self.server.start()
        if self._step < self._next:
            return
        self._next = self._step + self._gap()
        kind, target = self._draw()
        self.planned[kind] += 1
        self.events.append((self._step, kind, target))
        if target != self.rank:
            return
        c = self.config
        with self._lock:
            if kind in ("d2h_fail", "h2d_fail"):
                self._armed.fail[kind[:3]] += 1
            elif kind == "slow_copy":
                self._armed.slow.append(self._local.uniform(*c.slow_s))
            elif kind == "l3_delete":
                self._armed.delete_reads += 1
            elif kind == "l3_error":
                self._armed.error_reads += c.error_reads
        if kind == "l3_corrupt":
            if cache.l3 is not None and corrupt_values(cache.l3, c.corrupt_values, self._local):
                with self._lock:
                    self.injected[kind] += 1
        elif kind == "l3_restart":
            if self.server is not None and self._restart_at is None:
                self.server.kill()  # SIGKILL by PID: every rank's next calls fail, bounded
                self._restart_at = self._step + c.restart_after
                with self._lock:
                    self.injected[kind] += 1
        elif kind == "kv_corrupt":
            used = cache.ctrl.host.used_ids() if "l2" in cache.tiers else []
            if len(used):
                import numpy as np

                from .kvcheck import corrupt_pages
                pick = self._local.sample(sorted(int(p) for p in used),
                                          min(c.corrupt_values, len(used)))
                corrupt_pages(cache.l2, pick, np.random.default_rng(self._local.getrandbits(32)))
                with self._lock:
                    self.injected[kind] += 1
        elif kind == "late_step":
            time.sleep(self._local.uniform(*c.late_s))
            with self._lock:
                self.injected[kind] += 1

    # ---- installation -------------------------------------------------------------------------
    def install(self, cache) -> None:
        """Wrap ``cache``'s step, copy routine and L3 reads (instance attributes only)."""
        step = cache.step

        def faulty_step():
            self.on_step(cache)
            return step()
        cache.step = faulty_step
        copier = cache.transfer.backend
        run = copier.copy

        def faulty_copy(job):  # on the copy worker thread
            with self._lock:
                fail = self._armed.fail[job.direction] > 0
                slow = self._armed.slow.pop() if self._armed.slow and not fail else 0.0
                if fail:
                    self._armed.fail[job.direction] -= 1
                    self.injected[f"{job.direction}_fail"] += 1
                elif slow:
                    self.injected["slow_copy"] += 1
            if fail:
                raise InjectedFault(f"injected {job.direction} copy failure on rank {self.rank}")
            if slow:
                time.sleep(slow)
            return run(job)
        copier.copy = faulty_copy
        if cache.l3 is not None:
            store = cache.l3
            get = store.get

            def faulty_get(keys, out):  # on the prefetch thread
                with self._lock:
                    err = self._armed.error_reads > 0
                    delete = not err and self._armed.delete_reads > 0 and len(keys) > 0
                    if err:
                        self._armed.error_reads -= 1
                        self.injected["l3_error"] += 1
                        self.l3_misses += 1
                    elif delete:
                        self._armed.delete_reads -= 1
                        self.injected["l3_delete"] += 1
                if err:  # the contract for an unavailable store: a counted miss, no raise
                    backend(store)._bump(errors=1, misses=1)
                    return 0
                if delete:  # under a running restore: the pages vanish before the read
                    store.delete(list(keys))
                served = get(keys, out)
                if delete and served < len(keys):
                    with self._lock:
                        self.l3_misses += 1
                return served
            store.get = faulty_get

    @property
    def steps(self) -> int:
        """Steps seen so far (the same count on every rank: they step in lockstep)."""
        return self._step

    def close(self) -> None:
        """Bring a server this injector killed back (the soak ends with it running)."""
        if self._restart_at is not None:
            self._restart_at = None
            self.server.start()

    def report(self) -> dict:
        with self._lock:
            return {"injected": dict(self.injected), "planned": dict(self.planned),
                    "l3_misses": self.l3_misses, "steps": self._step}


def backend(store):
    """The backend store behind the service's guard (``hicache.l3.guard.GuardedStore``)."""
    return getattr(store, "_store", None) or store


def corrupt_values(store, n: int, rng: random.Random) -> int:
    """Flip one byte in up to ``n`` stored values of ``store``'s rank (LMDB or Redis); the
    checksum then rejects them. Returns how many were corrupted."""
    store = backend(store)
    if hasattr(store, "raw_client"):
        return _corrupt_redis(store, n, rng)
    if not hasattr(store, "_data"):
        return 0  # another backend: nothing to reach into

    def fn(txn):
        cur = txn.cursor(db=store._data)
        keys = []
        if cur.set_range(store._prefix):
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if not k.startswith(store._prefix):
                    break
                keys.append(k)
        picked = rng.sample(keys, min(n, len(keys)))
        for k in picked:
            data = bytearray(txn.get(k, db=store._data))
            i = rng.randrange(len(data))
            data[i] ^= 0xFF
            txn.put(k, bytes(data), db=store._data)
        return len(picked)

    res = store._run(fn, write=True)
    return res if isinstance(res, int) else 0


def _corrupt_redis(store, n: int, rng: random.Random) -> int:
    client = store.raw_client()
    if client is None:
        return 0  # the server is down
    prefix = store.key_prefix + store._prefix
    glob = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix)
    try:
        keys = list(client.scan_iter(match=glob + b"*", count=1000))
        picked = rng.sample(keys, min(n, len(keys)))
        for k in picked:
            v = bytearray(client.get(k) or b"")
            if v:
                v[rng.randrange(len(v))] ^= 0xFF
                client.set(k, bytes(v))
        return len(picked)
    except Exception:  # the server went away meanwhile: nothing corrupted
        return 0
