"""The one exact merge of partial attention states, used by DCP decode, ring attention and tests.

Each part r is a normalised partial output ``o_r`` over a disjoint subset of keys, with its
log-sum-exp ``lse_r`` (base e or 2, as the attention backend produced it):

    lse = logsumexp_r(lse_r)            o = sum_r exp(lse_r - lse) * o_r

Empty parts (no keys: lse = -inf) get weight 0 exactly; a query with no keys at all gets o = 0
and lse = -inf, never NaN. NaN and +inf LSEs are treated as empty (sanitised). The arithmetic
runs in the wider of fp32 and the inputs' dtype (fp64 inputs merge to ~1e-15, not ~1e-7).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from hicache.errors import UsageError

LN2 = math.log(2.0)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The wider of fp32 and ``dtypes`` (fp16/bf16 -> fp32, fp64 -> fp64)."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d) if d.is_floating_point else out
    return out


def merge_weights(lse_parts: torch.Tensor, base: str = "e",
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge weights and merged LSE from partial LSEs.

    lse_parts: [R, ...] (base e or 2). Returns (w [R, ...] with ``sum_r w = 1`` where any
    part is non-empty and all zeros where every part is empty, lse [...] in ``base``), both in
    ``dtype`` (default: the wider of fp32 and ``lse_parts.dtype``).
    """
    if base not in ("e", "2"):
        raise UsageError(f"base must be 'e' or '2', got {base!r}")
    lse = lse_parts.to(dtype or compute_dtype(lse_parts.dtype))
    if base == "2":
        lse = lse * LN2
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, -math.inf))
    m = lse.amax(dim=0)  # [...]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # [R, ...]; exp(-inf) = 0 for empty parts
    total = w.sum(dim=0)
    empty = total == 0
    out_lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(total))
    w = w / torch.where(empty, torch.ones_like(total), total)
    if base == "2":
        out_lse = out_lse / LN2
    return w, out_lse


def merge_attn_states(o_parts: Sequence[torch.Tensor] | torch.Tensor,
                      lse_parts: Sequence[torch.Tensor] | torch.Tensor,
                      base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention outputs exactly.

    o_parts:   [R, ..., D] (or a sequence of R tensors [..., D])
    lse_parts: [R, ...]    (or a sequence of R tensors [...])
    Returns (o [..., D] in o's dtype, lse [...] in the same base), computed in the wider of fp32
    and the inputs' dtypes; lse comes back in that dtype (fp32 unless an input is fp64).
    """
    if base not in ("e", "2"):
        raise UsageError(f"base must be 'e' or '2', got {base!r}")
    o = o_parts if isinstance(o_parts, torch.Tensor) else torch.stack(list(o_parts))
    lse = lse_parts if isinstance(lse_parts, torch.Tensor) else torch.stack(list(lse_parts))
    if o.shape[:-1] != lse.shape:
        raise UsageError(f"o parts {tuple(o.shape)} and lse parts {tuple(lse.shape)} disagree")
    ct = compute_dtype(o.dtype, lse.dtype)
    w, out_lse = merge_weights(lse, base, ct)
    # an empty part may carry garbage (even NaN) in o: it must not leak through 0 * NaN
    parts = torch.where(w[..., None] > 0, o.to(ct), torch.zeros((), dtype=ct, device=o.device))
    out = (w[..., None] * parts).sum(dim=0)
    return out.to(o.dtype), out_lse
