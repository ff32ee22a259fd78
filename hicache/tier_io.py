"""``TierIO``: every byte the service moves between tiers, and the bookkeeping of it.

``HiCache`` (``hicache/service.py``) keeps the request registry, the controller and the per-step
agreement; what it decides, ``TierIO`` carries out on this rank:

- launching the controller's ops as transfer jobs (backup D2H, load H2D) and keeping one
  ``InFlight`` record per op until the agreement says every rank finished it (``poll`` reads
  each job's state once per step; ``complete`` applies an agreed op);
- which L3 chain each device page holds (``PageChain``), so a backup writes its L3 key;
- L3 write-back of finished backups (one writer per page among the replicas sharing a store);
  the companion pages' background writers (the draft's, the KDA snapshots': ``writers``) are
  polled for errors and flushed with the target's;
- the L3 prefetch of a request's pages after its L1/L2 hit (``L3Read``: the read and the
  staging buffer it fills) and the load-or-recompute decision (one ``CostModel``);
- the restore of agreed L3 pages into L1: a transfer job like a load (per-layer completion,
  timed and counted as H2D, a failure recorded and agreed like any copy's).

No collective here: failures go to ``record`` and ride on the service's next agreement.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from .config import HiCacheConfig
from .controller import BackupOp, LoadOp
from .errors import L3Error, TransferError
from .l1.pool import DeviceKVPool
from .l2.pool import HostKVPool
from .l2.transfer import DONE, FAILED, TransferEngine, TransferJob
from .l3 import (AsyncWriter, CostModel, Namespace, Prefetcher, PrefetchHandle, PrefetchPolicy,
                 keys_for_rank, open_store, should_write)
from .l3.guard import GuardedStore
from .companions.base import JobSet
from .l3.keys import DIGEST_BYTES, KEY_BYTES

log = logging.getLogger("hicache")

DIRECTIONS = ("d2h", "h2d")
# done: the read finished before the agreed restore; timeout: the policy stopped waiting first;
# error: the read raised (a shorter hit); below_threshold: fewer than prefetch_min_tokens to read;
# recompute: the cost model said prefill is faster; cancelled: the request ended first.
PREFETCH_OUTCOMES = ("done", "timeout", "error", "below_threshold", "recompute", "cancelled")


class FailedJob:
    """A copy that could not be issued: failed from the start, like a copy that raised."""

    def __init__(self, err: BaseException, direction: str) -> None:
        self.error = TransferError(f"could not issue the transfer: {err!r}")
        self.error.__cause__ = err
        self.direction = direction
        self.nbytes, self.seconds = 0, 0.0

    def status(self) -> str:
        return FAILED

    def wait(self, timeout: float | None = None) -> None:
        raise self.error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        raise self.error


Job = Union[TransferJob, FailedJob]


class Waits:
    """Several jobs seen as one (a request whose pages come from more than one copy)."""

    def __init__(self, jobs: Sequence[Job | "Waits"]) -> None:
        self.jobs = list(jobs)

    def wait_layer(self, layer: int) -> None:
        for j in self.jobs:
            j.wait_layer(layer)

    def wait(self) -> None:
        for j in self.jobs:
            j.wait()


def join(a: Job | Waits | None, b: Job | Waits | None) -> Job | Waits | None:
    """One waitable for both (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return Waits([a, b])


@dataclass(frozen=True)
class PageChain:
    """What a device page holds, as L3 knows it: the chain hash of its prefix and its index in
    that prefix (which picks the replica that writes it)."""

    chain: bytes
    index: int


@dataclass
class InFlight:
    """One launched transfer. ``op``: the controller op it carries out (None for an L3 restore,
    which no controller op tracks); ``chains``: for a backup, the L3 identity of each of its
    device pages when launched (None: nothing to write)."""

    job: Job
    op: Optional[Union[BackupOp, LoadOp]] = None
    chains: tuple[Optional[PageChain], ...] = ()
    target: bool = True  # False: a companion's restore (its bytes are in its own stats)

    @property
    def direction(self) -> str:
        return "d2h" if isinstance(self.op, BackupOp) else "h2d"


@dataclass
class L3Read:
    """A request's L3 prefetch: the read and the staging buffer it fills ([n, *shape] of the L3
    namespace's format, the L2 pool's; page i of the read lands in ``staging[i]``)."""

    handle: PrefetchHandle
    staging: torch.Tensor


@dataclass
class IOStats:
    bytes: dict = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})
    transfer_s: dict = field(default_factory=lambda: {d: 0.0 for d in DIRECTIONS})
    failed_copies: dict = field(default_factory=lambda: {d: 0 for d in DIRECTIONS})
    # L3 prefetch outcomes, one per request that looked L3 up (see PREFETCH_OUTCOMES)
    prefetch: dict = field(default_factory=lambda: {o: 0 for o in PREFETCH_OUTCOMES})


