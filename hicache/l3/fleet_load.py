"""A fleet of writer / reader processes on one shared L3 store: ``bench/l3.py --fleet N`` and
the failover tests.

Each process (:func:`worker`) opens its own ``RedisStore`` with the fleet secret, writes its own
sequences and the ``shared`` sequences every process writes (the same pages: the store keeps
one copy, the others are skipped), then looks up and reads every process's sequences and checks
each page served against the bytes its writer put (a page's bytes are a function of its key, so
any process can check any page). Rounds are aligned by a barrier when one is given (the bench:
every process puts, then every process gets); with ``seconds`` they run unaligned until then, or
until :func:`run_fleet`'s ``during()`` returns (a master killed meanwhile and its failover
waited for). :func:`run_fleet` starts the processes (spawned, each its own
interpreter) and collects their reports.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .keys import Namespace, page_keys


@dataclass(frozen=True)
class FleetJob:
    """What one process of the fleet does."""

    url: tuple            # the store: cluster node URLs (or one server's URL)
    worker: int
    workers: int
    secret_file: str = ""
    sequences: int = 4    # this process's own sequences
    shared: int = 2       # sequences every process writes (identical pages)
    pages: int = 8        # pages per sequence
    rounds: int = 1
    seconds: float = 0.0  # > 0: keep running rounds (unaligned) at most this long
    layers: int = 2
    kv_dim: int = 64
    page_size: int = 16
    timeout_s: float = 0.5
    retry_after_s: float = 0.2

    def namespace(self) -> Namespace:
        return Namespace("fleet", self.layers, self.kv_dim, "bfloat16", self.page_size, 1)


@dataclass
class FleetReport:
    """One process's figures (times from ``time.time()``, so processes compare)."""

    worker: int
    put_bytes: int = 0      # bytes offered to put (written or found held)
    get_bytes: int = 0      # bytes served by get
    put_span: list = field(default_factory=list)  # [start, end] of each put phase
    get_span: list = field(default_factory=list)
    put_ms: list = field(default_factory=list)    # latency of each put call (one sequence)
    get_ms: list = field(default_factory=list)    # of each lookup + get of one sequence
    wrong: int = 0          # pages served whose bytes are not what their writer put
    timeline: list = field(default_factory=list)  # (time, pages served, pages asked) per read
    stats: dict = field(default_factory=dict)     # the store's L3Stats at the end


def _tokens(seed: int, n: int) -> list[int]:
    return [seed] + list(range(1, n))


def sequences(job: FleetJob) -> tuple[list, list]:
    """(the token lists this process writes, the token lists it reads: every process's own
    sequences and the shared ones)."""
    n = job.pages * job.namespace().page_tokens
    own = [_tokens(1_000_000 + job.worker * 1000 + s, n) for s in range(job.sequences)]
    shared = [_tokens(2_000_000 + s, n) for s in range(job.shared)]
    every = [_tokens(1_000_000 + w * 1000 + s, n) for w in range(job.workers)
             for s in range(job.sequences)]
    return own + shared, every + shared


def _block(key: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(hashlib.blake2b(key, digest_size=64).digest()), np.uint8)


