"""hicache's L3 as a secondary tier of vLLM's CPU offload (``TieringOffloadingSpec``).

Turn it on with vLLM's own connector config, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 68719476736,
        "secondary_tiers": [{"type": "HiCacheTier",
                             "module_path": "hicache.integrations.vllm",
                             "store": "redis://l3-host:6379/0",
                             "secret_file": "/etc/hicache/l3.secret"}]}}'

Tier arguments: ``store`` (an LMDB directory, a Redis URL or a list of Redis Cluster node URLs),
``capacity_bytes`` (LMDB), ``timeout_s`` (Redis), ``mla`` (dedupe MLA copies; default: vLLM's
``use_mla`` when it can be read, else False), ``weights_signature`` (pins the weights when the
model is a hub id), ``quantization`` and ``revision`` (default: vLLM's model config when one is
current), ``io_threads``, ``locality`` (default: REMOTE for a Redis URL, LOCAL for LMDB; a remote
tier gets vLLM's network backpressure water marks), ``secret_file`` / ``previous_secret_file`` /
``authenticate`` (the fleet secret, as in a policy's ``[l3]``: a Redis store without one is
refused unless ``authenticate`` is false; default ``$HICACHE_L3_SECRET_FILE``), ``enable_kv_events`` (BlockStored events with
medium STORAGE for what the tier stored, when vLLM's KV events are on).

The tier runs in vLLM's scheduler process and sees, per chunk, one CPU row holding every worker's
slot (:mod:`hicache.integrations.rows`). It stores each distinct shard once, under hicache's
per-shard keys (``namespace | shard | hash of vLLM's OffloadKey``), and rebuilds the duplicate
slots on load. Values carry hicache's checksums: a corrupt or foreign value is a miss, never
loaded. The namespace signs what changes a shard's bytes: vLLM's model, weights, revision, weight
quantization, KV dtype, block sizes, KV groups and worker bytes, and the parallel sizes only where
they change a worker's bytes (an MLA latent is the same at TP=2 and TP=4: those share pages; a KV
split by heads keeps every size). Lookups answer per key, in whatever order vLLM sends them.
Stats: hits, misses, errors by reason, bytes, seconds and latency through ``get_stats`` (vLLM's
offloading stats and Prometheus endpoint; names in docs/integrations.md).
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

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadingCounterMetadata,
                                     OffloadingEvent, OffloadingHistogramMetadata,
                                     OffloadingMetricMetadata, OffloadKey, ReqContext,
                                     RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ..checks import check_int
from ..errors import L3Error
from ..l3 import Namespace
from .common import (held, is_remote, kv_dtype_name, open_stores, signature, store_keys,
                     trust_of, undersized, weights_fields)
from .health import REASONS, Health
from .rows import RowLayout, row_layout

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)


def _current_model_config() -> Any:
    """vLLM's ``model_config`` when a vLLM config is current, else None."""
    try:
        from vllm.config import get_current_vllm_config
        return get_current_vllm_config().model_config
    except Exception:
        return None


def _detect_mla() -> bool:
    """vLLM's ``model_config.use_mla`` when a vLLM config is current, else False (no dedupe:
    always correct, only larger)."""
    return bool(getattr(_current_model_config(), "use_mla", False))


def namespace_for(config: Any, layout: RowLayout, mla: bool, weights: dict[str, str], *,
                  quantization: str | None = None, revision: str | None = None) -> Namespace:
    """The L3 namespace of a vLLM ``OffloadingConfig``: one shard = one worker slot's bytes.

    It signs everything that changes a shard's bytes (model weights and revision, weight
    quantization, KV dtype, block and chunk sizes, groups, layout) and nothing that does not:
    an MLA latent is the same on every TP rank, and vLLM's replicated (single-copy) row is the
    same row at every TP size, so a shard depends only on the pipeline stage and the DCP split,
    and deployments at TP=2 and TP=4 share pages; a KV split by heads keeps every parallel
    size."""
    par, model, cache = config.parallel, config.model, config.cache
    groups = [(g.tokens_per_block, list(g.layer_names)) for g in config.groups]
    fields = {
        "engine": "vllm", **weights,  # by content for a local checkpoint (weights_fields)
        "revision": revision, "quantization": quantization,
        "kv_dtype": kv_dtype_name(model.dtype),
        "tokens_per_hash": cache.tokens_per_hash,
        "blocks_per_chunk": cache.blocks_per_chunk, "groups": groups,
        "worker_bytes_per_block": config.worker_kv_bytes_per_block, "mla": mla,
        "canonical": bool(config.canonical_layout), "kv_layout": config.kv_cache_layout,
    }
    single = bool(getattr(config, "replicated_layout", False))  # vLLM's one-copy row
    if (mla or single) and par.pcp_size == 1:  # rows alike at every TP: (PP stage, DCP rank)
        fields.update(pp=par.pp_size, dcp=par.dcp_size)
    else:
        fields.update(tp=par.tp_size, pp=par.pp_size, pcp=par.pcp_size, dcp=par.dcp_size,
                      world=par.world_size)
    return Namespace(model=signature(fields), num_layers=1, kv_dim=layout.worker_bytes,
                     dtype="uint8", page_size=1, dcp_size=layout.num_shards)


