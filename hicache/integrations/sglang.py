"""hicache's L3 as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

Turn it on with SGLang's own flags, no patch to SGLang (DCP 1)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheL3Storage",
        "interface_v1": 1, "store": "redis://l3-host:6379/0",
        "secret_file": "/etc/hicache/l3.secret"}'

Extra-config keys: ``store`` (an LMDB directory, a Redis URL or a list of Redis Cluster node
URLs), ``capacity_bytes`` (LMDB), ``timeout_s`` (Redis), ``secret_file`` /
``previous_secret_file`` / ``authenticate`` (the fleet secret, as in a policy's ``[l3]``: a Redis
store without one is refused unless ``authenticate`` is false), ``weights_signature`` (pins the weights
when the model is a hub id), and ``quantization``, ``kv_cache_dtype``, ``revision`` (default:
SGLang's server args; each changes the bytes, so each is in the namespace). ``interface_v1`` makes SGLang call ``batch_get_v1``/``batch_set_v1``,
which copy straight between the store and the host pool; without it SGLang's generic path calls
``batch_get``/``batch_set`` with flat pages.

Each rank keeps its own shard: keys are ``namespace | DCP rank | hash of SGLang's page hash``, the
value one rank's rows of the widened page in hicache's ``[layers, P, kv_dim]`` order whatever the
host layout (so ``layer_first``, ``page_first`` and ``page_first_direct`` pools share a store).
Any rank may write (SGLang itself backs up only from its writers, the first DCP group; a key
already stored is not rewritten). Values carry hicache's checksums: a corrupt value is a miss.
Reads and writes answer per key: a missing or corrupt page fails only itself. ``clear()`` deletes
this namespace's pages; ``get_stats()`` returns SGLang's ``StorageMetrics`` and counts hicache's
L3 health (hits, misses, errors by reason, bytes, seconds) in ``hicache_l3_*`` Prometheus series.

SGLang 0.5.23 refuses every storage backend but ``file`` and ``mooncake`` when DCP > 1, in
``HiCacheController.attach_storage_backend``; :data:`UPSTREAM_DCP_CHECK` is the one-line change
that lifts it (see docs/integrations.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ..errors import L3Error
from ..l3 import L3Store, Namespace, open_store
from .common import (get_each, kv_dtype_name, require_client, signature,
                     store_keys, trust_of, weights_fields)
from .health import REASONS, Health

log = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# The line of sglang/srt/managers/cache_controller.py (0.5.23) that refuses dynamic backends
# under DCP, and the line that lets them through.
UPSTREAM_DCP_CHECK = (
    'if storage_backend not in ("file", "mooncake"):',
    'if storage_backend not in ("file", "mooncake", "dynamic"):',
)


def page_view(pool: Any, index: int) -> torch.Tensor:
    """This rank's rows of the logical page starting at host index ``index``, as a [L, P, D]
    view into the pool (no copy)."""
    v = pool.get_data_page(int(index), flat=False)
    if pool.layout == "layer_first":  # [L, P, 1, D]
        return v[:, :, 0, :]
    if pool.layout == "page_first":  # [P, L, 1, D]
        return v[:, :, 0, :].permute(1, 0, 2)
    if pool.layout == "page_first_direct":  # [1, L, P, 1, D]
        return v[0, :, :, 0, :]
    raise L3Error(f"host layout {pool.layout!r} is not supported; use one of {LAYOUTS}")


def flat_view(pool: Any, flat: torch.Tensor) -> torch.Tensor:
    """A flat page in the pool's own order (SGLang's generic path) as a [L, P, D] view."""
    L, P, D = pool.layer_num, pool.page_size, pool.kv_cache_dim
    if flat.numel() != L * P * D or flat.dtype != pool.dtype:
        raise L3Error(f"a flat page must hold {L * P * D} {pool.dtype} values, got "
                      f"{flat.numel()} {flat.dtype}")
    if pool.layout == "page_first":
        return flat.view(P, L, D).permute(1, 0, 2)
    return flat.view(L, P, D)


class HiCacheL3Storage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over hicache's L3 page store (LMDB or Redis)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        self.where = extra.get("store")
        if self.where is None:
            raise L3Error("the hicache storage backend needs 'store' in the extra config: an "
                          "LMDB directory, a Redis URL or a list of Redis Cluster node URLs")
        if not storage_config.is_mla_model:
            raise L3Error("the hicache storage backend serves MLA models (rank-replicated KV); "
                          "this model's KV is split by TP heads")
        require_client(self.where)
        self.trust = trust_of(extra)  # the fleet secret: checked here, used at registration
        self.config = storage_config
        self.capacity_bytes = extra.get("capacity_bytes")
        self.timeout_s = extra.get("timeout_s")
        override = extra.get("weights_signature")
        if not (override or storage_config.model_name):
            raise L3Error("SGLang gave no model name; pass weights_signature in the extra config")
        self.weights = weights_fields(storage_config.model_name or "", override)
        self.writer = bool(storage_config.is_storage_writer)  # SGLang's rule for its backups
        self.rank = storage_config.dcp_rank
        args = _server_args()
        # what changes the bytes besides the weights: extra config, else SGLang's server args
        self.quantization = extra.get("quantization", getattr(args, "quantization", None))
        self.kv_cache_dtype = extra.get("kv_cache_dtype", getattr(args, "kv_cache_dtype", None))
        self.revision = extra.get("revision", getattr(args, "revision", None))
        self.health = Health()
        self._io = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                    "backup_bandwidth": []}
        self._io_lock = threading.Lock()
        self.namespace: Namespace | None = None
        self.store: L3Store | None = None
        self.mem_pool_host = None

    # ---- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        pool = mem_pool_host
        if not isinstance(pool, MLATokenToKVPoolHost) or pool.kv_buffer is None:
            raise L3Error("the hicache storage backend needs a materialized MLA host pool, got "
                          f"{type(pool).__name__}")
        if pool.layout not in LAYOUTS:
            raise L3Error(f"host layout {pool.layout!r} is not supported; use one of {LAYOUTS}")
        cfg = self.config
        if (pool.dcp_size, pool.dcp_rank) != (cfg.dcp_size, cfg.dcp_rank):
            raise L3Error(f"host pool DCP {pool.dcp_rank}/{pool.dcp_size} differs from the "
                          f"storage config's {cfg.dcp_rank}/{cfg.dcp_size}")
        fields = {
            "engine": "sglang", **self.weights,  # by content for a local checkpoint
            "pp": cfg.pp_size, "pp_rank": cfg.pp_rank, "layers": [pool.start_layer,
                                                                  pool.end_layer],
            "cp": cfg.attn_cp_size, "cp_rank": cfg.attn_cp_rank,
            "format": getattr(pool, "storage_format_tag", None),
            "quantization": self.quantization, "revision": self.revision,
            # "auto" stores the pool dtype (in the namespace); fp8 variants may share a uint8 pool
            "kv_dtype": (None if self.kv_cache_dtype in (None, "auto")
                         else kv_dtype_name(self.kv_cache_dtype)),
        }
        ns = Namespace(model=signature(fields), num_layers=pool.layer_num,
                       kv_dim=pool.kv_cache_dim, dtype=pool.dtype, page_size=pool.page_size,
                       dcp_size=cfg.dcp_size)
        if self.store is not None:
            self.store.close()
        self.store = open_store(self.where, ns, self.rank, writer=True,
                                capacity_bytes=self.capacity_bytes, timeout_s=self.timeout_s,
                                trust=self.trust)
        self.namespace = ns
        self.mem_pool_host = pool
        self.logical_page_size = pool.page_size * pool.dcp_size

    def _keys(self, keys: List[str]) -> list[bytes]:
        if self.store is None:
            raise L3Error("register_mem_pool_host was not called")
        return store_keys(keys, self.namespace, self.rank)

    def _starts(self, keys: List[str], host_indices: torch.Tensor) -> list[int]:
        need = len(keys) * self.logical_page_size
        if host_indices.numel() < need:
            raise L3Error(f"{len(keys)} pages need {need} host indices, got "
                          f"{host_indices.numel()}")
        return host_indices[:need:self.logical_page_size].tolist()

    def _put(self, keys: List[str], shards: list[torch.Tensor]) -> list[bool]:
        """Any rank may write (MLA replicas hold the same bytes; a key already stored is not
        rewritten). SGLang itself backs up only from its writers."""
        t0 = time.perf_counter()
        stored = list(self.store.put(self._keys(keys), shards).stored)
        self._io_sample("backup", len(keys), time.perf_counter() - t0)
        return stored

    def _get(self, keys: List[str], out) -> list[bool]:
        t0 = time.perf_counter()
        got = get_each(self.store, self._keys(keys), out)
        self._io_sample("prefetch", len(keys), time.perf_counter() - t0)
        self.health.outcome(hits=sum(got), misses=len(got) - sum(got))
        return got

    def _io_sample(self, kind: str, pages: int, seconds: float) -> None:
        if not pages:
            return
        gb = pages * self.store.page_bytes / 1e9
        with self._io_lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(gb / seconds if seconds > 0 else 0.0)

    # ---- zero-copy interface (extra config "interface_v1": 1) ---------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        skeys = self._keys(keys)
        return self.store.exists_prefix(skeys) if skeys else 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        starts = self._starts(keys, host_indices)
        pool = self.mem_pool_host
        return self._get(keys, lambda i: page_view(pool, starts[i]))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        starts = self._starts(keys, host_indices)
        return self._put(keys, [page_view(self.mem_pool_host, s) for s in starts])

    # ---- generic interface (flat pages in the pool's order) -----------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> List[torch.Tensor | None]:
        pool = self.mem_pool_host
        outs = [t if t is not None else pool.get_dummy_flat_data_page()
                for t in (target_locations or [None] * len(keys))]
        views = [flat_view(pool, t) for t in outs]
        got = self._get(keys, lambda i: views[i])
        return [outs[i] if got[i] else None for i in range(len(keys))]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise L3Error(f"batch_set got {len(keys)} keys but "
                          f"{None if values is None else len(values)} values")
        return all(self._put(keys, [flat_view(self.mem_pool_host, v) for v in values]))

    def clear(self) -> None:
        """Delete every page of this backend's namespace and rank from the store (other models,
        layouts and ranks sharing the store are untouched)."""
        if self.store is None:
            raise L3Error("register_mem_pool_host was not called")
        from ..l3 import registry
        registry.purge(self.where, self.namespace, rank=self.rank)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch / backup), with hicache's
        L3 health since the last call in ``.hicache`` (a :class:`HealthDelta`), also counted in
        the ``hicache_l3_*`` series of SGLang's Prometheus endpoint (docs/integrations.md)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics
        m = StorageMetrics()
        with self._io_lock:
            for k, v in self._io.items():
                getattr(m, k).extend(v)
                v.clear()
        d = self.health.take([self.store] if self.store is not None else [])
        m.hicache = d
        _prometheus(d, self.config)
        return m

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _server_args() -> Any:
    """SGLang's server args of this process, or None (a backend built outside a server)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()
    except Exception:
        return None


