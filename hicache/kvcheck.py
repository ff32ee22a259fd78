"""What ``hicache-bench --verify`` and the soak compare besides tokens: KV rows and logits.

A tiny model's greedy tokens barely move under corrupt KV, so a check of tokens alone passes a
cache that serves wrong bytes. A ``KVProbe`` handed to ``Server(probe=...)`` records, on its
rank, right after each request's prefill (every layer waited for, so restored pages hold their
rows):

- the logits of the request's first generated token (float32 [vocab]);
- for each page of the prompt the cache served (its hit: L1, L2 load-back, L3 restore), or, with
  ``all_pages`` (the recompute reference), every whole page of the prompt: a fingerprint of the
  rows this rank holds for it, keyed by the chain hash of the tokens up to the page's end (the
  KV of a position depends on those tokens only): the XXH3-64 of the raw bytes (bitwise
  equality) and a fixed random projection of the rows (float32 [layers, rows, 8]: a changed
  row moves it; 1/36 of the rows' size when kv_dim is 576).

``compare(reference, got)`` matches pages by key: pages compared, bitwise equal, the largest
absolute difference of the projections, and the pages whose difference exceeds the tolerance
(``bad_pages``); and per request the largest absolute logit difference (``bad_logits`` past the
tolerance). A tier that holds exact bytes gives bitwise-equal pages where the reference
computed the rows with the same batch shape, and differences at the level of float rounding
otherwise; corrupt KV gives differences of the rows' own size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

PROJ = 8           # projection width
REL_TOL = 1e-3     # a difference past REL_TOL * max(1, |reference|) (or 8 ulps) is reported


def _projection(kv_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(27)
    signs = torch.randint(0, 2, (kv_dim, PROJ), generator=g, dtype=torch.float32) * 2 - 1
    return signs / kv_dim ** 0.5


def _tol(dtype: torch.dtype) -> float:
    return max(REL_TOL, 8 * torch.finfo(dtype).eps)


class KVProbe:
    """One rank's record of what it served (see the module doc)."""

    def __init__(self, kv, page_tokens: int, *, all_pages: bool = False) -> None:
        self.kv, self.w, self.all_pages = kv, page_tokens, all_pages
        self.rows = kv.layout.page_size  # rows of a widened page on this rank
        self.proj = _projection(kv.kv_dim)
        self.pages: dict[int, tuple[int, np.ndarray]] = {}
        self.logits: dict = {}

    def prefilled(self, request_id, tokens: np.ndarray, prefix, logits: torch.Tensor) -> None:
        self.logits[request_id] = logits.detach().float().cpu().numpy()
        n = len(tokens) // self.w if self.all_pages else prefix.hit_len // self.w
        if n == 0:
            return
        pages = torch.as_tensor(prefix.page_table[:n], dtype=torch.int64)
        idx = (pages[:, None] * self.rows + torch.arange(self.rows)).reshape(-1)
        idx = idx.to(self.kv.device)
        rows = torch.stack([self.kv.layer_view(i).index_select(0, idx)
                            for i in range(self.kv.num_layers)]).cpu()  # [L, n*rows, d]
        rows = rows.view(self.kv.num_layers, n, self.rows, -1).transpose(0, 1).contiguous()
        proj = (rows.float() @ self.proj).numpy()                      # [n, L, rows, PROJ]
        raw = rows.view(torch.uint8) if rows.dtype != torch.bool else rows
        h = xxhash.xxh3_64()
        toks = np.ascontiguousarray(tokens, dtype=np.int64)
        for j in range(n):
            h.update(toks[j * self.w:(j + 1) * self.w].tobytes())
            key = h.intdigest()
            if key not in self.pages:
                self.pages[key] = (xxhash.xxh3_64_intdigest(raw[j].numpy().tobytes()), proj[j])

    def result(self) -> dict:
        return {"pages": self.pages, "logits": self.logits, "dtype": str(self.kv.dtype)}


@dataclass
class Comparison:
    pages: int = 0              # served pages compared with the reference's rows
    bitwise: int = 0            # of which bitwise equal
    kv_max_abs_diff: float = 0.0  # largest |difference| of the projected rows
    bad_pages: int = 0          # pages past the tolerance: corrupt KV
    requests: int = 0           # requests whose first-token logits were compared
    logits_max_abs_diff: float = 0.0
    bad_logits: int = 0         # requests whose logits differ past the tolerance

    def add(self, other: "Comparison") -> None:
        for k in ("pages", "bitwise", "bad_pages", "requests", "bad_logits"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.kv_max_abs_diff = max(self.kv_max_abs_diff, other.kv_max_abs_diff)
        self.logits_max_abs_diff = max(self.logits_max_abs_diff, other.logits_max_abs_diff)

    @property
    def ok(self) -> bool:
        return not self.bad_pages and not self.bad_logits

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def line(self) -> str:
        return (f"KV of {self.pages} served pages: {self.bitwise} bit-identical, max |diff| "
                f"{self.kv_max_abs_diff:.3g}, {self.bad_pages} corrupt; first-token logits of "
                f"{self.requests} requests: max |diff| {self.logits_max_abs_diff:.3g}, "
                f"{self.bad_logits} differ")


def compare(reference: dict, got: dict, key=lambda rid: rid) -> Comparison:
    """``got`` (a probe's result) against the reference run's on the same rank. ``key`` maps
    a request id of ``got`` to the reference's (the soak renames its requests)."""
    tol = _tol(getattr(torch, reference.get("dtype", "torch.float32").removeprefix("torch.")))
    c = Comparison()
    ref_pages = reference["pages"]
    for k, (h, proj) in got["pages"].items():
        ref = ref_pages.get(k)
        if ref is None:
            continue  # not a page of any prompt the reference ran (cannot happen in a replay)
        c.pages += 1
        c.bitwise += int(h == ref[0])
        d = float(np.abs(proj - ref[1]).max())
        c.kv_max_abs_diff = max(c.kv_max_abs_diff, d)
        c.bad_pages += int(d > tol * max(1.0, float(np.abs(ref[1]).max())))
    ref_logits = reference["logits"]
    for rid, lg in got["logits"].items():
        ref = ref_logits.get(key(rid))
        if ref is None or ref.shape != lg.shape:
            continue
        c.requests += 1
        d = float(np.abs(lg - ref).max())
        c.logits_max_abs_diff = max(c.logits_max_abs_diff, d)
        c.bad_logits += int(d > REL_TOL * max(1.0, float(np.abs(ref).max())))
    return c


def corrupt_pages(pool, pages, rng: np.random.Generator) -> int:
    """Overwrite the rows of ``pages`` of a host pool (``HostKVPool``) with noise of four times
    their spread (a mutation no checksum sees: L2 has none, and L3 values written from it carry
    a valid one). Returns how many pages were changed."""
    n = 0
    for p in pages:
        v = pool.page_view(int(p))
        scale = 4 * max(float(v.float().std()), 1e-3)
        noise = torch.from_numpy(rng.standard_normal(tuple(v.shape), dtype=np.float32))
        v.copy_((noise * scale).to(v.dtype))
        n += 1
    return n


__all__ = ["Comparison", "KVProbe", "compare", "corrupt_pages"]
