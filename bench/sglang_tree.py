"""SGLang's compiled tree core on the controller bench's traces (run by ``bench/controller.py``).

    <engines python> bench/sglang_tree.py   (then one JSON case per stdin line)

Runs in the environment that has SGLang installed (``.venv-engines``, ``make test-engines``),
with this repository on PYTHONPATH for the traces. Each case replays one trace through SGLang's
``UnifiedRadixCache`` on its Rust TreeCore (the backend SGLang selects by default; a prebuilt
extension shipped in the wheel, nothing to compile), set up as its scheduler does: the paged
token-to-KV allocator (frees staged, sorted when an allocation runs short) over a one-layer,
one-head KV pool on CPU, pages of ``page`` tokens, one torch thread. The loop is the bench's:
match + lock + allocate (evicting unlocked leaves when short) + insert (the tree frees duplicate slots)
+ unlock, ``inflight`` requests admitted before the oldest finishes. It prints ``ready`` once
SGLang is imported, then answers each stdin line, a case ``{"workload", "scale", "seed",
"page", "l1_pages", "inflight", "reps"}``, with one JSON line: hit tokens and microseconds per
request (process CPU time, best of reps), so the bench can interleave it with its own replays.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import sys
import time
from array import array
from collections import deque

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests", "engines"))
import engine_helpers  # noqa: E402,F401  (the engine tests' torchvision import placeholder)


def _build(page: int, l1_pages: int, max_len: int, tree: str = "rust"):
    """SGLang's cache over a real allocator and a one-layer, one-head KV pool on CPU, as its
    scheduler assembles them: ``tree`` "rust", its ``UnifiedRadixCache`` on the default (Rust)
    TreeCore; "python", its pure-Python ``RadixCache``."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page))
    size = l1_pages * page
    req_pool = ReqToTokenPool(size=4, max_context_len=max_len + page, device="cpu",
                              enable_memory_saver=False)
    kv = MHATokenToKVPool(size=size, page_size=page, dtype=torch.float16, head_num=1,
                          head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=size, page_size=page, dtype=torch.float16,
                                            device="cpu", kvcache=kv, need_sort=True)
    params = CacheInitParams(req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                             page_size=page, disable=False, eviction_policy="lru",
                             tree_components=(ComponentType.FULL,))
    if tree == "python":
        from sglang.srt.mem_cache.radix_cache import RadixCache
        return RadixCache(params), allocator
    return UnifiedRadixCache(params=params), allocator


@functools.lru_cache(maxsize=4)
def _requests(workload: str, scale: float, seed: int, trace: tuple = ()) -> list:
    """The bench's requests: a seeded workload, or (``trace``: path, format, block tokens,
    requests) a production trace, made as ``bench/controller.py`` makes them."""
    if trace:
        from hicache.workloads.traces import as_requests, load
        path, fmt, block, n = trace
        return as_requests(load(path, fmt, block, max_requests=n), None)
    from hicache.workloads import agentic_trace, chat_trace
    return (chat_trace if workload == "chat" else agentic_trace)(seed, scale)


def _trace(case: dict) -> tuple:
    return ((case["trace"], case["trace_format"], case["block_tokens"], case["trace_requests"])
            if "trace" in case else ())