_PROM: dict[str, Any] = {}
_PROM_LOCK = threading.Lock()


def _prometheus(d, cfg) -> None:
    """Count a health delta in the process's prometheus_client registry (SGLang serves it, in
    multiprocess mode, on its /metrics endpoint)."""
    from prometheus_client import Counter
    with _PROM_LOCK:
        if not _PROM:
            lab = ["model_name", "tp_rank", "dcp_rank"]
            _PROM.update(
                hits=Counter("hicache_l3_hits", "Pages hicache's L3 served to SGLang.", lab),
                misses=Counter("hicache_l3_misses", "Pages SGLang asked hicache's L3 for and "
                               "did not get.", lab),
                errors=Counter("hicache_l3_errors", "hicache L3 failures by reason ("
                               + ", ".join(REASONS) + ").", lab + ["reason"]),
                read_bytes=Counter("hicache_l3_read_bytes", "Bytes read from hicache's L3.",
                                   lab),
                write_bytes=Counter("hicache_l3_write_bytes", "Bytes written to hicache's L3.",
                                    lab),
                read_s=Counter("hicache_l3_read_seconds", "Seconds inside hicache L3 reads.",
                               lab),
                write_s=Counter("hicache_l3_write_seconds", "Seconds inside hicache L3 "
                                "writes.", lab))
    v = [str(cfg.model_name), str(cfg.tp_rank), str(cfg.dcp_rank)]
    for name, x in (("hits", d.hits), ("misses", d.misses), ("read_bytes", d.bytes_read),
                    ("write_bytes", d.bytes_written), ("read_s", d.read_s),
                    ("write_s", d.write_s)):
        if x:
            _PROM[name].labels(*v).inc(x)
    for reason, n in d.errors.items():
        _PROM["errors"].labels(*v, reason).inc(n)
