"""Absorbed MLA attention over latent KV rows, returning the partial output and its LSE.

A latent row is ``c_kv | k_pe`` (``kv_lora_rank + rope_dim`` values). With q_nope absorbed
through W_UK the score of query t, head h against row n is

    s = scale * (q_lat[t, h] . c_kv[n] + q_pe[t, h] . k_pe[n])

and the output stays in the latent space: ``o[t, h] = softmax(s)[t, h] @ c_kv``. Causality uses
GLOBAL positions: a key is allowed iff ``kv_pos <= q_pos``, so a rank holding only a shard of the
sequence (DCP) or a chunk of it (ring / chunked prefill) masks exactly what a dense run would.

``attend_latent`` is the one entry point: torch on CPU, the Triton kernel
(``hicache.kernels.decode_attention``) on CUDA where it applies.
"""

from __future__ import annotations

import math
import os

import torch

from hicache.errors import UsageError


_BACKENDS = ("auto", "torch", "triton")
# Queries per chunk of the torch path: bounds the [chunk, H, N] score tensor.
_SCORE_BUDGET = 1 << 24


def _check(q_lat, q_pe, kv, q_pos, kv_pos, kv_lora_rank, rows=None) -> None:
    if q_lat.dim() != 3 or q_pe.dim() != 3:
        raise UsageError(
            f"q_lat and q_pe must be [T, H, D]; got {tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    t, h, r = q_lat.shape
    if r != kv_lora_rank:
        raise UsageError(f"q_lat last dim {r} != kv_lora_rank {kv_lora_rank}")
    if q_pe.shape[:2] != (t, h):
        raise UsageError(
            f"q_pe {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)} in [T, H]")
    if kv.dim() != 2 or kv.shape[1] != kv_lora_rank + q_pe.shape[2]:
        raise UsageError(
            f"kv must be [N, {kv_lora_rank + q_pe.shape[2]}] (kv_lora_rank + rope_dim); "
            f"got {tuple(kv.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64
                             or rows.device != kv.device):
        raise UsageError(f"rows must be int64 [N] on {kv.device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    n = kv.shape[0] if rows is None else rows.shape[0]
    if q_pos.shape != (t,) or kv_pos.shape != (n,):
        raise UsageError(
            f"q_pos must be [{t}] and kv_pos [{n}]; got {tuple(q_pos.shape)} and "
            f"{tuple(kv_pos.shape)}")
    if q_pos.dtype != torch.int64 or kv_pos.dtype != torch.int64:
        raise UsageError(f"positions must be int64, got {q_pos.dtype} and {kv_pos.dtype}")


def attend_latent_torch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                        q_pos: torch.Tensor, kv_pos: torch.Tensor, scale: float,
                        kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: fp32 math, queries in chunks. Same contract as ``attend_latent``."""
    t, h, r = q_lat.shape
    n = kv.shape[0]
    o = torch.zeros(t, h, r, dtype=torch.float32, device=q_lat.device)
    lse = torch.full((t, h), -math.inf, dtype=torch.float32, device=q_lat.device)
    if t == 0 or n == 0:
        return o, lse
    c_kv = kv[:, :kv_lora_rank].float()  # [N, R]
    k_pe = kv[:, kv_lora_rank:].float()  # [N, Dr]
    chunk = max(1, _SCORE_BUDGET // max(1, h * n))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        # scores [t', H, N]
        scores = torch.matmul(q_lat[s:e].float(), c_kv.T)
        scores += torch.matmul(q_pe[s:e].float(), k_pe.T)
        scores *= scale
        allowed = kv_pos[None, :] <= q_pos[s:e, None]  # [t', N]
        scores = scores.masked_fill(~allowed[:, None, :], -math.inf)
        part_lse = torch.logsumexp(scores, dim=-1)  # [t', H]; -inf where nothing allowed
        empty = torch.isinf(part_lse)
        safe = torch.where(empty, torch.zeros_like(part_lse), part_lse)
        p = torch.exp(scores - safe[..., None])  # 0 on masked keys
        o[s:e] = torch.matmul(p, c_kv)
        lse[s:e] = part_lse
    return o, lse


def _triton_applies(kv: torch.Tensor) -> bool:
    if not kv.is_cuda or kv.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    from hicache.kernels import decode_attention as k
    return k.available()


def attend_latent(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                  q_pos: torch.Tensor, kv_pos: torch.Tensor, scale: float, kv_lora_rank: int,
                  backend: str = "auto", rows: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal absorbed-MLA attention of T queries over N latent rows (any subset of positions).

    q_lat [T, H, R], q_pe [T, H, Dr], kv [N, R + Dr] (c_kv | k_pe), q_pos int64 [T],
    kv_pos int64 [N] global positions; key n is allowed for query t iff kv_pos[n] <= q_pos[t].
    With ``rows`` int64 [N] the keys are ``kv[rows]`` of a larger ``kv`` (a pool layer): the
    Triton kernel reads them in place, the torch path gathers them.
    Returns o [T, H, R] fp32 normalised over the allowed keys and lse [T, H] fp32 (natural log;
    -inf and o = 0 where a query has no allowed key). ``backend``: auto | torch | triton
    (env ``HICACHE_ATTN_BACKEND`` overrides auto).
    """
    if backend not in _BACKENDS:
        raise UsageError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    q_pos = torch.as_tensor(q_pos, dtype=torch.int64, device=kv.device)
    kv_pos = torch.as_tensor(kv_pos, dtype=torch.int64, device=kv.device)
    _check(q_lat, q_pe, kv, q_pos, kv_pos, kv_lora_rank, rows)
    if backend == "auto":
        backend = os.environ.get("HICACHE_ATTN_BACKEND", "auto")
        if backend not in _BACKENDS:
            raise UsageError(
                f"HICACHE_ATTN_BACKEND must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if _triton_applies(kv) else "torch"
    if backend == "triton":
        from hicache.kernels.decode_attention import decode_attention_latent
        return decode_attention_latent(q_lat, q_pe, kv, q_pos, kv_pos, scale, kv_lora_rank,
                                       rows=rows)
    if rows is not None:
        kv = kv.index_select(0, rows)  # [N, R + Dr]
    return attend_latent_torch(q_lat, q_pe, kv, q_pos, kv_pos, scale, kv_lora_rank)