@functools.lru_cache(maxsize=4)
def _keys(workload: str, scale: float, seed: int, page: int, trace: tuple = ()) -> list:
    """The trace's prompts, whole pages, as ``array('q')`` (SGLang's key type)."""
    reqs = _requests(workload, scale, seed, trace)
    return [array("q", r.tokens[:len(r.tokens) // page * page].tolist()) for r in reqs]


def _python_tree_ops(cache, allocator):
    """lock, unlock, the locked path's slots and insert for the Python ``RadixCache``, as its
    scheduler does them (insert returns the prefix already cached: those slots are freed)."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    def path(node):
        parts = []
        while node is not cache.root_node:
            parts.append(node.value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)

    def insert(key, value, cached):
        done = cache.insert(InsertParams(key=RadixKey(key), value=value)).prefix_len
        if done > cached:
            allocator.free(value[cached:done])

    def lock(node):
        cache.inc_lock_ref(node)
        return node

    return lock, cache.dec_lock_ref, path, insert


def _rust_tree_ops(cache):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    def insert(key, value, cached):  # the tree frees slots duplicating what others inserted
        cache.insert(InsertParams(key=RadixKey(key), value=value, prev_prefix_len=cached))

    return cache.lock, cache.unlock, cache.path_device_indices, insert


def _replay_sglang(keys: list, page: int, l1_pages: int, inflight: int,
                   tree: str = "rust") -> tuple:
    """One replay through SGLang's cache; (hit tokens, process seconds, tree core backend)."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator = _build(page, l1_pages, max(len(k) for k in keys), tree)
    lock_of, unlock, path_slots, insert = (_python_tree_ops(cache, allocator) if tree == "python"
                                           else _rust_tree_ops(cache))
    q: deque = deque()

    def finish(item):
        key, lock, value, cached = item
        if value is not None:
            insert(key, value, cached)
        unlock(lock)

    hits = 0
    t0 = time.process_time()
    for key in keys:
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))
        lock = lock_of(m.last_device_node)
        cached = m.device_prefix_len
        hits += cached
        need = len(key) - cached
        new = allocator.alloc(need) if need else None
        if need and new is None:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
            new = allocator.alloc(need)
        value = None
        if new is not None or not need:  # the prefix's slots, read off the locked path
            have = path_slots(m.last_device_node)[:cached]
            value = torch.cat([have, new]) if need else have
        q.append((key, lock, value, cached))
        if len(q) >= inflight:
            finish(q.popleft())
    while q:
        finish(q.popleft())
    return hits, time.process_time() - t0, getattr(cache, "_tree_core_backend", "python")


@functools.lru_cache(maxsize=4)
def _arrays(workload: str, scale: float, seed: int, trace: tuple = ()) -> list:
    """The trace's prompts as int32 arrays (ours' form, as ``bench/controller.py`` makes it)."""
    import numpy as np
    return [r.tokens.astype(np.int32) for r in _requests(workload, scale, seed, trace)]


def replay(case: dict) -> dict:
    """SGLang's replay, best of ``reps``; with ``"ours": true`` each rep first replays ours
    (``bench/controller.py``'s L1 loop) in this same process, so the two are timed under the
    same process state (allocator, caches), interleaved."""
    page, inflight, l1_pages = case["page"], case["inflight"], case["l1_pages"]
    keys = _keys(case["workload"], case["scale"], case["seed"], page, _trace(case))
    best = ours_best = None
    hits = ours_hits = 0
    for _ in range(case["reps"]):
        if case.get("ours"):
            import controller as bench_controller  # bench/controller.py (this folder)
            got, dt = bench_controller.replay_controller(
                _arrays(case["workload"], case["scale"], case["seed"], _trace(case)), page,
                l1_pages, 0,
                inflight)
            ours_hits = got["l1"] + got["l2"]
            ours_best = dt if ours_best is None else min(ours_best, dt)
        hits, dt, backend = _replay_sglang(keys, page, l1_pages, inflight,
                                           case.get("tree", "rust"))
        gc.collect()  # its tree freed before the next replay, as ours is (replay_controller)
        best = dt if best is None else min(best, dt)
    out = {**case, "hit_tokens": hits, "us_per_request": 1e6 * best / len(keys),
           "backend": backend}
    if ours_best is not None:
        out.update(ours_hit_tokens=ours_hits, ours_us_per_request=1e6 * ours_best / len(keys))
    return out


def main() -> int:
    """One case per stdin line, one result per stdout line; ``ready`` once SGLang is imported."""
    import torch
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend for the cores
    logging.disable(logging.WARNING)
    _build(16, 16, 64)  # imports and first-use work, before anything is timed
    gc.collect()
    gc.freeze()  # as the bench does for ours: start-up objects stay out of full collections
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(replay(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
