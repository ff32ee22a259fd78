"""``CompanionWriter``: the background L3 writer of a companion namespace (the draft's KV pages,
the KDA state snapshots), written once per DCP group by one rank.

The same ``AsyncWriter`` the target's pages go through (batched ``put`` calls on a thread of
its own, over the companion's own store), so no store round trip sits in the serving path;
plus a report of the pages NEWLY written (``PutResult.written``, what the stats count): the
writer thread calls ``on_written(pages)`` after each batch, so a count it keeps is complete
once ``flush`` returned. The caller hands over tensors of its
own (copies: never views of pool memory that can be reused).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .base import L3Store, PutResult
from .prefetch import AsyncWriter

__all__ = ["CompanionWriter"]


class _Counted:
    """``store`` as the writer sees it: each ``put`` reports its newly written pages."""

    def __init__(self, store: L3Store, on_written: Callable[[int], None]) -> None:
        self.store, self.on_written = store, on_written

    def check_keys(self, keys):
        return self.store.check_keys(keys)

    def check_tensor(self, t, what):
        return self.store.check_tensor(t, what)

    def put(self, keys, shards) -> PutResult:
        res = self.store.put(keys, shards)
        self.on_written(res.written)
        return res


class CompanionWriter:
    """An ``AsyncWriter`` over ``store`` reporting the pages it newly wrote to ``on_written``
    (called on the writer's thread: it must be thread-safe and quick)."""

    def __init__(self, store: L3Store, on_written: Callable[[int], None]) -> None:
        self._writer = AsyncWriter(_Counted(store, on_written))

    @property
    def error(self) -> BaseException | None:
        """A background write error not yet raised by ``flush`` (a non-blocking look)."""
        return self._writer.error

    @property
    def pending_pages(self) -> int:
        return self._writer.pending_pages

    def submit(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> None:
        """Queue pages (tensors the caller no longer changes); bad input raises here."""
        self._writer.submit(keys, shards)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every submitted page; re-raise a background write error (``L3Error``)."""
        self._writer.flush(timeout)

    def close(self) -> None:
        """Flush and stop the thread (raises a write error not raised yet; closed anyway)."""
        self._writer.close()
