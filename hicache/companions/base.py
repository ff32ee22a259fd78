"""The companion protocol: state a ``HiCache`` keeps beside the target KV under the same page
ids (docs/architecture.md, "Companions").

A companion declares its ``PageFormat`` (``format``), how it is allocated (per device page, like
the draft's KV, or per snapshot position, like a KDA state), the ops it runs beside the target's
through a transfer engine of its own (``backup`` / ``load`` / ``restore``: timed jobs, per layer
where it has layers), its L3 store (written once per DCP group), its named fields in the step
agreement (``fields`` / ``decide``), what a request's ``finish`` hands it (``finish_arg``, whose
length goes into the step's content digest: ``digest``) and ``stats`` / ``close``.

``hicache.service.HiCache`` loops over its companions and knows none by name: a new kind is one
module (a ``Companion`` subclass and a ``build(host, ...)``). No collective here, and no engine
or service import (tests/test_layering.py): a companion reaches its service through a ``Host``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from hicache.errors import TransferError, UsageError

log = logging.getLogger("hicache")

__all__ = ["Companion", "Host", "StepFields", "JobSet", "wait_future"]


@dataclass
class Host:
    """What a companion may use of the ``HiCache`` that holds it."""

    config: object
    rank: int
    replica: tuple
    page_tokens: int
    tiers: tuple
    ctrl: object                      # the replicated controller (bookkeeping only)
    io: object                        # the service's TierIO (the target's store and keys)
    device: object
    weights_signature: str
    record: Callable[[BaseException], None]  # this rank failed: agreed at the next step
    timed: Callable                   # a context manager timing a controller call
    owned: np.ndarray                 # device pages an admitted request owns (from alloc)
    held: np.ndarray                  # device pages in admitted requests' tables (a count)
    check_usable: Callable[[str], None]


class Companion:
    """One kind of state beside the target KV. Every hook has a neutral default, so a kind
    implements what it keeps; every hook is called on every rank in the same order, and what
    it changes in replicated state must follow replicated facts only."""

    name: str = ""                    # its key in ``stats()`` and in the step's fields
    finish_arg: str = ""              # the ``finish`` keyword its per-request value comes as
    format = None                     # its ``PageFormat``
    signature: str = ""               # what it adds to the ranks' settings digest
    writer = None                     # its L3 ``CompanionWriter`` on the group's writing rank
    kv = None                         # a ``CheckedPort`` the engine writes it through, if any

    # ---- match and allocation --------------------------------------------------------------
    def cap(self, host: Host, tokens: np.ndarray, req=None) -> Optional[int]:
        """The longest hit of ``tokens`` this companion can serve (None: no limit). With
        ``req`` (admission) it may remember what it found in ``req.parts[name]``; without it
        (``peek``) it changes nothing."""
        return None

    def settle(self, host: Host, req) -> None:
        """After the L1/L2 match and its load-back were issued: fill the request's prefix."""

    def forget(self, pages: Sequence[int]) -> None:
        """Device pages handed out afresh hold none of this companion's data."""

    # ---- bytes beside the target's ops (through this companion's transfer engine) ----------
    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]):
        """D2H beside a target backup: a job, or None when nothing moves."""
        return None

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]):
        """H2D beside a target load-back: a job, or None when nothing moves."""
        return None

    def write_l3(self, chains: Sequence[bytes], host_pages: Sequence[int]) -> None:
        """Queue the backed-up pages for L3 (the group's writing rank only)."""

    # ---- L3 restore, agreed with the target's ----------------------------------------------
    def start_read(self, host: Host, req) -> None:
        """At admission with an L3 prefetch: start this companion's L3 read (off admit)."""

    def resolve(self, req, wait: Callable) -> None:
        """The request's target prefetch is ready on this rank: take the read's result
        (``wait(future, default, what)``: bounded by the prefetch deadline)."""

    def fields(self, req) -> dict[str, int]:
        """Named ints this rank contributes for a request waiting on L3 (MIN-reduced)."""
        return {}

    def decide(self, host: Host, req, agreed: dict[str, int], pages: int) -> int:
        """The L3 pages to restore, given the agreed fields (may cut the target's)."""
        return pages

    def restore(self, host: Host, req, dev: list, pages: int):
        """The agreed restore: ``pages`` target pages go into ``dev``. A job, or None."""
        return None

    def drop(self, req) -> None:
        """The request ended before its restore: cancel this companion's read."""

    # ---- finish ----------------------------------------------------------------------------
    def check_finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        """UsageError (nothing changed) unless ``value`` may be kept for ``arr[:end]``."""

    def digest(self, value) -> tuple:
        """What the step's content digest notes of a finish's ``value`` (its length)."""
        return ()

    def finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        """After the insert of ``arr[:end]``: keep what ``value`` hands over."""

    # ---- the rest --------------------------------------------------------------------------
    def report(self) -> dict:
        return {}

    def close(self) -> None:
        """Stop threads and writers (flushed by the service's drain already), close stores."""