class TierIO:
    """This rank's data movement for one ``HiCache``: transfers, L3 reads and writes."""

    def __init__(self, config: HiCacheConfig, rank: int, l1: DeviceKVPool, l2: HostKVPool,
                 page_tokens: int, record: Callable[[BaseException], None], *,
                 replica: tuple[int, int] = (0, 1), l3: bool = False,
                 weights_signature: str = "") -> None:
        self.config, self.rank, self.replica = config, rank, replica
        self.l1, self.l2, self.page_tokens = l1, l2, page_tokens
        self.record = record  # this rank failed: agreed at the service's next step
        self.transfer = TransferEngine(l1, l2, io_backend=config.io.backend,
                                       copy_threads=config.io.copy_threads)
        self.stats = IOStats()
        self.observer = None  # hicache.metrics.HiCacheMetrics: observe(name, seconds, label)
        self.inflight: dict[int, InFlight] = {}  # controller op id -> its transfer
        self.restores: list[InFlight] = []       # L3 restores being copied into L1
        self.chain_of_page: dict[int, PageChain] = {}
        self.cost = CostModel(None, None)        # load or recompute, measured as the run goes
        self.namespace: Namespace | None = None
        self.l3: GuardedStore | None = None
        self.writer: AsyncWriter | None = None
        self.prefetcher: Prefetcher | None = None
        # the companions (hicache.companions): their ops ride the target's, their L3 writers
        # are polled and flushed with the target's
        self.companions: list = []
        self.events = None  # KV events (hicache.events.tiers.TierEvents) on the publishing rank
        if l3:
            try:
                self._open_l3(weights_signature)
            except BaseException:
                self.close()  # the transfer threads and whatever of L3 opened
                raise

    def _open_l3(self, weights_signature: str) -> None:
        c = self.config
        # L3 values are host pages: the namespace signs the L2 pool's format
        self.namespace = Namespace.from_config(c, model=weights_signature, fmt=self.l2.format)
        # a failing store ends L3 on this rank, never the run (hicache/l3/guard.py)
        self.l3 = GuardedStore(lambda: open_store(c.l3, self.namespace, self.rank), c.l3,
                               self.rank, self.namespace)
        self.writer = AsyncWriter(self.l3)
        p = c.policy
        self.prefetcher = Prefetcher(self.l3, PrefetchPolicy(
            p.prefetch, p.prefetch_timeout_s, p.prefetch_timeout_per_1k_s, p.prefetch_min_tokens))

    def keys(self, chains: Sequence[bytes]) -> list[bytes]:
        """This rank's L3 keys of ``chains``."""
        return keys_for_rank(chains, self.namespace, self.rank)

    # ---- device page -> L3 chain --------------------------------------------------------------
    def map_chains(self, pages: Sequence[int], chains: Sequence[bytes]) -> None:
        """Device page i of a prefix holds the page whose chain hash is ``chains[i]`` (the
        request's, ``hicache.service``): remember it, so a later backup of the page writes it
        under the right key."""
        if self.l3 is None:
            return
        for i, (page, chain) in enumerate(zip(pages, chains)):
            self.chain_of_page[page] = PageChain(chain, i)

    def chains_named(self, keys: Sequence[bytes]) -> list[bytes]:
        """The chain hashes store keys end with; none where a fleet secret keys them (the keyed
        chain names no page)."""
        from .l3.keyed import KeyedStore
        if isinstance(getattr(self.l3, "_store", None), KeyedStore):
            return []
        return [bytes(k[-DIGEST_BYTES:]) for k in keys if len(k) == KEY_BYTES]

    def unmap(self, pages: Iterable[int]) -> None:
        """Pages handed out afresh hold nothing yet: no backup may use an old key for them."""
        for p in pages:
            self.chain_of_page.pop(p, None)

    # ---- controller ops -----------------------------------------------------------------------
    def launch(self, ops: Iterable[Union[BackupOp, LoadOp]]) -> list[Job]:
        """Issue the controller's ops; returns the load jobs. An op that cannot even be issued
        (CUDA out of memory for its index tensors, a CuPy error) becomes a failed job: the op
        stays in flight like on every other rank, and the failure is agreed at the next step."""
        loads = []
        for op in ops:
            backup = isinstance(op, BackupOp)
            try:
                if backup:
                    job = self.transfer.backup(list(op.device_pages), list(op.host_pages))
                else:
                    job = self.transfer.load(list(op.host_pages), list(op.device_pages))
            except Exception as err:
                self.record(err)
                job = FailedJob(err, "d2h" if backup else "h2d")
            if self.companions:  # their pages move with the target's, as jobs of their own
                job = JobSet(job, self._companion_jobs(op, backup))
            if backup:
                chains = tuple(self.chain_of_page.get(p) for p in op.device_pages)
                self.inflight[op.op_id] = InFlight(job, op, chains)
            else:
                self.inflight[op.op_id] = InFlight(job, op)
                loads.append(job)
        return loads

    def _companion_jobs(self, op: Union[BackupOp, LoadOp], backup: bool) -> list:
        """The companions' jobs beside ``op`` (its pages are immutable while it is in
        flight); one that cannot be issued is a failed job, agreed like a copy's."""
        dev, host = list(op.device_pages), list(op.host_pages)
        jobs = []
        for c in self.companions:
            try:
                jobs.append(c.backup(dev, host) if backup else c.load(host, dev))
            except Exception as err:
                self.record(err)
                jobs.append(FailedJob(err, "d2h" if backup else "h2d"))
        return jobs

    def track(self, job) -> None:
        """A companion's restore job: polled (and its failure agreed) like the target's."""
        self.restores.append(InFlight(job, target=False))

    def jobs_of(self, op_ids: Iterable[int]) -> list[Job]:
        """The jobs of those ops still in flight."""
        return [self.inflight[o].job for o in op_ids if o in self.inflight]

    def poll(self) -> set[int]:
        """Once per step: the ops whose copies finished on this rank (ONE state read per job:
        a copy failing meanwhile is never seen as done). Failures are recorded and counted;
        restores that finished are counted and dropped; an L3 write error is recorded."""
        done = set()
        for o, rec in self.inflight.items():
            state = rec.job.status()
            if state == DONE:
                done.add(o)
            elif state == FAILED:
                self._failed(rec)
        pending = []
        for rec in self.restores:
            state = rec.job.status()
            if state == DONE:
                self._account(rec)
            elif state == FAILED:
                self._failed(rec)
            else:
                pending.append(rec)
        self.restores = pending
        for w in self.writers():
            if w.error is not None:
                self.record(w.error)
        return done

    def complete(self, op_ids: Iterable[int]) -> None:
        """Apply agreed ops: count them; a finished backup's pages go to L3 (this replica's)."""
        for o in op_ids:
            rec = self.inflight.pop(o)
            self._account(rec)
            if isinstance(rec.op, BackupOp) and self.writer is not None:
                self._write_back(rec)

    def _write_back(self, rec: InFlight) -> None:
        pairs = [(c.chain, h) for c, h in zip(rec.chains, rec.op.host_pages)
                 if c is not None and should_write(c.index, *self.replica)]
        if pairs:
            keys = self.keys([c for c, _ in pairs])
            try:
                fut = self.writer.submit(keys, [self.l2.read_page(h).clone() for _, h in pairs])
                if self.events is not None:  # KV events: announced once the store has them
                    self.events.on_l3_write([c for c, _ in pairs], fut)
                for c in self.companions:  # one copy for the group (their writing rank)
                    c.write_l3([c_ for c_, _ in pairs], [h for _, h in pairs])
            except Exception as err:  # agreed at the next step
                self.record(err)

    def _account(self, rec: InFlight) -> None:
        if not rec.target:
            return
        job = rec.job
        if self.observer is not None:
            self.observer.observe("transfer", job.seconds, rec.direction)
        self.stats.bytes[rec.direction] += job.nbytes
        self.stats.transfer_s[rec.direction] += job.seconds

    def _failed(self, rec: InFlight) -> None:
        self.record(_job_error(rec.job))
        self.stats.failed_copies[rec.direction] += 1

    def wait_all(self, ignore: type[BaseException] = TransferError) -> None:
        """Wait for every local copy; failures of type ``ignore`` are left to ``poll`` (they
        are agreed at the next step on every rank at once)."""
        for rec in list(self.inflight.values()) + list(self.restores):
            try:
                rec.job.wait()
            except ignore:
                pass

    # ---- L3 reads -----------------------------------------------------------------------------
    def start_prefetch(self, request_id, chains: Sequence[bytes], hit_len: int
                       ) -> L3Read | None:
        """Look the pages of a prompt (``chains``: the chain hashes of its whole pages, its
        last token never a hit) after the first ``hit_len`` tokens up in L3 and start reading them. None when fewer than the policy's
        ``prefetch_min_tokens`` could be read at all (replicated facts only: every rank returns
        None alike); otherwise a read, of 0 pages where this rank lacks them or would rather
        recompute (the MIN agreement then says 0 for every rank)."""
        P = self.page_tokens
        first = hit_len // P
        min_tokens = self.config.policy.prefetch_min_tokens
        if (len(chains) - first) * P < max(1, min_tokens):
            if len(chains) > first:
                self.stats.prefetch["below_threshold"] += 1
            return None
        keys = self.keys(chains[first:])
        n = self.l3.exists_prefix(keys)
        if self.events is not None:  # pages this group knows are in L3 (a purge names), and
            if n:                    # the first one it finds gone (all a prefix read misses)
                self.events.l3_found(chains[first:first + n])
            if first + n < len(chains):
                self.events.l3_missing(chains[first + n:first + n + 1])
        if n and n * P < min_tokens:
            self.stats.prefetch["below_threshold"] += 1
            n = 0
        elif n and not self.worth_loading(n):
            self.stats.prefetch["recompute"] += 1
            n = 0
        staging = torch.empty((n, *self.namespace.shard_shape), dtype=self.namespace.torch_dtype)
        read = L3Read(self.prefetcher.start(request_id, keys[:n], list(staging)), staging)
        # A short read (policy prefetch_wait_pages / prefetch_wait_s) is waited for here: done
        # before the step right after admission, it is agreed there and its request starts a
        # step sooner (on a warm store most hits end in a few L3 pages past a long L1 hit). A
        # late read is simply agreed a step later, as any read.
        p = self.config.policy
        if n <= p.prefetch_wait_pages and p.prefetch_wait_s > 0:
            read.handle.wait(p.prefetch_wait_s)
        return read

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(tokens, seconds)

    def observe_step(self, seconds: float) -> None:
        """A scheduler step took ``seconds``: what an L3 load waits at least beyond its read
        (it is usable once agreed, a step later), as the cost model's fixed load overhead (a
        running average like its rates)."""
        self.cost.observe_overhead(seconds)

    def worth_loading(self, pages: int) -> bool:
        """Load ``pages`` L3 pages rather than prefill them? (Always, with the cost model off
        or nothing measured yet.)"""
        if not self.config.policy.l3_cost_model:
            return True
        self.cost.observe_store(self.l3.stats)
        if not self.cost.measured:
            return True  # nothing measured yet: try the store
        return self.cost.should_load(pages * self.page_tokens, pages * self.namespace.shard_bytes)

    def restore(self, read: L3Read, device_pages: list[int]) -> Job:
        """Copy the first ``len(device_pages)`` pages ``read`` fetched (every rank holds them:
        agreed) into ``device_pages``, as a transfer job with per-layer completion. It stays in
        flight until ``poll`` sees it end; a failure is recorded and agreed like any copy's."""
        try:
            job = self.transfer.restore(read.staging[:len(device_pages)], device_pages)
        except Exception as err:  # e.g. out of device memory: agreed at the next step
            self.record(err)
            job = FailedJob(err, "h2d")
        self.restores.append(InFlight(job))
        return job

    def end_prefetch(self, read: L3Read) -> None:
        """The restore was agreed: stop reading (pages past the agreed count are not needed)
        and count how the read ended."""
        h = read.handle
        fin = h.finished  # read first: a finished read's error is final
        outcome = "timeout" if not fin else "done" if h.error is None else "error"
        h.cancel(wait=False)
        if h.keys:  # this rank found pages in L3 and read them
            self.stats.prefetch[outcome] += 1
            if self.observer is not None:
                self.observer.observe("restore", time.monotonic() - h.started)

    def cancel_prefetch(self, read: L3Read) -> None:
        """The request ended before its restore was agreed: stop its read (its buffer is no
        longer written on return) and count it. A read stuck in the store past the handle's
        bound is abandoned, never waited for without end: its staging buffer is this read's
        alone (never restored from now), so a late write into it harms nothing."""
        try:
            read.handle.cancel()
        except L3Error as err:
            log.warning("%s", err)
        self.stats.prefetch["cancelled"] += bool(read.handle.keys)

    # ---- shutdown -----------------------------------------------------------------------------
    def writers(self) -> list:
        """This rank's L3 writers: the target's, then the companions' (on the group's writing
        rank; their owners close them, after ``close`` here and before their stores)."""
        ws = [self.writer, *(c.writer for c in self.companions)]
        return [w for w in ws if w is not None]

    def flush_writes(self) -> None:
        """Wait for the L3 writes queued so far (the companions' too); an error is recorded
        (agreed next step)."""
        for w in self.writers():
            try:
                w.flush()
            except Exception as err:
                self.record(err)

    def close(self) -> None:
        """Stop copies before the pools go, close the writer (flushed already by the service's
        drain, or after a failure that was reported), the prefetcher, the store and the
        transfer engine. Never raises for a failure reported already."""
        self.wait_all(Exception)
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception:
            pass  # only reachable after a failure (flush=False or stopped): reported
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()
            if self.l3 is not None:
                self.l3.close()
            self.writer = self.prefetcher = self.l3 = None
            self.companions = []
            self.transfer.close()


def _job_error(job: Job) -> TransferError:
    """The TransferError a failed job's ``wait`` raises."""
    try:
        job.wait()
    except TransferError as err:
        return err
    return TransferError("a transfer failed")  # unreachable for a FAILED job
