"""Controller benchmark: hit tokens and microseconds per request against reference trees.

    python bench/controller.py [--json] [--quick] [--seed N] [--inflight K] [--sglang PYTHON]
                               [--workloads chat agentic] [--pages 16 64] [--capacities ...]

Replays the seeded ``chat`` and ``agentic`` traces through ``CacheController`` (one widened page
= ``--page`` tokens, page sizes 16 and 64) with ``--inflight`` requests admitted before the
oldest finishes, under three capacities: ``ample`` (everything fits in L1), ``budget`` (L1 holds
``--budget`` of the trace's unique pages, no L2) and ``budget+l2`` (the same L1 plus an L2 four
times its size). References run on the same trace in the same process, each given the same
capacities, page ids from the same PageAllocator and LRU eviction of unlocked leaves:

- ``x token``: a pure-Python compressed radix tree whose key match walks one token at a time
  (L1 only, in every row);
- ``x page``: a page-keyed radix tree of the kind the major serving engines write in Python
  (children keyed by the page's token tuple, whole-page list compares, every eviction collects
  and heapifies its candidates); in the budget+l2 rows the same tree with the host tier ours runs
  (write-through backups, demotion of evicted nodes that have a host copy, load-back of a host
  hit), so every row compares the same work;
- ``x sglang``: SGLang's ``UnifiedRadixCache`` on its compiled (Rust) tree core, replayed by
  ``bench/sglang_tree.py`` in the environment that has SGLang (``--sglang``, the
  HICACHE_ENGINES_PYTHON variable or ``.venv-engines``; ample and budget rows). Its ratio is
  against ours replayed in SGLang's process, rep by rep before SGLang's (the same process state
  for both: two processes on a shared VM were seen to run 1.5x apart for minutes);
- ``x sg py``: SGLang's pure-Python ``RadixCache`` (its ``radix_cache.py``), the same way
  (lock/unlock by ``inc_lock_ref``/``dec_lock_ref``, duplicate slots freed after insert as its
  scheduler frees them);

Per request all do match + lock + allocate (evicting) + insert (freeing duplicate pages) +
unlock; ours also runs the per-step agreement. Each gets the prompt in its own form, made before
timing: ours int32 arrays (what ``HiCache`` hands it), the Python references lists, SGLang
``array('q')``. Hit tokens must be identical to every like-for-like reference (``same``). Times
are CPU time of the process (time.process_time, robust on a shared, busy machine), best of
--reps; a ratio is reference us/request over ours. Objects alive at start-up are frozen out of
the cyclic GC first (``gc.freeze()``) so a full collection does not land in one replay and decide
its time.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import subprocess
import tempfile
import sys
import time
from collections import deque

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache.controller import CacheController, StepAgreement
from hicache.errors import DeviceFullError
from hicache.pages import PageAllocator  # noqa: E402
from hicache.workloads import agentic_trace, chat_trace, trace_summary  # noqa: E402


# ---- the reference: a per-token radix tree, as pure-Python serving engines write it -------
class _RefNode:
    __slots__ = ("children", "key", "value", "parent", "lock_ref", "last_access", "host")

    def __init__(self, key, value, parent):
        self.children = {}
        self.key = key        # token ids (a list)
        self.value = value    # page ids, one per page of key (None: evicted to the host tier)
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.host = None      # host page ids (the host-tier reference only)


class RefRadixCache:
    """Compressed radix tree over token lists; children keyed by their first page (a tuple), the
    key match compares one token at a time.
    Page ids come from the same PageAllocator as ours; LRU leaf eviction frees them."""

    def __init__(self, page_size: int, num_pages: int):
        self.page = page_size
        self.alloc = PageAllocator(num_pages)
        self.root = _RefNode([], [], None)
        self.root.lock_ref = 1
        self.clock = 0

    @staticmethod
    def _key_match(key, tokens, start):
        i, n = 0, min(len(key), len(tokens) - start)
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return i

    def _split(self, child, i):
        k = i // self.page
        top = _RefNode(child.key[:i], child.value[:k], child.parent)
        top.lock_ref, top.last_access = child.lock_ref, child.last_access
        top.children[tuple(child.key[i:i + self.page])] = child
        child.parent.children[tuple(child.key[:self.page])] = top
        child.key, child.value = child.key[i:], child.value[k:]
        child.parent = top
        return top

    def _walk_path(self, tokens):
        """Nodes covering the longest cached whole-page prefix, split to fit."""
        p = self.page
        node, pos, path = self.root, 0, []
        end = len(tokens) // p * p  # children are keyed by whole pages
        while pos < end:
            child = node.children.get(tuple(tokens[pos:pos + p]))
            if child is None:
                break
            i = self._key_match(child.key, tokens, pos) // p * p
            if i < len(child.key):
                child = self._split(child, i)
            child.last_access = self.clock
            path.append(child)
            node, pos = child, pos + i
            if i < len(child.key):
                break
        return path

    def _walk(self, tokens):
        path = self._walk_path(tokens)
        pages = [x for n in path for x in n.value]
        return (path[-1] if path else self.root), len(pages) * self.page, pages

    def match(self, tokens):
        self.clock += 1
        node, pos, pages = self._walk(tokens)
        return pos, node, pages

    def lock(self, node, d):
        while node is not None and node is not self.root:
            node.lock_ref += d
            node = node.parent

    def alloc_pages(self, n):
        if self.alloc.num_free < n:
            self.evict(n - self.alloc.num_free)
        if self.alloc.num_free < n:
            return None
        return self.alloc.alloc(n)

    def insert(self, tokens, pages):
        self.clock += 1
        tokens = tokens[:len(tokens) // self.page * self.page]
        node, pos, have = self._walk(tokens)
        k = pos // self.page
        dup = [p for p, q in zip(pages[:k], have) if p != q]
        if dup:
            self.alloc.free(dup)
        if pos < len(tokens):
            new = _RefNode(tokens[pos:], pages[k:], node)
            new.last_access = self.clock
            node.children[tuple(tokens[pos:pos + self.page])] = new

    def evict(self, n_pages):
        self._evict_lru([n for n in self._nodes() if not n.children], n_pages,
                        self._release_leaf)

    def _release_leaf(self, n):
        parent = n.parent
        del parent.children[tuple(n.key[:self.page])]
        self.alloc.free(n.value)
        more = parent is not self.root and not parent.children and not parent.lock_ref
        return len(n.value), parent if more else None

    def _nodes(self):
        stack, out = list(self.root.children.values()), []
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _evict_lru(self, nodes, n_pages, release):
        """Release unlocked ``nodes``, least recently used first, until ``n_pages`` are freed;
        ``release(n)`` returns (pages freed, a node that became a candidate or None). Every
        eviction collects its candidates and heapifies them, as the engines' Python trees do."""
        heap = [(n.last_access, id(n), n) for n in nodes]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_pages:
            _, _, n = heapq.heappop(heap)
            if n.lock_ref > 0:
                continue
            k, more = release(n)
            freed += k
            if more is not None:
                heapq.heappush(heap, (more.last_access, id(more), more))


