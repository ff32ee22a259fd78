"""Cross-rank agreement for L3 restores: no rank restores a page the others cannot.

Every value here is a MIN across the DCP group, in ONE all-reduce. A caller that already carries
these ints in its own per-step collective passes the agreed result as ``agreed=`` and no
collective is issued. The MIN is :func:`hicache.distributed.min_across_ranks`.
"""

from __future__ import annotations

from typing import Sequence

from hicache import minvec
from hicache.checks import check_int
from hicache.distributed import agree_min, min_across_ranks
from hicache.errors import DivergenceError, L3Error

_BAD_ARG = 2  # agree_min fault code: a bad length or page size on some rank


__all__ = ["min_across_ranks", "restore_length", "restore_lengths"]


def restore_lengths(local_tokens: Sequence[int], page_tokens: int, group=None,
                    agreed: Sequence[int] | None = None) -> list[int]:
    """Storage-hit lengths every rank of the group can restore, in whole widened pages.

    ``local_tokens[j]``: this rank's storage-hit length (tokens) for request j. Result j is
    ``floor(min_r local_tokens_r[j] / page_tokens) * page_tokens``. With ``agreed`` (already
    MIN-reduced elsewhere) nothing is communicated. Collective: a bad argument on any rank
    raises ``L3Error`` on every rank after the one all-reduce, and ranks passing different
    numbers of lengths raise ``DivergenceError`` on every rank.
    """
    if agreed is None:  # collective: a bad argument is raised after it, on every rank alike
        code, why, local = 0, "", []
        try:
            check_int(page_tokens, "page_tokens", error=L3Error)
            local = [check_int(v, "a local storage-hit length", 0, error=L3Error)
                     for v in local_tokens]
        except L3Error as e:
            code, why, local = _BAD_ARG, str(e), [0] * len(local_tokens)
        res = agree_min((), local, group, code=code, kind=minvec.RESTORE)
        if res.fault is not None:
            raise L3Error(why if code else f"rank {res.fault[0]} passed a bad storage-hit "
                          "length or page size to restore_lengths; every rank stops here")
        if not res.agreed:
            lo, hi = res.length
            raise DivergenceError(f"restore_lengths: ranks passed between {lo} and {hi} "
                                  f"lengths (this rank {len(local)}); the callers diverged")
        agreed = res.payload
    else:
        check_int(page_tokens, "page_tokens", error=L3Error)
        local = [check_int(v, "a local storage-hit length", 0, error=L3Error)
                 for v in local_tokens]
        agreed = [check_int(v, "an agreed storage-hit length", 0, error=L3Error) for v in agreed]
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