class StepFields:
    """The companions' named fields of one step's agreement: ``add(name, values)`` per field
    (one value per request waiting on L3), ``pack()`` into the step's extras in name order,
    ``unpack(agreed)`` back to ``{name: values}``. Every rank adds the same names (replicated:
    the same companions); a name is never read by its position."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._fields: dict[str, list[int]] = {}

    def add(self, name: str, values: Sequence[int]) -> None:
        if name in self._fields:
            raise UsageError(f"step field {name!r} added twice")
        if len(values) != self.count:
            raise UsageError(f"step field {name!r} has {len(values)} values for "
                             f"{self.count} requests")
        self._fields[name] = [int(v) for v in values]

    def pack(self) -> list[int]:
        return [v for name in sorted(self._fields) for v in self._fields[name]]

    def unpack(self, agreed: Sequence[int]) -> dict[str, list[int]]:
        out, i = {}, 0
        for name in sorted(self._fields):
            out[name] = list(agreed[i:i + self.count])
            i += self.count
        return out


class JobSet:
    """A target transfer job with its companions' beside it: done when all are, failed when
    any is; ``wait_layer(i)`` waits for the target's layer i and each companion's layer i (its
    last, past its own layers), and for all of every companion at the target's last layer
    (an engine that drafts after the target's forward finds its companion pages there)."""

    def __init__(self, target, companions: Sequence) -> None:
        self.target, self.companions = target, [j for j in companions if j is not None]
        self.direction = target.direction

    @property
    def nbytes(self) -> int:
        return self.target.nbytes

    @property
    def seconds(self) -> float:
        return self.target.seconds

    @property
    def num_layers(self) -> int:
        return _layers(self.target)

    def status(self) -> str:
        states = [j.status() for j in (self.target, *self.companions)]
        for s in ("failed", "pending"):
            if s in states:
                return s
        return "done"

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.target.wait_layer(layer)
        last = layer >= _layers(self.target) - 1
        for j in self.companions:
            if last:
                j.wait()
            else:
                j.wait_layer(min(layer, _layers(j) - 1))

    def wait(self, timeout: float | None = None) -> None:
        err = None
        for j in (self.target, *self.companions):
            try:
                j.wait()
            except TransferError as e:
                err = err or e
        if err is not None:
            raise err


def _layers(job) -> int:
    return getattr(job, "num_layers", 1)  # a job that could not be issued has none


def wait_future(future, default, bound: float, what: str, request_id):
    """``future``'s result within ``bound`` seconds, else ``default`` (a timeout or the read's
    error: a miss on this rank, which the agreement makes a miss on every rank)."""
    try:
        return future.result(timeout=bound)
    except Exception as err:  # noqa: BLE001
        future.cancel()
        log.warning("L3 read of the %s of request %r: %s (recomputed)", what, request_id,
                    err or type(err).__name__)
        return default