# ---- the stronger reference: a page-keyed radix tree, as the major engines' Python trees -----
class PageRadixCache(RefRadixCache):
    """The same tree, but the key match compares whole pages (list slices, one C compare per
    page), with LRU eviction of unlocked leaves (every eviction collects the leaves and heapifies
    them): the structure of the paged Python radix caches of the major serving engines."""

    def _key_match(self, key, tokens, start):
        p, i = self.page, 0
        n = min(len(key), len(tokens) - start) // p * p
        while i < n and key[i:i + p] == tokens[start + i:start + i + p]:
            i += p
        return i


# ---- the same work as budget+l2: a page-keyed tree with a host tier (write-through) ----------
class PageHostRadixCache(PageRadixCache):
    """The page-keyed tree plus the host tier our budget+l2 rows run, the way the engines'
    hierarchical Python trees do it: every inserted node is backed up to host pages at once
    (write-through; host pages from their own PageAllocator, evicting unlocked host copies,
    least recently used first, when full), a device eviction demotes a node that has a host copy
    (its device pages are freed, the node stays) and drops one that has none, and a match
    returns the device prefix, then the host-only prefix, which is loaded back into new device
    pages when L1 has room. Every eviction collects its candidates and heapifies them."""

    def __init__(self, page_size: int, num_pages: int, host_pages: int):
        super().__init__(page_size, num_pages)
        self.halloc = PageAllocator(host_pages)

    def _split(self, child, i):
        k, v = i // self.page, child.value
        top = _RefNode(child.key[:i], None if v is None else v[:k], child.parent)
        top.lock_ref, top.last_access = child.lock_ref, child.last_access
        top.children[tuple(child.key[i:i + self.page])] = child
        child.parent.children[tuple(child.key[:self.page])] = top
        child.key = child.key[i:]
        if v is not None:
            child.value = v[k:]
        if child.host is not None:
            top.host, child.host = child.host[:k], child.host[k:]
        child.parent = top
        return top

    def match_tiers(self, tokens):
        """(device nodes, host-only nodes) of the longest prefix."""
        self.clock += 1
        dev, hst = [], []
        for n in self._walk_path(tokens):
            if n.value is not None and not hst:
                dev.append(n)
            elif n.value is None and n.host is not None:
                hst.append(n)
            else:
                break
        return dev, hst

    def load_back(self, nodes) -> bool:
        need = sum(len(n.host) for n in nodes)
        pages = self.alloc_pages(need)
        if pages is None:
            return False
        i = 0
        for n in nodes:
            n.value, i = pages[i:i + len(n.host)], i + len(n.host)
        return True

    def insert(self, tokens, pages):
        self.clock += 1
        p = self.page
        tokens = tokens[:len(tokens) // p * p]
        path = self._walk_path(tokens)
        i, dup = 0, []
        for n in path:
            k = len(n.key) // p
            mine = pages[i:i + k]
            if n.value is None:  # host-only: recomputed by the caller, takes these pages
                n.value = mine
            else:
                dup += [a for a, b in zip(mine, n.value) if a != b]
            i += k
        if dup:
            self.alloc.free(dup)
        parent = path[-1] if path else self.root
        pos = i * p
        if pos < len(tokens):
            new = _RefNode(tokens[pos:], pages[i:], parent)
            new.last_access = self.clock
            parent.children[tuple(tokens[pos:pos + p])] = new
            path.append(new)
        for n in path:  # write-through
            if n.host is None:
                n.host = self.alloc_host(len(n.value))

    def alloc_host(self, n):
        if n > self.halloc.num_pages:
            return None
        if self.halloc.num_free < n:
            self.evict_host(n - self.halloc.num_free)
        if self.halloc.num_free < n:
            return None
        return self.halloc.alloc(n)

    def _device_leaf(self, n):
        return n.value is not None and not any(c.value is not None for c in n.children.values())

    def evict(self, n_pages):
        self._evict_lru([n for n in self._nodes() if self._device_leaf(n)], n_pages,
                        self._release_device)

    def _release_device(self, n):
        k = len(n.value)
        self.alloc.free(n.value)
        n.value = None
        parent = n.parent
        if n.host is None:  # no host copy: the node and its host-only subtree go
            del parent.children[tuple(n.key[:self.page])]
            stack = [n]
            while stack:
                x = stack.pop()
                if x.host is not None:
                    self.halloc.free(x.host)
                stack.extend(x.children.values())
        return k, parent if parent is not self.root and self._device_leaf(parent) else None

    def evict_host(self, n_pages):
        self._evict_lru([n for n in self._nodes()
                         if n.host is not None and (n.value is not None or not n.children)],
                        n_pages, self._release_host)

    def _release_host(self, n):
        k = len(n.host)
        self.halloc.free(n.host)
        n.host = None
        parent = n.parent
        if n.value is not None:
            return k, None
        del parent.children[tuple(n.key[:self.page])]  # a host-only leaf: gone
        if (parent is not self.root and parent.host is not None and parent.value is None
                and not parent.children):
            return k, parent
        return k, None


# ---- replays ---------------------------------------------------------------------------------
def replay_reference(reqs, lists, page, num_pages, inflight, cls=None):
    cache = (cls or RefRadixCache)(page, num_pages)
    hits, q = 0, deque()
    t0 = time.process_time()
    for toks in lists:
        matched, node, have = cache.match(toks)
        cache.lock(node, +1)
        new = cache.alloc_pages(len(toks) // page - len(have))
        hits += matched
        q.append((toks, node, None if new is None else have + new))
        if len(q) >= inflight:
            _ref_finish(cache, q.popleft())
    while q:
        _ref_finish(cache, q.popleft())
    return hits, time.process_time() - t0


def _ref_finish(cache, item):
    toks, node, pages = item
    if pages is not None:
        cache.insert(toks, pages)
    cache.lock(node, -1)


def replay_host_reference(reqs, lists, page, num_pages, host_pages, inflight):
    cache = PageHostRadixCache(page, num_pages, host_pages)
    hits, q = 0, deque()
    t0 = time.process_time()
    for toks in lists:
        dev, hst = cache.match_tiers(toks)
        last = (hst or dev or [cache.root])[-1]
        cache.lock(last, +1)
        have = [x for n in dev for x in n.value]
        hits += len(have) * page
        if hst and cache.load_back(hst):
            loaded = [x for n in hst for x in n.value]
            hits += len(loaded) * page
            have += loaded
        new = cache.alloc_pages(len(toks) // page - len(have))
        q.append((toks, last, None if new is None else have + new))
        if len(q) >= inflight:
            _ref_finish(cache, q.popleft())
    while q:
        _ref_finish(cache, q.popleft())
    return hits, time.process_time() - t0


def replay_controller(arrays, page, device_pages, host_pages, inflight, write="write_through"):
    """Our replay; ``arrays``: the prompts as int32 arrays (what ``HiCache`` hands the
    controller, as the references get Python lists: each its own form, made before timing)."""
    ctrl = CacheController(page, device_pages, host_pages, write=write, eviction="lru")
    agree = StepAgreement(local=True)
    l1 = l2 = 0
    q = deque()
    t0 = time.process_time()
    for toks in arrays:
        m = ctrl.match(toks, lock=True)  # and its lock (m.lock), as lock(m) after would
        h = m.lock
        ld = ctrl.load_back(m)
        have = m.device_len // page + (len(ld.device_pages) if ld else 0)
        try:
            new = ctrl.alloc_device(len(toks) // page - have, as_array=True)
            pages = (np.concatenate((m.device_pages, np.array(ld.device_pages, np.int64), new))
                     if ld else np.concatenate((m.device_pages, new)))
        except DeviceFullError:
            pages = None
        l1 += m.device_len
        l2 += m.host_len if ld else 0
        q.append((toks, h, pages))
        if len(q) >= inflight:
            _finish(ctrl, agree, q.popleft())
    while q:
        _finish(ctrl, agree, q.popleft())
    dt = time.process_time() - t0
    ctrl.check()
    del ctrl  # its tree freed now (no cycle), and its memory reused by the next replay:
    gc.collect()  # every replay starts so, ours and the references' (cycles freed here)
    return {"l1": l1, "l2": l2}, dt


def _finish(ctrl, agree, item):
    toks, h, pages = item
    if pages is not None:
        ctrl.insert(toks, pages, after=h)  # walks on from its locked prefix, releases it
    else:
        ctrl.unlock(h)
    ctrl.take_ops()  # a transfer engine would run these; here they finish at once
    ctrl.agree(agree, ctrl.inflight_ops())


def engines_python(arg: str | None) -> str | None:
    """The Python of the environment with SGLang (``--sglang``, else HICACHE_ENGINES_PYTHON,
    else ``.venv-engines`` of this repository), or None."""
    if arg == "off":
        return None
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    path = arg or os.environ.get("HICACHE_ENGINES_PYTHON") or os.path.join(
        root, ".venv-engines", "bin", "python")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


class SGLangReplayer:
    """``bench/sglang_tree.py`` running under ``python``, one case at a time (so its replays
    interleave with ours and the references' under the same machine load)."""

    def __init__(self, python: str) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.path.join(here, ".."))
        # its warnings go to a file: a pipe nobody reads would fill and stall both processes
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([python, os.path.join(here, "sglang_tree.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, env=env)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        line = self.proc.stdout.readline()
        if not line or (what == "ready" and line.strip() != "ready"):
            self._err.seek(0)
            err = self._err.read() if self.proc.poll() is not None else ""
            raise RuntimeError(f"bench/sglang_tree.py: no {what} ({line.strip()!r}; "
                               f"{err.strip()[-600:]})")
        return line

    def replay(self, case: dict) -> dict:
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("result"))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def unique_pages(reqs, page) -> int:
    seen = set()
    for r in reqs:
        t = r.tokens[:len(r.tokens) // page * page].astype(np.int64)
        h = 0
        for k in range(len(t) // page):
            h = hash((h, t[k * page:(k + 1) * page].tobytes()))
            seen.add(h)
    return len(seen)


def production_trace(args) -> list:
    """``--trace``: a production trace's prompts (Mooncake / Bailian hash ids, blocks of
    ``--block-tokens``) as the bench's requests."""
    from hicache.workloads.traces import as_requests, load
    return as_requests(load(args.trace, args.trace_format, args.block_tokens,
                            max_requests=args.trace_requests), None)


def trace_case(args, workload: str) -> dict:
    """What bench/sglang_tree.py needs to load the same production trace."""
    if workload != "trace":
        return {}
    return {"trace": os.path.abspath(args.trace), "trace_format": args.trace_format,
            "block_tokens": args.block_tokens, "trace_requests": args.trace_requests}


def sglang_columns(r: dict, sg: list, total: int) -> None:
    """Row ``r``'s SGLang columns from its replays ``sg`` (Rust tree core and Python
    ``RadixCache``), each against ours replayed in SGLang's process, interleaved with it: the
    same process state for both (two processes on a shared VM can differ by 1.5x for a while)."""
    rust = [x for x in sg if x.get("tree", "rust") == "rust"]
    py = [x for x in sg if x.get("tree") == "python"]
    r["sglang_hit_tokens"] = rust[0]["hit_tokens"]
    r["sglang_us_per_request"] = min(x["us_per_request"] for x in rust)
    r["ours_in_sglang_process_us"] = min(x["ours_us_per_request"] for x in sg)
    r["sglang_speedup"] = r["sglang_us_per_request"] / r["ours_in_sglang_process_us"]
    if py:
        r["sglang_python_hit_tokens"] = py[0]["hit_tokens"]
        r["sglang_python_us_per_request"] = min(x["us_per_request"] for x in py)
        r["sglang_python_speedup"] = (r["sglang_python_us_per_request"]
                                      / r["ours_in_sglang_process_us"])
    r["identical_hits"] = r["identical_hits"] and all(
        x["hit_tokens"] == total and x["ours_hit_tokens"] == total for x in sg)


def run(args) -> dict:
    every = {"chat": 0.1 if args.quick else 1.0, "agentic": 0.03 if args.quick else 0.3,
             "trace": 1.0}
    rows = []
    scales = {w: every[w] for w in args.workloads}
    cases = [(w, p, cap) for w in args.workloads
             for p in ([args.block_tokens] if w == "trace" else args.pages)
             for cap in args.capacities]
    traces = {w: production_trace(args) if w == "trace" else
              (chat_trace if w == "chat" else agentic_trace)(args.seed, scales[w])
              for w in scales}
    in_process = args.refs == "all"  # the Python references (their lists: ~8x the arrays)
    lists = {w: [r.tokens.tolist() for r in traces[w]] if in_process else [] for w in traces}
    arrays = {w: [r.tokens.astype(np.int32) for r in traces[w]] for w in traces}
    # what exists now (imports, traces) lives for the whole run: keep it out of the cyclic GC's
    # full collections, as serving engines do after start-up, so a full collection landing in
    # one replay does not decide its time (the same for ours and both references)
    sglang, why = None, ""
    python = engines_python(args.sglang) if not args.quick or args.sglang else None
    if python is None:
        why = "no SGLang environment (.venv-engines, --sglang PATH)"
    else:
        try:
            sglang = SGLangReplayer(python)
        except (OSError, RuntimeError) as e:
            why = str(e)
    if sglang is None and not in_process:
        print(f"controller bench: --refs sglang, but SGLang cannot run: {why}", file=sys.stderr)
        raise SystemExit(2)
    gc.collect()
    gc.freeze()
    try:
        for w, page, cap in tqdm(cases, desc="controller bench", disable=args.json):
            reqs = traces[w]
            uniq = unique_pages(reqs, page)
            if cap == "ample":
                dev, host = uniq + args.inflight * 64 + 64, 0
            else:
                dev = max(int(uniq * args.budget), 4 * max(len(r.tokens) for r in reqs) // page)
                host = 4 * dev if cap == "budget+l2" else 0
            ours_t, ref_t, page_t, sg = [], [], [], []
            for _ in range(args.reps):
                if sglang is not None and not host:  # its tree cores, L1 only
                    for tree in ("rust", "python"):
                        sg.append(sglang.replay({"workload": w, "scale": scales[w],
                                                 "seed": args.seed, "page": page,
                                                 "l1_pages": dev, "inflight": args.inflight,
                                                 "reps": 1, "ours": True, "tree": tree,
                                                 **trace_case(args, w)}))
                if in_process:
                    ref_hits, dt = replay_reference(reqs, lists[w], page, dev, args.inflight)
                    ref_t.append(dt)
                    page_hits, dt = (  # with a host tier: the same work as ours
                        replay_host_reference(reqs, lists[w], page, dev, host, args.inflight)
                        if host else replay_reference(reqs, lists[w], page, dev,
                                                      args.inflight, PageRadixCache))
                    page_t.append(dt)
                    gc.collect()  # (their trees are cycles: freed before ours runs)
                hits, dt = replay_controller(arrays[w], page, dev, host, args.inflight)
                ours_t.append(dt)
            prompt = sum(len(r.tokens) for r in reqs)
            ours_us = 1e6 * min(ours_t) / len(reqs)
            total = hits["l1"] + hits["l2"]
            rows.append({
                "workload": w, "page": page, "capacity": cap, "requests": len(reqs),
                "prompt_tokens": prompt, "l1_pages": dev, "l2_pages": host,
                "hit_tokens": total, "hit_l1": hits["l1"], "hit_l2": hits["l2"],
                "hit_ratio": total / prompt, "us_per_request": ours_us, "identical_hits": True})
            if in_process:
                ref_us = 1e6 * min(ref_t) / len(reqs)
                page_us = 1e6 * min(page_t) / len(reqs)
                rows[-1].update({
                    "ref_hit_tokens": ref_hits, "page_ref_hit_tokens": page_hits,
                    "ref_hit_ratio": ref_hits / prompt, "page_ref_hit_ratio": page_hits / prompt,
                    "ref_us_per_request": ref_us, "page_ref_us_per_request": page_us,
                    "speedup": ref_us / ours_us, "page_speedup": page_us / ours_us,
                    # like for like: both references without L2, the page-keyed one with it
                    "identical_hits": total == page_hits and (bool(host) or total == ref_hits)})
            if sg:
                sglang_columns(rows[-1], sg, total)
    finally:
        if sglang is not None:
            sglang.close()
    return {"bench": "controller", "seed": args.seed, "inflight": args.inflight,
            "sglang": python if sglang is not None else None, "sglang_missing": why,
            "scales": scales, "traces": {w: trace_summary(traces[w]) for w in traces},
            "rows": rows,
            "min_speedup": min((r["speedup"] for r in rows
                                if "speedup" in r and r["capacity"] != "budget+l2"), default=None),
            "min_page_speedup": min((r["page_speedup"] for r in rows if "page_speedup" in r),
                                    default=None),
            "hits_identical": all(r["identical_hits"] for r in rows),
            "ample_hits_identical": all(r["identical_hits"] for r in rows
                                        if r["capacity"] == "ample"),
            "machine": {"python": platform.python_version(), "cpu": platform.processor() or
                        platform.machine(), "cores": os.cpu_count()}}


def _cell(row: dict, key: str, width: int, spec: str = ".1f", unit: str = "") -> str:
    """``row[key]`` formatted to ``width`` then ``unit``, or '-' where that reference did not
    run."""
    return (f"{row[key]:>{width}{spec}}{unit}" if key in row
            else f"{'-':>{width + len(unit)}}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small traces (a few seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inflight", type=int, default=8, help="requests admitted before finishing")
    ap.add_argument("--budget", type=float, default=0.25,
                    help="L1 share of the trace's unique pages in the budget runs")
    ap.add_argument("--reps", type=int, default=2, help="repetitions; the best time counts")
    ap.add_argument("--workloads", nargs="+", choices=("chat", "agentic", "trace"),
                    default=["chat", "agentic"], help="the traces to replay (default: chat "
                    "and agentic; with --trace, the trace)")
    ap.add_argument("--pages", nargs="+", type=int, choices=(16, 64), default=[16, 64],
                    help="widened page sizes in tokens (default: 16 64)")
    ap.add_argument("--capacities", nargs="+", choices=("ample", "budget", "budget+l2"),
                    default=["ample", "budget", "budget+l2"], help="capacities (default: all)")
    ap.add_argument("--sglang", default=None, metavar="PYTHON",
                    help="Python of an environment with SGLang, whose compiled (Rust) tree core "
                         "is replayed as a third reference (default: HICACHE_ENGINES_PYTHON or "
                         ".venv-engines, when present and not --quick; 'off': skip)")
    ap.add_argument("--trace", help="also replay a production trace (JSON lines; its rows "
                    "are workload 'trace', pages of --block-tokens)")
    ap.add_argument("--trace-format", default="mooncake", choices=("mooncake", "bailian"))
    ap.add_argument("--block-tokens", type=int, default=16,
                    help="tokens per hash id of --trace (default 16: the Mooncake trace's "
                         "147M prompt tokens become 4.6M, one page per block)")
    ap.add_argument("--trace-requests", type=int, default=None,
                    help="the first N requests of --trace (default: all)")
    ap.add_argument("--refs", choices=("all", "sglang"), default="all",
                    help="references: all (the in-process Python trees, and SGLang's where "
                         "found) or sglang (SGLang's trees only, L1 rows: what a production "
                         "trace's full scale fits, whose Python token lists do not)")
    args = ap.parse_args(argv)
    if args.refs == "sglang" and ("budget+l2" in args.capacities or args.sglang == "off"):
        ap.error("--refs sglang replays SGLang's L1 trees only: pass --capacities ample "
                 "and/or budget, and no --sglang off")
    if args.trace and args.workloads == ["chat", "agentic"]:
        args.workloads = ["trace"]
    elif "trace" in args.workloads and not args.trace:
        ap.error("--workloads trace needs --trace FILE")
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    hdr = (f"{'workload':8} {'page':>4} {'capacity':9} {'reqs':>5} {'hit':>6} {'l2 part':>7} "
           f"{'tok hit':>7} {'pg hit':>6} {'same':>4} {'us/req':>8} {'token ref':>9} "
           f"{'page ref':>8} {'sglang':>7} {'ours sg':>7} {'x token':>7} {'x page':>6} "
           f"{'x sglang':>8} {'sg py':>7} {'x sg py':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        print(f"{r['workload']:8} {r['page']:>4} {r['capacity']:9} {r['requests']:>5} "
              f"{r['hit_ratio']:>6.1%} {r['hit_l2'] / max(r['prompt_tokens'], 1):>7.1%} "
              f"{_cell(r, 'ref_hit_ratio', 7, '.1%')} {_cell(r, 'page_ref_hit_ratio', 6, '.1%')} "
              f"{'yes' if r['identical_hits'] else 'no':>4} {r['us_per_request']:>8.1f} "
              f"{_cell(r, 'ref_us_per_request', 9)} {_cell(r, 'page_ref_us_per_request', 8)} "
              f"{_cell(r, 'sglang_us_per_request', 7)} "
              f"{_cell(r, 'ours_in_sglang_process_us', 7)} "
              f"{_cell(r, 'speedup', 6, unit='x')} {_cell(r, 'page_speedup', 5, unit='x')} "
              f"{_cell(r, 'sglang_speedup', 7, unit='x')} "
              f"{_cell(r, 'sglang_python_us_per_request', 7)} "
              f"{_cell(r, 'sglang_python_speedup', 6, unit='x')}")
    if res["min_speedup"] is not None:
        print(f"\nmin x page (every row, like for like) {res['min_page_speedup']:.1f}x; min x "
              f"token (ample, budget) {res['min_speedup']:.1f}x; hit tokens identical to the "
              f"like-for-like references on every row: {res['hits_identical']}\n(budget+l2: the "
              f"page-keyed reference runs the same host tier as ours (write-through backups, "
              f"demotion, load-back); the per-token tree stays L1-only there)")
    else:
        print(f"\n--refs sglang: no in-process Python reference ran; hit tokens identical to "
              f"SGLang's on every row: {res['hits_identical']}")
    if res["sglang"]:
        print(f"x sglang: SGLang's UnifiedRadixCache on its Rust tree core ({res['sglang']}), "
              f"L1 rows, against ours in its process ('ours sg'); x sg py: its Python "
              f"RadixCache, the same way; their hit tokens and ours' there are part of 'same'")
    else:
        print(f"x sglang: not run ({res['sglang_missing']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
