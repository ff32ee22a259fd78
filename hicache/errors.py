"""Every error hicache raises on purpose, in one place: what went wrong and what to do about it.

    HiCacheError                        base: ``except HiCacheError`` catches all of them
    ├── ConfigError (ValueError)        a bad value in the policy file, a model config or a trace
    │   │                               file: the message names the key; fix the input (exit 2)
    │   ├── TopologyError               parallel sizes or a DCP/PCP layout that cannot work
    │   ├── CheckpointError             a model checkpoint the engine cannot load or run
    │   └── HostMemoryError (MemoryError)  the node's pools do not fit its host memory
    ├── UsageError (ValueError)         a call made wrongly: a bad command-line flag, or API
    │                                   arguments that cannot be right (unknown request, a page
    │                                   not allocated, a lock not held, shapes that disagree)
    ├── DeviceFullError (MemoryError)   not enough free device pages now: finish or abort
    │                                   requests, or retry after the next step
    ├── TransferError (RuntimeError)    a copy between tiers failed (agreed on every rank)
    ├── L3Error (ValueError)            the L3 store refused or failed an operation
    │   ├── L3CorruptError              the store's files or a value are damaged
    │   └── L3ForeignError              the L3 path holds another application's store
    ├── RankError (RuntimeError)        a launched rank failed (which rank, how, its traceback)
    ├── PeerError (RuntimeError)        another rank failed at a point every rank agrees on
    │                                   (HiCache construction or close, a PCP check)
    ├── DivergenceError (RuntimeError)  ranks disagree on what happened (a bug or a lost rank)
    └── InvariantError (AssertionError) hicache's own bookkeeping is inconsistent (a bug)

The second base keeps what callers already catch (``except ValueError`` around bad input,
``except MemoryError`` around allocation). No module here imports anything.
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A bad policy file, model config or trace value; the message names the key."""


class TopologyError(ConfigError):
    """Parallel sizes or a striping/partition layout that breaks a rule; the message names it."""


class CheckpointError(ConfigError):
    """A checkpoint the engine cannot load or run: the message names the file, key or tensor."""


class HostMemoryError(ConfigError, MemoryError):
    """The pools of the ranks on this node do not fit in its host memory (the message names the
    keys to lower)."""


class UsageError(HiCacheError, ValueError):
    """A call made wrongly: a bad command-line argument, or API arguments that cannot be right
    (unknown request, a page id not allocated, a lock not held, shapes that do not fit)."""


class DeviceFullError(HiCacheError, MemoryError):
    """Fewer free device pages than asked for. With ``pending`` (the controller: after evicting
    everything evictable now), that many pages become free once their write_back backups are
    agreed complete: retry after the next step."""

    def __init__(self, asked: int, free: int, total: int, pending: int | None = None) -> None:
        if pending is None:
            msg = f"asked for {asked} pages but only {free} of {total} are free"
        else:
            msg = (f"asked for {asked} device pages but only {free} of {total} are free after "
                   f"eviction ({pending} more will be free once pending write_back backups "
                   "complete; the rest are locked by running requests)")
        super().__init__(msg)
        self.asked, self.free, self.total, self.pending = asked, free, total, pending or 0


class TransferError(HiCacheError, RuntimeError):
    """A transfer between tiers failed, or the engine was used after ``close()``."""


class L3Error(HiCacheError, ValueError):
    """The L3 store refused an operation (bad keys, tensors, sizes, namespace) or failed it."""


class L3CorruptError(L3Error):
    """The store's files are damaged (found before mapping, by LMDB at open, or by the check)."""


class L3ForeignError(L3Error):
    """The L3 path holds an LMDB environment that is not a hicache store."""


class L3PartialError(L3Error):
    """Part of a store (a cluster's node) could not be reached by an operator tool: ``partial``
    is what the reachable part answered, ``reached`` / ``unreachable`` name the nodes."""

    def __init__(self, message: str, partial=None, reached=(), unreachable=()) -> None:
        super().__init__(message)
        self.partial, self.reached, self.unreachable = partial, tuple(reached), tuple(unreachable)


class RankError(HiCacheError, RuntimeError):
    """A launched rank failed. ``rank``, ``how`` (one line: the exception, the signal or the exit
    code), ``detail`` (that rank's traceback, when it raised) and ``cause`` (the exception itself
    when it could be sent back, so a user error keeps its type)."""

    def __init__(self, rank: int, how: str, detail: str = "", cause: BaseException | None = None):
        super().__init__(f"rank {rank} {how}")
        self.rank, self.how, self.detail, self.cause = rank, how, detail, cause


class PeerError(HiCacheError, RuntimeError):
    """Another rank failed at a point every rank agrees on (``HiCache`` construction or close, a
    PCP check), so this rank stops there too instead of waiting in the next collective.
    ``rank``: the lowest rank that failed; ``what``: what it raised; ``where``: the point."""

    def __init__(self, where: str, rank: int, what: str) -> None:
        super().__init__(f"{where}: rank {rank} failed ({what}); every rank stops here")
        self.where, self.rank, self.what = where, rank, what


class DivergenceError(HiCacheError, RuntimeError):
    """Ranks disagree: on the in-flight op list or the extras of a step, or (debug mode) on the
    controller's state; or ``step()`` got inconsistent arguments."""


class InvariantError(HiCacheError, AssertionError):
    """hicache's internal bookkeeping is inconsistent (a bug, reported by ``check``)."""