def payload(key: bytes, ns: Namespace) -> torch.Tensor:
    """The page a fleet process stores under ``key``: 64 bytes of its hash, repeated."""
    raw = np.tile(_block(key), ns.shard_bytes // 64)
    return torch.from_numpy(raw).view(ns.torch_dtype).reshape(ns.shard_shape)


def matches(key: bytes, page: torch.Tensor) -> bool:
    """``page`` holds what :func:`payload` gives for ``key`` (one memcmp)."""
    raw = page.view(torch.uint8).reshape(-1).numpy()
    return raw.tobytes() == _block(key).tobytes() * (raw.size // 64)


def _open(job: FleetJob):
    """The process's store, opened like every way into a shared store (``open_store``): keys
    derived and values MACed with the fleet secret; without one, the trust rule's refusal."""
    from . import auth
    from .backends import open_store
    url = list(job.url) if len(job.url) > 1 else job.url[0]
    keyed = {"secrets": auth.load(None, env={auth.ENV: job.secret_file})} if job.secret_file \
        else {}
    return open_store(url, job.namespace(), 0, timeout_s=job.timeout_s,
                      retry_after_s=job.retry_after_s, check_policy=False, **keyed)


def _put_phase(store, job: FleetJob, writes: list, rep: FleetReport) -> None:
    ns = job.namespace()
    t0 = time.time()
    for keys in writes:
        shards = [payload(k, ns) for k in keys]
        t = time.perf_counter()
        store.put(keys, shards)
        rep.put_ms.append((time.perf_counter() - t) * 1e3)
        rep.put_bytes += len(keys) * ns.shard_bytes
    rep.put_span.append([t0, time.time()])


def _get_phase(store, job: FleetJob, reads: list, outs: list, rep: FleetReport) -> None:
    ns = job.namespace()
    t0 = time.time()
    for keys in reads:
        t = time.perf_counter()
        n = store.exists_prefix(keys)
        got = store.get(keys[:n], outs[:n]) if n else 0
        rep.get_ms.append((time.perf_counter() - t) * 1e3)
        rep.get_bytes += got * ns.shard_bytes
        rep.wrong += sum(not matches(k, outs[i]) for i, k in enumerate(keys[:got]))
        rep.timeline.append((time.time(), got, len(keys)))
    rep.get_span.append([t0, time.time()])


def worker(job: FleetJob, barrier=None, queue=None, ready=None, stop=None) -> FleetReport:
    """Run one process's rounds; the report goes to ``queue`` (when given) and is returned;
    ``ready`` (a semaphore) is released once the first round is done; ``stop`` (an event) ends
    a ``seconds`` run early."""
    ns = job.namespace()
    own, every = sequences(job)
    rep = FleetReport(job.worker)
    store = _open(job)
    try:
        writes = [store.check_keys(page_keys(t, ns.page_tokens, ns, 0)) for t in own]
        reads = [store.check_keys(page_keys(t, ns.page_tokens, ns, 0)) for t in every]
        reads = reads[job.worker:] + reads[:job.worker]  # each process starts elsewhere
        outs = [torch.empty(ns.shard_shape, dtype=ns.torch_dtype) for _ in range(job.pages)]
        end = time.monotonic() + job.seconds
        r = 0
        while r < job.rounds or (time.monotonic() < end and
                                 not (stop is not None and stop.is_set())):
            for phase in (_put_phase, _get_phase):
                if barrier is not None:
                    barrier.wait(timeout=600)
                if phase is _put_phase:
                    phase(store, job, writes, rep)
                else:
                    phase(store, job, reads, outs, rep)
            r += 1
            if r == 1 and ready is not None:
                ready.release()
        rep.stats = asdict(store.stats)
    finally:
        store.close()
    if queue is not None:
        queue.put(asdict(rep))
    return rep


def run_fleet(jobs: list[FleetJob], timeout_s: float = 600.0, aligned: bool = True,
              during=None) -> list[dict]:
    """Start one spawned process per job (rounds aligned by a barrier when ``aligned``), call
    ``during()`` (when given) once every process finished its first round, end their
    ``seconds`` runs when it returns, and return their reports (sorted by worker). A process that does not report within ``timeout_s`` is killed
    and raises."""
    ctx = mp.get_context("spawn")
    queue, ready, stop = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    barrier = ctx.Barrier(len(jobs)) if aligned else None
    procs = [ctx.Process(target=worker, args=(j, barrier, queue, ready, stop),
                         daemon=True)
             for j in jobs]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        if during is not None:
            for _ in jobs:
                if not ready.acquire(timeout=max(deadline - time.monotonic(), 0.1)):
                    raise RuntimeError("a fleet process did not finish its first round")
            during()
            stop.set()
        out = [queue.get(timeout=max(deadline - time.monotonic(), 0.1)) for _ in jobs]
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"fleet processes exited with {bad}")
    return sorted(out, key=lambda r: r["worker"])
