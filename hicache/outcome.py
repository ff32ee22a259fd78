"""Agreed outcomes at one-off collective points: ``HiCache`` construction and close, PCP checks.

A rank that raises before or between collectives must not leave the others waiting in the next
one until the group's timeout. At such a point every rank sends one fixed-size MIN vector
(``hicache.minvec`` through ``agree_min``): its failure, if any, rides as a fault code naming
the exception's class (a fixed table, the same on every rank), and a header of ``x, -x`` pairs
gives every rank the min and max of values that must agree (a prompt length, the settings).
After the all-reduce every rank knows the lowest failing rank and what it raised, and raises at
the same point: the failing rank its own error, the others ``PeerError`` naming that rank.
One small collective when every rank is fine; with ``detail`` a failure costs one gather more
(taken by every rank: the fault is agreed) so that ``PeerError`` carries the failing rank's
message, not only its exception's class.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from hicache import distributed as hd
from hicache import errors, minvec
from hicache.errors import DivergenceError, PeerError

# Exception classes a fault code can name: hicache's, then Python's usual ones. A class not
# listed is named by its nearest listed base. Codes are EXIT_BASE + index (< FAULT_CODES),
# above the per-step agreement's codes (hicache/controller/agreement.py).
KINDS = (
    "ConfigError", "TopologyError", "CheckpointError", "HostMemoryError", "UsageError",
    "DeviceFullError", "TransferError", "L3Error", "L3CorruptError", "L3ForeignError",
    "RankError", "PeerError", "DivergenceError", "InvariantError", "HiCacheError",
    "KeyboardInterrupt", "SystemExit", "GeneratorExit", "MemoryError", "TimeoutError",
    "ConnectionError", "FileNotFoundError", "PermissionError", "OSError", "KeyError",
    "IndexError", "LookupError", "ZeroDivisionError", "OverflowError", "ArithmeticError",
    "TypeError", "ValueError", "AttributeError", "ImportError", "NotImplementedError",
    "RecursionError", "RuntimeError", "AssertionError", "StopIteration", "Exception",
    "BaseException")
EXIT_BASE = 32
SKIP_FLUSH = EXIT_BASE - 1  # HiCache.close(flush=False) with no exception: after an error
assert EXIT_BASE + len(KINDS) < minvec.FAULT_CODES


def code_of(err: BaseException) -> int:
    """The fault code naming ``err``'s class (or its nearest listed base)."""
    for cls in type(err).__mro__:
        if cls.__name__ in KINDS and (getattr(errors, cls.__name__, None) is cls
                                      or cls.__module__ == "builtins"):
            return EXIT_BASE + KINDS.index(cls.__name__)
    return EXIT_BASE + KINDS.index("BaseException")


def describe(code: int) -> str | None:
    """What the fault ``code`` of :func:`code_of` names ("a ValueError"), None if none."""
    if code == SKIP_FLUSH:
        return "close(flush=False)"
    i = code - EXIT_BASE
    if not 0 <= i < len(KINDS):
        return None
    return f"{'an' if KINDS[i][0] in 'AEIOU' else 'a'} {KINDS[i]}"


def _line(err: BaseException) -> str:
    """``err``'s first line for the peers (its class alone if it cannot be printed: every
    rank must reach the gather that follows)."""
    try:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    except Exception:
        text = type(err).__name__
    line = text.splitlines()[0] if text.strip() else type(err).__name__
    return line if len(line) <= 400 else line[:397] + "..."


def checkpoint(where: str, error: BaseException | None, group=None,
               header: Sequence[int] = (), *, detail: bool = False,
               kind: int = minvec.CHECKPOINT) -> list[int]:
    """Every rank of ``group`` calls this at the same point, ``error`` being what this rank
    raised there (None: fine). Returns ``header`` MIN-reduced when no rank failed; else raises
    on every rank: ``error`` itself where there is one, ``PeerError`` (the lowest failing
    rank, what it raised) elsewhere; a rank in another ``kind`` of agreement (``minvec.KINDS``)
    makes every rank raise (``error`` itself, else ``KindMismatch``). Alone (no group of two ranks or more) nothing is
    communicated: ``error`` is raised as it is."""
    code = code_of(error) if error is not None else 0
    try:
        res = hd.agree_min(header, [], group, code=code, kind=kind)
    except hd.KindMismatch as e:  # another rank is in another agreement: every rank stops
        if error is not None:
            raise error from None
        raise hd.KindMismatch(e.kind, e.rank, e.other, e.other_rank, e.fault,
                              where=where) from None
    if res.fault is None:
        return res.header
    rank, first = res.fault
    what = describe(first)
    if detail and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:  # agreed: every rank saw the fault and gathers
            lines = hd.all_gather_object(None if error is None else _line(error), world, group)
            what = lines[rank] or what
    if error is not None:
        raise error
    if first == minvec.BAD_VALUE:
        raise DivergenceError(f"{where}: rank {rank} sent a value that is not an int64; every "
                              "rank stops here")
    raise PeerError(where, rank, what or f"fault {first}")


__all__ = ["KINDS", "EXIT_BASE", "SKIP_FLUSH", "checkpoint", "code_of", "describe"]
