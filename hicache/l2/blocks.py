"""CPU block copies: plan and run the copy of page-layer blocks between two flat block arrays.

A block is one page-layer of the pools' ``PageFormat`` (``fmt.block_elems`` elements, ``P`` rows
of ``kv_dim`` for the target KV). ``plan_blocks`` turns block id
lists into a few C-level copy loops, whichever kind needs the fewest calls: ``numpy.take`` into
each contiguous destination run, a numpy scatter from each (strided) source run, or one
``memmove`` per run contiguous on both sides (all release the GIL). Pure numpy: no threads, no
pools (the CPU copy backend, ``hicache/l2/copy_cpu.py``, uses it).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from hicache.errors import TransferError


_memmove = ctypes.memmove

# CPU block copies ------------------------------------------------------------------------------
COPY_KINDS = ("memmove", "take", "scatter")
# Rough cost of one call in microseconds (Python dispatch + setup), used to pick a kind, and a
# per-block surcharge for memmove: one long memmove measured a few % slower than numpy's
# per-block copies of the same bytes on the 2-core CI box (bench/transfer.py).
_CALL_COST = {"memmove": 0.7, "take": 1.5, "scatter": 2.0}
_MEMMOVE_BLOCK_COST = 0.05


@dataclass(frozen=True)
class BlockPlan:
    """How to copy blocks ``src[s[i]] -> dst[d[i]]`` of two flat block arrays.

    kind "memmove": ``ops`` int64 [k, 3] rows (src block, dst block, count), both sides
    contiguous. "take": ``ops`` tuple of (dst start, src ids int64 [n]) filling the contiguous
    destination run [start, start + n). "scatter": ``ops`` tuple of (src start, step, dst ids
    int64 [n]) reading the source run ``start, start + step, ...``.
    """

    kind: str
    ops: object
    num_blocks: int

    @property
    def num_calls(self) -> int:
        return len(self.ops)


def _runs(brk: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """Start and length of each run of a length-``n`` sequence with breaks ``brk`` [n-1]."""
    starts = np.flatnonzero(brk) + 1
    bounds = [0] + starts.tolist() + [n]
    return bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def plan_blocks(s: np.ndarray, d: np.ndarray, src_step: int = 1, kind: str | None = None
                ) -> BlockPlan:
    """Plan the copy of blocks ``s`` [n] -> ``d`` [n] (int64 ids, ``d`` without repeats).

    Picks the kind with the lowest estimated call cost unless ``kind`` forces one. Scatter runs
    follow the source with step 1 or ``src_step`` (a strided source such as one layer of a
    page_first host pool). Already sorted inputs skip the sorts.
    """
    s = np.asarray(s, dtype=np.int64).reshape(-1)
    d = np.asarray(d, dtype=np.int64).reshape(-1)
    n = int(s.size)
    if kind is not None and kind not in COPY_KINDS:
        raise TransferError(f"copy kind must be one of {COPY_KINDS}, got {kind!r}")
    if n == 0:
        return BlockPlan(kind or "memmove", np.zeros((0, 3), dtype=np.int64), 0)
    diff_d = d[1:] - d[:-1]
    if (diff_d > 0).all():  # already in destination order (the common case)
        sd, dd = s, d
    else:
        od = np.argsort(d, kind="stable")
        sd, dd = s[od], d[od]
        diff_d = dd[1:] - dd[:-1]
    diff_sd = sd[1:] - sd[:-1]
    brk_d = diff_d != 1
    if not brk_d.any() and (kind == "take" or kind is None and _CALL_COST["memmove"]
                            + n * _MEMMOVE_BLOCK_COST >= _CALL_COST["take"]):
        # one take fills the whole destination run: nothing is cheaper
        return BlockPlan("take", ((int(dd[0]), sd),), n)
    brk_m = brk_d | (diff_sd != 1)
    if (diff_sd >= 0).all():
        ss, ds, diff_s = sd, dd, diff_sd
    else:
        os_ = np.argsort(s, kind="stable")
        ss, ds = s[os_], d[os_]
        diff_s = ss[1:] - ss[:-1]
    brk_s = diff_s != 1
    n_s = int(np.count_nonzero(brk_s))
    step = 1
    if src_step > 1:
        brk_t = diff_s != src_step
        n_t = int(np.count_nonzero(brk_t))
        if n_t < n_s:
            brk_s, n_s, step = brk_t, n_t, int(src_step)
    cost = {"memmove": (1 + int(np.count_nonzero(brk_m))) * _CALL_COST["memmove"]
            + n * _MEMMOVE_BLOCK_COST,
            "take": (1 + int(np.count_nonzero(brk_d))) * _CALL_COST["take"],
            "scatter": (1 + n_s) * _CALL_COST["scatter"]}
    if kind is None:
        kind = min(COPY_KINDS, key=cost.__getitem__)
    if kind == "memmove":
        starts, lens = _runs(brk_m, n)
        ops = np.stack((sd[starts], dd[starts], np.asarray(lens, dtype=np.int64)), axis=1)
        return BlockPlan(kind, ops, n)
    if kind == "take":
        starts, lens = _runs(brk_d, n)
        return BlockPlan(kind, tuple((int(dd[a]), sd[a:a + m]) for a, m in zip(starts, lens)), n)
    starts, lens = _runs(brk_s, n)
    return BlockPlan(kind, tuple((int(ss[a]), step, ds[a:a + m]) for a, m in zip(starts, lens)),
                     n)


def run_block_plan(plan: BlockPlan, src: np.ndarray, dst: np.ndarray, src_off: int = 0,
                   dst_off: int = 0) -> None:
    """Execute ``plan`` on flat block arrays (1-D, contiguous, same void dtype), block ids
    shifted by ``src_off`` / ``dst_off``. Every call is a C loop that releases the GIL."""
    if plan.kind == "memmove":
        bs = src.dtype.itemsize
        sb = src.ctypes.data + src_off * bs
        db = dst.ctypes.data + dst_off * bs
        mm = _memmove
        for s0, d0, n in plan.ops.tolist():
            mm(db + d0 * bs, sb + s0 * bs, n * bs)
        return
    src = src[src_off:]
    dst = dst[dst_off:]
    if plan.kind == "take":
        take = np.take
        for d0, ids in plan.ops:
            take(src, ids, out=dst[d0:d0 + ids.size], mode="clip")
        return
    for s0, step, ids in plan.ops:
        dst[ids] = src[s0:s0 + step * (ids.size - 1) + 1:step]


def split_block_plan(plan: BlockPlan, parts: int) -> list[BlockPlan]:
    """Cut ``plan`` into at most ``parts`` plans of about equal block counts (same kind)."""
    n = plan.num_blocks
    if parts <= 1 or n < 2:
        return [plan]
    if plan.kind == "memmove":  # (src, dst, count) runs: cut as page runs are
        return [BlockPlan("memmove", np.asarray(p, dtype=np.int64).reshape(-1, 3),
                          sum(c for _, _, c in p)) for p in split_runs(plan.ops.tolist(), parts)]
    target = -(-n // parts)
    out: list[list] = [[]]
    room = target
    take = plan.kind == "take"
    items = [(d0, ids) for d0, ids in plan.ops] if take else list(plan.ops)
    for it in items:
        cnt = it[-1].size
        a = 0
        while a < cnt:
            if room == 0:
                out.append([])
                room = target
            b = min(cnt, a + room)
            if take:
                out[-1].append((it[0] + a, it[1][a:b]))
            else:
                out[-1].append((it[0] + a * it[1], it[1], it[2][a:b]))
            room -= b - a
            a = b
    return [BlockPlan(plan.kind, tuple(ops), sum(o[-1].size for o in ops)) for ops in out]


def split_runs(runs, parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut page runs ``(src page, dst page, pages)`` into at most ``parts`` lists of about equal
    page counts, in order (a run may be cut in two)."""
    total = sum(r[2] for r in runs)
    if parts <= 1 or total < 2:
        return [list(runs)]
    target = -(-total // parts)
    out: list[list[tuple[int, int, int]]] = [[]]
    room = target
    for s0, d0, n in runs:
        a = 0
        while a < n:
            if room == 0:
                out.append([])
                room = target
            b = min(n, a + room)
            out[-1].append((s0 + a, d0 + a, b - a))
            room -= b - a
            a = b
    return out


def page_view(t: torch.Tensor, num_layers: int, num_pages: int, page_major: bool
              ) -> np.ndarray:
    """A contiguous CPU tensor of whole pages as uint8 ``[L, pages, page-layer bytes]`` (a view;
    ``page_major``: the tensor holds a page's layers together, ``[pages, L, ...]``)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise TransferError("page views need a contiguous CPU tensor")
    raw = t.reshape(-1).view(torch.uint8).numpy()
    block = raw.size // max(1, num_layers * num_pages)
    if page_major:
        return raw.reshape(num_pages, num_layers, block).transpose(1, 0, 2)
    return raw.reshape(num_layers, num_pages, block)


def run_page_runs(runs, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy runs ``(src page, dst page, pages)`` between two ``page_view``s, every layer of a
    run in one strided numpy copy: a call per run, nothing planned (the way for a job of a few
    pages, where a block plan costs more to make than its copies)."""
    for s0, d0, n in runs:
        dst[:, d0:d0 + n] = src[:, s0:s0 + n]


def block_view(t: torch.Tensor, block_elems: int) -> np.ndarray:
    """A contiguous CPU tensor as a 1-D numpy array of ``block_elems``-element blocks."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise TransferError("block views need a contiguous CPU tensor")
    nbytes = block_elems * t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, nbytes)))
