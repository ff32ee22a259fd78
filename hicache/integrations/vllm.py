"""hicache's L3 as a secondary tier of vLLM's CPU offload (``TieringOffloadingSpec``).

Turn it on with vLLM's own connector config, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 68719476736,
        "secondary_tiers": [{"type": "HiCacheTier",
                             "module_path": "hicache.integrations.vllm",
                             "store": "redis://l3-host:6379/0"}]}}'

Tier arguments: ``store`` (an LMDB directory, a Redis URL or a list of Redis Cluster node URLs),
``capacity_bytes`` (LMDB), ``timeout_s`` (Redis), ``mla`` (dedupe MLA copies; default: vLLM's
``use_mla`` when it can be read, else False), ``weights_signature`` (pins the weights when the
model is a hub id), ``io_threads``, ``locality``.

The tier runs in vLLM's scheduler process and sees, per chunk, one CPU row holding every worker's
slot (:mod:`hicache.integrations.rows`). It stores each distinct shard once, under hicache's
per-shard keys (``namespace | shard | hash of vLLM's OffloadKey``), and rebuilds the duplicate
slots on load. Values carry hicache's checksums: a corrupt or foreign value is a miss, never
loaded. The namespace signs vLLM's model, weights, KV dtype, parallel sizes, block sizes, KV groups
and worker bytes, so a store written under another configuration never hits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadKey, ReqContext,
                                     RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ..checks import check_int
from ..errors import L3Error
from ..l3 import Namespace
from .common import open_stores, signature, store_keys, weights_signature
from .rows import RowLayout, row_layout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)


def _detect_mla() -> bool:
    """vLLM's ``model_config.use_mla`` when a vLLM config is current, else False (no dedupe:
    always correct, only larger)."""
    try:
        from vllm.config import get_current_vllm_config
        mc = get_current_vllm_config().model_config
        return bool(getattr(mc, "use_mla", False))
    except Exception:
        return False


def namespace_for(config: Any, layout: RowLayout, mla: bool, weights: str) -> Namespace:
    """The L3 namespace of a vLLM ``OffloadingConfig``: one shard = one worker slot's bytes."""
    par, model, cache = config.parallel, config.model, config.cache
    groups = [(g.tokens_per_block, list(g.layer_names)) for g in config.groups]
    fields = {
        "engine": "vllm", "model": model.name, "weights": weights, "kv_dtype": model.dtype,
        "tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size,
        "world": par.world_size, "tokens_per_hash": cache.tokens_per_hash,
        "blocks_per_chunk": cache.blocks_per_chunk, "groups": groups,
        "worker_bytes_per_block": config.worker_kv_bytes_per_block, "mla": mla,
        "single_copy": layout.slots == 1, "canonical": bool(config.canonical_layout),
        "kv_layout": config.kv_cache_layout,
    }
    return Namespace(model=signature(fields), num_layers=1, kv_dim=layout.worker_bytes,
                     dtype="uint8", page_size=1, dcp_size=layout.num_shards)


