"""Cross-rank agreement on per-step control-plane facts.

Every rank calls ``step`` once per scheduler step, always (no early return: a skipped collective
deadlocks the others). One int64 tensor, one all_reduce(MIN):

    [n_ops, -n_ops, sig, -sig, n_extra, -n_extra, done_0 .. done_{n-1}, extra_0 .. extra_{m-1}]

``done_i`` is 1 where this rank finished in-flight op i (ops in id order, identical on every
rank), so the MIN is 1 only where every rank finished. ``extras`` (e.g. storage-hit lengths) are
MIN-reduced as they are. The header pairs detect ranks whose op lists differ. Without a process
group (or with world size 1) no collective is issued. In debug mode a digest of the controller
is also gathered and compared; a difference raises ``DivergenceError`` naming the first one.
"""

from __future__ import annotations

from typing import Any, Collection, NamedTuple, Sequence

import torch.distributed as dist

from hicache.errors import DivergenceError
from hicache import distributed as hd

_SIG_MOD = (1 << 61) - 1


class AgreedStep(NamedTuple):  # immutable, and cheap to make once per scheduler step
    done_ops: tuple[int, ...]   # op ids finished on every rank
    extras: tuple[int, ...]     # MIN over ranks of each extra
    step: int


def _signature(op_ids: Sequence[int]) -> int:
    s = 0
    for o in op_ids:
        s = (s * 1_000_003 + int(o) + 1) % _SIG_MOD
    return s


class StepAgreement:
    """Per-step MIN agreement over ``group`` (default: the world group if initialised)."""

    def __init__(self, group: Any = None, *, debug: bool = False, local: bool | None = None):
        if local is None:
            local = not dist.is_available() or not dist.is_initialized()
        self.group = group
        self.world_size = 1 if local else dist.get_world_size(group)
        self.rank = 0 if local else dist.get_rank(group)
        self.local = local or self.world_size == 1
        self.debug = debug
        self.steps = 0

    def step(self, op_ids: Sequence[int], done: "Collection[int] | Sequence[bool]",
             extras: Sequence[int] = (), digest: Any = None) -> AgreedStep:
        """Agree on which of ``op_ids`` (in-flight, ascending) every rank finished.

        ``done``: the op ids this rank finished (a set/collection of ids), or one bool per op.
        ``extras``: ints to MIN-reduce. ``digest``: required in debug mode."""
        if self.local and not op_ids and not extras:  # nothing to agree on: the common case
            self.steps += 1
            return AgreedStep((), (), self.steps - 1)
        op_ids = [int(o) for o in op_ids]
        if any(b <= a for a, b in zip(op_ids, op_ids[1:])):
            raise DivergenceError(f"op ids must be strictly ascending, got {op_ids}")
        flags = self._flags(op_ids, done)
        extras = [int(e) for e in extras]
        if self.debug and digest is None:
            raise DivergenceError("debug agreement needs a digest (pass controller.digest())")
        if self.local:  # no collective: this rank's view is the agreed one
            out = AgreedStep(tuple([o for o, f in zip(op_ids, flags) if f]), tuple(extras),
                             self.steps)
            self.steps += 1
            return out
        n, m, sig = len(op_ids), len(extras), _signature(op_ids)
        v = hd.min_across_ranks([n, -n, sig, -sig, m, -m] + flags + extras, self.group)
        if v[0] != -v[1] or v[2] != -v[3] or v[4] != -v[5]:
            raise DivergenceError(
                f"step {self.steps}: ranks disagree on the in-flight ops or extras (this rank: "
                f"{n} ops, signature {sig}, {m} extras; min/max over ranks: ops {v[0]}/{-v[1]}, "
                f"extras {v[4]}/{-v[5]}); the controllers diverged")
        if self.debug:
            self._compare(digest)
        agreed = tuple([o for o, f in zip(op_ids, v[6:6 + n]) if f == 1])
        out = AgreedStep(agreed, tuple(v[6 + n:]), self.steps)
        self.steps += 1
        return out

    @staticmethod
    def _flags(op_ids: list[int], done) -> list[int]:
        if isinstance(done, (set, frozenset, dict)):
            unknown = set(done) - set(op_ids)
            if unknown:
                raise DivergenceError(f"done ids {sorted(unknown)} are not in flight")
            return [1 if o in done else 0 for o in op_ids]
        done = list(done)
        if all(isinstance(d, bool) for d in done):
            if len(done) != len(op_ids):
                raise DivergenceError(f"{len(done)} done flags for {len(op_ids)} in-flight ops")
            return [1 if d else 0 for d in done]
        return StepAgreement._flags(op_ids, {int(d) for d in done})

    def _compare(self, digest: Any) -> None:
        allg = hd.all_gather_object(digest, self.world_size, group=self.group)
        ref = allg[0]
        for r, other in enumerate(allg[1:], start=1):
            if other == ref:
                continue
            if isinstance(ref, list) and isinstance(other, list):
                for i, (a, b) in enumerate(zip(ref, other)):
                    if a != b:
                        raise DivergenceError(f"step {self.steps}: rank {r} differs from rank 0 "
                                              f"at digest entry {i}: rank 0 {a!r}, rank {r} {b!r}")
                raise DivergenceError(f"step {self.steps}: rank {r} has {len(other)} digest "
                                      f"entries, rank 0 has {len(ref)} (first extra: "
                                      f"{(other + ref)[min(len(ref), len(other))]!r})")
            raise DivergenceError(f"step {self.steps}: rank {r} digest {other!r} != rank 0 "
                                  f"{ref!r}")