def request_chunks(config: Any) -> tuple[int, int]:
    """(offload chunks one request of max_model_len tokens takes, max_model_len); (0, 0) when
    vLLM does not say (its config's ``model.max_model_len``, else the current model config)."""
    max_len = int(getattr(config.model, "max_model_len", 0) or
                  getattr(_current_model_config(), "max_model_len", 0) or 0)
    if max_len <= 0:
        return 0, 0
    per = int(config.cache.blocks_per_chunk)
    return sum(-(-max_len // (int(g.tokens_per_block) * per)) for g in config.groups), max_len


def worker_bytes_of(config: Any, spec: Any = None, row_bytes: int = 0) -> int:
    """One worker's bytes of one offload chunk: from the config (whatever the spec); a spec
    that leaves ``worker_kv_bytes_per_block`` 0 (vLLM's test specs) gets them from the row
    its workers registered (the CPU spec's per-worker slot, else the primary row split among
    its slots)."""
    per_block = int(config.worker_kv_bytes_per_block)
    if per_block > 0:
        return per_block * int(config.cache.blocks_per_chunk)
    slot = int(getattr(spec, "cpu_page_size_per_worker", 0) or 0)
    if slot > 0:
        return slot
    single = bool(getattr(config, "replicated_layout", False))
    return int(row_bytes) // (1 if single else max(1, int(config.parallel.world_size)))


def _events_list(spec: Any, enabled: bool) -> "list[OffloadingEvent] | None":
    """Where the tier's KV events gather: a list when asked and vLLM's KV events are on."""
    if not enabled:
        return None
    if spec.kv_events_config.enable_kv_cache_events:
        return []
    log.warning("hicache tier: enable_kv_events is set but vLLM's KV cache events are off; "
                "the tier emits none")
    return None


class _Lookup(AsyncLookupManager):
    """vLLM's async lookup front end. A batch holds one scheduler step's keys in any order
    (a sliding-window lookup sends a request's keys last first): one answer per key, a hit when
    every shard holds it."""

    def __init__(self, tier: "HiCacheTier", tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.held(keys)


class HiCacheTier(SecondaryTierManager):
    """A vLLM secondary tier over hicache's L3 page store (LMDB or Redis)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview,
                 tier_type: str, store: Any = None, capacity_bytes: int | None = None,
                 timeout_s: float | None = None, mla: bool | None = None,
                 weights_signature: str | None = None, io_threads: int = 2,
                 locality: str | None = None, enable_kv_events: bool = False,
                 quantization: str | None = None, revision: str | None = None,
                 secret_file: str | None = None, previous_secret_file: str | None = None,
                 authenticate: bool = True,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if store is None:
            raise L3Error("the hicache tier needs 'store': an LMDB directory, a Redis URL or a "
                          "list of Redis Cluster node URLs")
        trust = trust_of({"secret_file": secret_file, "authenticate": authenticate,
                          "previous_secret_file": previous_secret_file})
        check_int(io_threads, "io_threads", error=L3Error)
        # A Redis store is remote: say so (KV events, and vLLM's backpressure water marks)
        self.locality = Locality(locality if locality is not None else
                                 ("REMOTE" if is_remote(store) else "LOCAL"))
        if locality is None and backpressure_detector is not None:
            remote_water_marks(backpressure_detector, tier_type, self.locality)
        config = offloading_spec.config
        par = config.parallel
        self.mla = _detect_mla() if mla is None else bool(mla)
        # Only what every spec has (the config and vLLM's row): never a CPU-spec attribute.
        worker_bytes = worker_bytes_of(config, offloading_spec, self.block_size_bytes)
        single = bool(getattr(config, "replicated_layout", False))  # vLLM's one-copy row
        self.layout = row_layout(world_size=par.world_size, tp=par.tp_size, pp=par.pp_size,
                                 pcp=par.pcp_size, dcp=par.dcp_size, mla=self.mla,
                                 single_copy=single, worker_bytes=worker_bytes)
        if self.layout.used_bytes > self.block_size_bytes:
            raise L3Error(f"{self.layout.slots} worker slots of {worker_bytes} B do not fit the "
                          f"primary row of {self.block_size_bytes} B")
        mc = _current_model_config()
        if quantization is None:
            quantization = getattr(mc, "quantization", None)
        if revision is None:
            revision = getattr(mc, "revision", None)
        self.namespace = namespace_for(config, self.layout, self.mla,
                                       weights_signature_of(config, weights_signature),
                                       quantization=quantization, revision=revision)
        # [num_chunks, row_bytes] uint8 over vLLM's primary tier (no copy)
        self._rows = np.asarray(primary_kv_view).view(np.uint8).reshape(len(primary_kv_view), -1)
        self._shards = range(self.layout.num_shards)
        self._slots = {s: self.layout.slots_of(s) for s in self._shards}
        self._warn_sizes(offloading_spec, capacity_bytes if not is_remote(store) else None)
        self.stores = open_stores(store, self.namespace, self._shards,
                                  capacity_bytes=capacity_bytes, timeout_s=timeout_s,
                                  trust=trust)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache_vllm_tier")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._inflight: dict[int, Future] = {}
        self._load_job_keys: dict[int, list[OffloadKey]] = {}
        self._store_job_keys: dict[int, list[OffloadKey]] = {}
        self.events = _events_list(offloading_spec, enable_kv_events)
        self.health = Health()
        self._latency: list[tuple[str, float]] = []
        self._lookup_manager = _Lookup(self, tier_type)
        self._closed = False

    def _warn_sizes(self, spec: Any, capacity: int | None) -> None:
        """One warning line for vLLM's CPU tier (``cpu_bytes_to_use``) or this tier's LMDB
        ``capacity_bytes`` smaller than one chunk, or than one request at max_model_len."""
        chunks, max_len = request_chunks(spec.config)
        row, shard_row = self.block_size_bytes, self.layout.num_shards * \
            self.layout.worker_bytes
        sizes = [("CPU tier (cpu_bytes_to_use)", int(getattr(spec, "num_chunks", 0)) * row,
                  row)]
        if capacity is not None:
            sizes.append(("hicache tier's LMDB store (capacity_bytes)", int(capacity),
                          shard_row))
        for tier, have, block in sizes:
            line = undersized(tier, have, block, chunks * block if chunks else None, max_len)
            if line:
                log.warning(line)

    # ---- shard I/O (pool threads) ----------------------------------------------------------------
    def held(self, keys: list[OffloadKey]) -> list[bool]:
        """Per key (any order): held by every shard?"""
        t0 = time.perf_counter()
        ok = [True] * len(keys)
        for s in self._shards:
            idx = [i for i in range(len(keys)) if ok[i]]
            if not idx:
                break
            got = held(self.stores[s], store_keys([keys[i] for i in idx], self.namespace, s))
            for i, g in zip(idx, got):
                ok[i] = g
        self.health.outcome(hits=sum(ok), misses=len(ok) - sum(ok))
        self._observe("lookup", time.perf_counter() - t0)
        return ok

    def stored_prefix(self, keys: list[OffloadKey]) -> int:
        """Leading keys held by every shard."""
        n = len(keys)
        for s in self._shards:
            if n == 0:
                break
            n = min(n, self.stores[s].exists_prefix(store_keys(keys[:n], self.namespace, s)))
        return n

    def _observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self._latency.append((op, seconds))

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
        dt = time.perf_counter() - t0
        self._observe("load" if promotion else "store", dt)
        if promotion:
            n_ok = len(keys) if ok else len(part or ())
            self.health.outcome(misses=len(keys) - n_ok)
        res = JobResult(job_id=job.job_id, success=ok, successful_keys=part,
                        transfer_time=dt, transfer_bytes=nbytes)
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
        found = self._lookup_manager.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self.events is not None:
            self._store_job_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(job_metadata, promotion=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._load_job_keys[job_metadata.job_id] = list(job_metadata.keys)
        self._submit(job_metadata, promotion=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        for r in done:
            stored = self._store_job_keys.pop(r.job_id, None)
            if stored and r.success and self.events is not None:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium,
                                                   removed=False, locality=self.locality))
            keys = self._load_job_keys.pop(r.job_id, None)
            if keys is not None and not r.success:  # stop re-promoting what is not there
                kept = set(r.successful_keys or ())
                self._lookup_manager.mark_miss([k for k in keys if k not in kept])
        return done

    def take_events(self) -> Iterable[OffloadingEvent]:
        """KV events (``BlockStored`` with medium STORAGE) of the chunks this tier stored, so a
        KV-event-aware router sees what is in hicache's L3 (``enable_kv_events``)."""
        if self.events is None:
            return ()
        out, self.events = self.events, []
        return out

    # ---- stats through vLLM's offloading stats (its Prometheus endpoint) ---------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self):
        """hicache's L3 health since the last call, as vLLM ``OffloadingConnectorStats``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats)
        d = self.health.take(self.stores.values())
        with self._lock:
            lat, self._latency = self._latency, []
        if d.empty and not lat:
            return None
        st = OffloadingConnectorStats()
        tier = (self.tier_type,)
        for name, v in ((HITS, d.hits), (MISSES, d.misses), (READ_BYTES, d.bytes_read),
                        (WRITE_BYTES, d.bytes_written), (READ_SECONDS, d.read_s),
                        (WRITE_SECONDS, d.write_s), (PAGES_WRITTEN, d.pages_written)):
            if v:
                st.increase_counter(name, v, tier)
        for reason, n in d.errors.items():
            st.increase_counter(ERRORS, n, tier + (reason,))
        for op, sec in lat:
            st.observe_histogram(LATENCY, sec, tier + (op,))
        return st

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight or self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup_manager.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup_manager.flush()

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
        self._lookup_manager.shutdown()
        self._pool.shutdown(wait=True)
        self._rows = None  # release vLLM's buffer (its region unmaps only when unexported)
        for s in self.stores.values():
            s.close()


# hicache's L3 health in vLLM's offloading stats (Prometheus names; docs/integrations.md)
HITS = "vllm:kv_offload_hicache_l3_hits"
MISSES = "vllm:kv_offload_hicache_l3_misses"
ERRORS = "vllm:kv_offload_hicache_l3_errors"
READ_BYTES = "vllm:kv_offload_hicache_l3_read_bytes"
WRITE_BYTES = "vllm:kv_offload_hicache_l3_write_bytes"
READ_SECONDS = "vllm:kv_offload_hicache_l3_read_seconds"
WRITE_SECONDS = "vllm:kv_offload_hicache_l3_write_seconds"
PAGES_WRITTEN = "vllm:kv_offload_hicache_l3_pages_written"
LATENCY = "vllm:kv_offload_hicache_l3_latency_seconds"
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def metric_definitions() -> dict[str, "OffloadingMetricMetadata"]:
    c = OffloadingCounterMetadata
    return {
        HITS: c(documentation="Chunks the hicache L3 tier answered as held (lookups).",
                labelnames=("tier",)),
        MISSES: c(documentation="Chunks the hicache L3 tier answered as missing (lookups and "
                                "loads that fell short).", labelnames=("tier",)),
        ERRORS: c(documentation="hicache L3 failures by reason (" + ", ".join(REASONS) + ").",
                  labelnames=("tier", "reason")),
        READ_BYTES: c(documentation="Bytes read from hicache's L3.", labelnames=("tier",)),
        WRITE_BYTES: c(documentation="Bytes written to hicache's L3.", labelnames=("tier",)),
        READ_SECONDS: c(documentation="Seconds inside hicache L3 reads.", labelnames=("tier",)),
        WRITE_SECONDS: c(documentation="Seconds inside hicache L3 writes.",
                         labelnames=("tier",)),
        PAGES_WRITTEN: c(documentation="Shards newly written to hicache's L3.",
                         labelnames=("tier",)),
        LATENCY: OffloadingHistogramMetadata(
            documentation="hicache L3 tier operation latency (lookup, load, store), seconds.",
            labelnames=("tier", "op"), buckets=LATENCY_BUCKETS),
    }


def remote_water_marks(detector: Any, tier_type: str, locality: Locality) -> None:
    """vLLM picks a tier's backpressure defaults by its type before the tier exists; a tier
    whose store is remote (Redis) gets the network defaults, as vLLM's remote tiers do, unless
    the config set its own."""
    cls = type(detector)
    local = cls.default_config(tier_type, locality=None) or {}
    mine = cls.default_config(tier_type, locality=locality.value) or {}
    for k, v in mine.items():
        for attr in _DETECTOR_ATTRS.get(k, (k, "_" + k)):
            if hasattr(detector, attr) and getattr(detector, attr) == local.get(k):
                setattr(detector, attr, v)


# where vLLM's EMABackpressureDetector keeps each default_config key
_DETECTOR_ATTRS = {"high_water_s": ("_high", "high_water_s"),
                   "low_water_s": ("_low", "low_water_s")}


def weights_signature_of(config: Any, override: str | None) -> dict[str, str]:
    """The namespace fields naming vLLM's model's weights (:func:`weights_fields`)."""
    return weights_fields(config.model.name, override)
