"""Cross-rank agreement for L3 restores: no rank restores a page the others cannot.

Every value here is a MIN across the DCP group, in ONE all-reduce. A caller that already carries
these ints in its own per-step collective passes the agreed result as ``agreed=`` and no
collective is issued. (A MAX rides in the same MIN all-reduce as ``-MIN(-x)``.)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hicache import distributed as hd

from .keys import L3Error


def min_across_ranks(values: Sequence[int], group=None) -> list[int]:
    """Element-wise MIN of ``values`` over the group with one all-reduce (no-op alone). A CPU
    tensor over the group's control group (a gloo twin of an NCCL group): no GPU sync."""
    vals = [int(v) for v in values]
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return vals
    t = torch.tensor(vals, dtype=torch.int64)
    hd.all_reduce(t, op=dist.ReduceOp.MIN, group=hd.control_group(group))
    return [int(v) for v in t.tolist()]


def _check_len(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise L3Error(f"{what} must be a non-negative int, got {x!r}")
    return x


def restore_lengths(local_tokens: Sequence[int], page_tokens: int, group=None,
                    agreed: Sequence[int] | None = None) -> list[int]:
    """Storage-hit lengths every rank of the group can restore, in whole widened pages.

    ``local_tokens[j]``: this rank's storage-hit length (tokens) for request j. Result j is
    ``floor(min_r local_tokens_r[j] / page_tokens) * page_tokens``. With ``agreed`` (already
    MIN-reduced elsewhere) nothing is communicated.
    """
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
        raise L3Error(f"page_tokens must be a positive int, got {page_tokens!r}")
    local = [_check_len(v, "a local storage-hit length") for v in local_tokens]
    if agreed is None:
        agreed = min_across_ranks(local, group)
    else:
        agreed = [_check_len(v, "an agreed storage-hit length") for v in agreed]
        if len(agreed) != len(local):
            raise L3Error(f"{len(agreed)} agreed lengths for {len(local)} requests")
        for a, lv in zip(agreed, local):
            if a > lv:
                raise L3Error(f"agreed length {a} exceeds this rank's own hit length {lv}: "
                              "the agreement must be a MIN that includes this rank")
    return [(a // page_tokens) * page_tokens for a in agreed]


def restore_length(local_tokens: int, page_tokens: int, group=None,
                   agreed: int | None = None) -> int:
    """One request's version of :func:`restore_lengths`."""
    return restore_lengths([local_tokens], page_tokens, group,
                           None if agreed is None else [agreed])[0]