class _Lookup(AsyncLookupManager):
    """vLLM's async lookup front end; a batch (one request's keys, in chunk order) is a hit up
    to the shortest stored prefix over all shards."""

    def __init__(self, tier: "HiCacheTier", tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        n = self._tier.stored_prefix(keys)
        return [i < n for i in range(len(keys))]


class HiCacheTier(SecondaryTierManager):
    """A vLLM secondary tier over hicache's L3 page store (LMDB or Redis)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview,
                 tier_type: str, store: Any = None, capacity_bytes: int | None = None,
                 timeout_s: float | None = None, mla: bool | None = None,
                 weights_signature: str | None = None, io_threads: int = 2,
                 locality: str | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if store is None:
            raise L3Error("the hicache tier needs 'store': an LMDB directory, a Redis URL or a "
                          "list of Redis Cluster node URLs")
        check_int(io_threads, "io_threads", error=L3Error)
        self.locality = Locality(locality) if locality is not None else None
        config = offloading_spec.config
        par = config.parallel
        self.mla = _detect_mla() if mla is None else bool(mla)
        single = bool(getattr(offloading_spec, "replicated_layout", False))
        worker_bytes = int(getattr(offloading_spec, "cpu_page_size_per_worker", 0))
        self.layout = row_layout(world_size=par.world_size, tp=par.tp_size, pp=par.pp_size,
                                 pcp=par.pcp_size, dcp=par.dcp_size, mla=self.mla,
                                 single_copy=single, worker_bytes=worker_bytes)
        if self.layout.used_bytes > self.block_size_bytes:
            raise L3Error(f"{self.layout.slots} worker slots of {worker_bytes} B do not fit the "
                          f"primary row of {self.block_size_bytes} B")
        self.namespace = namespace_for(config, self.layout, self.mla,
                                       weights_signature_of(config, weights_signature))
        # [num_chunks, row_bytes] uint8 over vLLM's primary tier (no copy)
        self._rows = np.asarray(primary_kv_view).view(np.uint8).reshape(len(primary_kv_view), -1)
        self._shards = range(self.layout.num_shards)
        self._slots = {s: self.layout.slots_of(s) for s in self._shards}
        self.stores = open_stores(store, self.namespace, self._shards,
                                  capacity_bytes=capacity_bytes, timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache_vllm_tier")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._inflight: dict[int, Future] = {}
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._lookup = _Lookup(self, tier_type)
        self._closed = False

    # ---- shard I/O (pool threads) ----------------------------------------------------------------
    def stored_prefix(self, keys: list[OffloadKey]) -> int:
        """Leading keys held by every shard."""
        n = len(keys)
        for s in self._shards:
            if n == 0:
                break
            n = min(n, self.stores[s].exists_prefix(store_keys(keys[:n], self.namespace, s)))
        return n

    def _slot(self, chunk: int, slot: int) -> torch.Tensor:
        """Worker slot ``slot`` of primary row ``chunk`` as a [1, 1, bytes] view."""
        return torch.from_numpy(self._rows[chunk, self.layout.span(slot)]).view(1, 1, -1)

    def _store(self, keys: list[OffloadKey], chunks: list[int]) -> bool:
        ok = [True] * len(keys)
        for i, c in enumerate(chunks):  # under MLA the copies must really be copies
            row = self._rows[c]
            for slots in self._slots.values():
                first = row[self.layout.span(slots[0])]
                if any(not np.array_equal(first, row[self.layout.span(o)]) for o in slots[1:]):
                    ok[i] = False
        if not all(ok):
            log.error("hicache tier: %d of %d chunks hold differing copies of an MLA shard; "
                      "not stored (set mla=false for a model whose workers hold different "
                      "bytes)", ok.count(False), len(ok))
        good = [i for i in range(len(keys)) if ok[i]]
        for s, slots in self._slots.items():
            if not good:
                break
            res = self.stores[s].put(store_keys([keys[i] for i in good], self.namespace, s),
                                     [self._slot(chunks[i], slots[0]) for i in good])
            for i, stored in zip(good, res.stored):
                ok[i] = ok[i] and stored
        return all(ok)

    def _load(self, keys: list[OffloadKey], chunks: list[int]) -> int:
        """Load the leading keys every shard serves into their rows; returns how many."""
        n = len(keys)
        for s, slots in self._slots.items():
            if n == 0:
                break
            got = self.stores[s].get(store_keys(keys[:n], self.namespace, s),
                                     lambda i, first=slots[0]: self._slot(chunks[i], first))
            n = min(n, got)
        for i in range(n):  # rebuild the row: every copy of a shard from the one loaded
            row = self._rows[chunks[i]]
            for slots in self._slots.values():
                src = row[self.layout.span(slots[0])]
                for o in slots[1:]:
                    row[self.layout.span(o)] = src
        return n

    def _run(self, job: TransferJob, promotion: bool) -> None:
        keys, chunks = list(job.keys), [int(c) for c in job.chunk_ids]
        t0 = time.perf_counter()
        try:
            if promotion:
                n = self._load(keys, chunks)
                ok = n == len(keys)
                part = tuple(keys[:n]) if (not ok and n) else None
                nbytes = n * self.block_size_bytes
            else:
                ok, part = self._store(keys, chunks), None
                nbytes = len(keys) * self.block_size_bytes
        except Exception:  # a tier must report every job; the store itself never raises I/O
            log.exception("hicache tier: %s job %d failed", "load" if promotion else "store",
                          job.job_id)
            ok, part, nbytes = False, None, None
        res = JobResult(job_id=job.job_id, success=ok, successful_keys=part,
                        transfer_time=time.perf_counter() - t0, transfer_bytes=nbytes)
        with self._lock:
            self._finished.append(res)

    def _submit(self, job: TransferJob, promotion: bool) -> None:
        if len(job.keys) != len(job.chunk_ids):
            raise L3Error(f"job {job.job_id}: {len(job.keys)} keys but {len(job.chunk_ids)} "
                          "chunk ids")
        fut = self._pool.submit(self._run, job, promotion)
        with self._lock:
            self._inflight[job.job_id] = fut
        fut.add_done_callback(lambda _f, j=job.job_id: self._done(j))

    def _done(self, job_id: int) -> None:
        with self._lock:
            self._inflight.pop(job_id, None)

    # ---- SecondaryTierManager ----------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._load_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(job_metadata, promotion=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        for r in done:
            keys = self._load_keys.pop(r.job_id, None)
            if keys is not None and not r.success:  # stop re-promoting what is not there
                kept = set(r.successful_keys or ())
                self._lookup.mark_miss([k for k in keys if k not in kept])
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                futs = list(self._inflight.values())
            if not futs:
                return
            for f in futs:
                f.exception()  # waits; _run reports its own failures

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        self._rows = None  # release vLLM's buffer (its region unmaps only when unexported)
        for s in self.stores.values():
            s.close()


def weights_signature_of(config: Any, override: str | None) -> str:
    return weights_signature(config.model.name, override)
