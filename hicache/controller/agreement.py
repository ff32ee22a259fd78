"""Cross-rank agreement on per-step control-plane facts.

Every rank calls ``step`` once per scheduler step, always (no early return: a skipped collective
deadlocks the others). One all_reduce(MIN) of a FIXED-size int64 vector (``hicache.minvec``,
through ``hicache.distributed.agree_min``):

    [fault, len, -len, kind_lo, kind_hi,                   (len = n_ops + n_extra)
     n_ops, -n_ops, sig, -sig, n_extra, -n_extra, debug, -debug, dig, -dig,
     act, -act, 0 ..                                       the header, padded to HEADER_SLOTS
     done_0 .. done_{n-1}, extra_0 .. extra_{m-1}, 0 ..]   the payload, padded to CAPACITY

(the size of every kind of agreement: a rank in another kind, e.g. a close or a checkpoint,
makes every rank raise ``DivergenceError`` naming both kinds).

``done_i`` is 1 where this rank finished in-flight op i (ops in id order, identical on every
rank), so the MIN is 1 only where every rank finished. ``extras`` (e.g. storage-hit lengths) are
MIN-reduced as they are. The ``x, -x`` pairs give every rank the min and max over ranks, so
ranks whose op lists, extras or debug mode differ are detected without ever sending tensors of
different sizes; a step whose payload outgrows the capacity on every rank sends the rest in a
second all-reduce of the agreed size. A rank whose arguments are wrong (op ids not ascending,
done ids not in flight, a missing debug digest, ...) does not raise before the collective: it
sends a fault code, and after the collective EVERY rank raises ``DivergenceError`` at the same
step (that rank's message names what was wrong). In debug mode ``dig`` is a hash of the
controller's digest; only when the hashes differ is the digest gathered (an agreed decision)
to name the first difference. ``act`` is a hash of what this rank did since the last step (the
events ``note`` was given: admitted request ids with their tokens' digests, allocation sizes,
finishes): ranks that admitted other tokens or ids, or allocated other lengths, differ there,
and every rank gathers the step's events (an agreed decision) and raises ``DivergenceError``
naming the first that differs. Without a process group (or with world size 1) no collective is
issued and wrong arguments raise at once.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Collection, NamedTuple, Sequence

import torch.distributed as dist
import xxhash

from hicache.errors import DivergenceError
from hicache import distributed as hd
from hicache import minvec, outcome

_SIG_MOD = (1 << 61) - 1

# fault codes (minvec.BAD_VALUE = 1 is a value that is not an int64)
NOT_ASCENDING, NOT_IN_FLIGHT, FLAG_COUNT, NO_DIGEST, BAD_DIGEST, BAD_ARGS = 2, 3, 4, 5, 6, 7
FAULTS = {minvec.BAD_VALUE: "an extra that is not an int64",
          NOT_ASCENDING: "op ids not strictly ascending",
          NOT_IN_FLIGHT: "done ids that are not in flight",
          FLAG_COUNT: "a wrong number of done flags",
          NO_DIGEST: "no debug digest",
          BAD_DIGEST: "a debug digest that cannot be pickled",
          BAD_ARGS: "arguments of the wrong kind"}
HEADER_LEN = 12
_ACT_MASK = (1 << 60) - 1
assert HEADER_LEN <= minvec.HEADER_SLOTS  # every kind sends the same fixed header


class AgreedStep(NamedTuple):  # immutable, and cheap to make once per scheduler step
    done_ops: tuple[int, ...]   # op ids finished on every rank
    extras: tuple[int, ...]     # MIN over ranks of each extra
    step: int


class _BadInput(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _signature(op_ids: Sequence[int]) -> int:
    s = 0
    for o in op_ids:
        s = (s * 1_000_003 + int(o) + 1) % _SIG_MOD
    return s


def _digest_hash(digest: Any) -> int:
    """A 60-bit hash of the pickled digest (equal digests pickle alike in practice; a false
    difference only costs the gather that then finds none)."""
    try:
        raw = pickle.dumps(digest, protocol=4)
    except Exception as e:
        raise _BadInput(BAD_DIGEST, f"the debug digest cannot be pickled: {e!r}") from e
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 4


def check_inputs(op_ids: Sequence[int], done, extras: Sequence[int]
                 ) -> tuple[list[int], list[int], list[int]]:
    """(op ids, done flags, extras) as ints; raises ``_BadInput`` naming what is wrong."""
    try:
        op_ids = [int(o) for o in op_ids]
        extras = [int(e) for e in extras]
    except (TypeError, ValueError) as e:
        raise _BadInput(BAD_ARGS, f"op ids and extras must be ints: {e}") from e
    if extras and (min(extras) < minvec.INT64_MIN or max(extras) > minvec.INT64_MAX):
        big = next(e for e in extras if not minvec.INT64_MIN <= e <= minvec.INT64_MAX)
        raise _BadInput(minvec.BAD_VALUE, f"extra {big} does not fit in int64")
    if any(b <= a for a, b in zip(op_ids, op_ids[1:])):
        raise _BadInput(NOT_ASCENDING, f"op ids must be strictly ascending, got {op_ids}")
    return op_ids, _flags(op_ids, done), extras


def _flags(op_ids: list[int], done) -> list[int]:
    if isinstance(done, (set, frozenset, dict)):
        unknown = set(done) - set(op_ids)
        if unknown:
            raise _BadInput(NOT_IN_FLIGHT, f"done ids {sorted(unknown)} are not in flight")
        return [1 if o in done else 0 for o in op_ids]
    done = list(done)
    if all(isinstance(d, bool) for d in done):
        if len(done) != len(op_ids):
            raise _BadInput(FLAG_COUNT, f"{len(done)} done flags for {len(op_ids)} in-flight ops")
        return [1 if d else 0 for d in done]
    try:
        ids = {int(d) for d in done}
    except (TypeError, ValueError) as e:
        raise _BadInput(BAD_ARGS, f"done must be op ids or one bool per op: {e}") from e
    return _flags(op_ids, ids)


def _event(e) -> str:
    if e is None:
        return "nothing"
    return f"{e[0]}({', '.join(str(x) for x in e[1:])})"


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
        # the CPU group the vector travels on, resolved once (per-step look-ups cost more
        # than the rest of a step's Python)
        self._ctl = None if self.local else hd.control_group(group)
        self.steps = 0
        self._act = 0      # hash of this step's events (``note``)
        self._events: list = []

    def note(self, *event) -> None:
        """Record what this rank did this step (e.g. ``("admit", rid, n, token_digest)``):
        every rank must note the same events in the same order, or the next ``step`` raises
        ``DivergenceError`` on every rank naming the first that differs. Values are ints and
        strs (request ids as their ``repr``). Nothing is recorded without a collective."""
        if self.local:
            return
        self._events.append(event)
        self._act = xxhash.xxh3_64_intdigest(repr(event).encode(), seed=self._act)

    def step(self, op_ids: Sequence[int], done: "Collection[int] | Sequence[bool]",
             extras: Sequence[int] = (), digest: Any = None) -> AgreedStep:
        """Agree on which of ``op_ids`` (in-flight, ascending) every rank finished.

        ``done``: the op ids this rank finished (a set/collection of ids), or one bool per op.
        ``extras``: ints to MIN-reduce. ``digest``: required in debug mode. Raises
        ``DivergenceError`` on every rank at the same step when the ranks' op lists, extras
        counts or debug modes differ, or when any rank's arguments are wrong."""
        if self.local and not op_ids and not extras:  # nothing to agree on: the common case
            self.steps += 1
            return AgreedStep((), (), self.steps - 1)
        if self.local:  # no collective: wrong arguments raise here, this view is the agreed one
            try:
                ops, flags, ext = check_inputs(op_ids, done, extras)
                if self.debug and digest is None:
                    raise _BadInput(NO_DIGEST, "debug agreement needs a digest "
                                               "(pass controller.digest())")
            except _BadInput as e:
                raise DivergenceError(str(e)) from None
            out = AgreedStep(tuple([o for o, f in zip(ops, flags) if f]), tuple(ext),
                             self.steps)
            self.steps += 1
            return out
        try:
            res = self._agree(op_ids, done, extras, digest)
        finally:
            self.steps += 1
        return res

    def _agree(self, op_ids, done, extras, digest) -> AgreedStep:
        step = self.steps
        code, why, ops, flags, ext, dig = 0, "", [], [], [], 0
        try:
            ops, flags, ext = check_inputs(op_ids, done, extras)
            if self.debug:
                if digest is None:
                    raise _BadInput(NO_DIGEST, "debug agreement needs a digest "
                                               "(pass controller.digest())")
                dig = _digest_hash(digest)
        except _BadInput as e:
            code, why = e.code, str(e)
        except Exception as e:  # anything else wrong with the arguments: still send
            code, why = BAD_ARGS, f"bad step() arguments: {e!r}"
        n, m, sig = len(ops), len(ext), _signature(ops)
        dbg = int(self.debug)
        act, events = self._act & _ACT_MASK, self._events
        self._act, self._events = 0, []
        header = [n, -n, sig, -sig, m, -m, dbg, -dbg, dig, -dig, act, -act]
        try:
            res = hd.agree_min_on(self._ctl, self.rank, header, flags + ext, code=code,
                                  kind=minvec.STEP)
        except hd.KindMismatch as e:
            if e.other != minvec.CLOSE:
                raise hd.KindMismatch(e.kind, self.rank, e.other, e.other_rank, e.fault,
                                      where=f"step {step}") from None
            if e.fault is not None:  # the closing rank's outcome (or this rank's bad input)
                self._raise_fault(step, e.fault, code, why)
            raise DivergenceError(f"step {step}: another rank is closing its HiCache while "
                                  "this rank steps; every rank stops at this step") from None
        if res.fault is not None:
            self._raise_fault(step, res.fault, code, why)
        h = res.header
        if h[0] != -h[1] or h[2] != -h[3] or h[4] != -h[5]:
            raise DivergenceError(
                f"step {step}: ranks disagree on the in-flight ops or extras (this rank: "
                f"{n} ops, signature {sig}, {m} extras; min/max over ranks: ops {h[0]}/{-h[1]}, "
                f"extras {h[4]}/{-h[5]}); the controllers diverged")
        if h[6] != -h[7]:
            raise DivergenceError(f"step {step}: some ranks agree in debug mode and some do not "
                                  f"(this rank: debug={self.debug})")
        if h[10] != -h[11]:  # agreed: every rank gathers this step's events
            self._compare_events(step, events)
        if self.debug and h[8] != -h[9]:  # agreed: every rank gathers
            self._compare(step, digest)
        v = res.payload  # not None: equal op and extras counts make equal payload lengths
        agreed = tuple([o for o, f in zip(ops, v[:n]) if f == 1])
        return AgreedStep(agreed, tuple(v[n:]), step)

    def _raise_fault(self, step: int, fault: tuple[int, int], code: int, why: str) -> None:
        rank, first = fault
        if code:
            others = "" if rank == self.rank else \
                f"; rank {rank} also reported {FAULTS.get(first, f'fault {first}')}"
            raise DivergenceError(f"step {step}: this rank (rank {self.rank}) passed bad "
                                  f"arguments: {why}{others}; every rank stops at this step")
        closing = outcome.describe(first)  # a rank closing its HiCache (service.close)
        if first not in FAULTS and closing is not None:
            raise DivergenceError(f"step {step}: rank {rank} is closing its HiCache after "
                                  f"{closing}; every rank stops at this step")
        raise DivergenceError(f"step {step}: rank {rank} passed bad arguments "
                              f"({FAULTS.get(first, f'fault {first}')}); every rank stops at "
                              "this step")

    def _compare_events(self, step: int, events: list) -> None:
        """The ranks did different things this step: name the first event that differs."""
        allg = hd.all_gather_object(events, self.world_size, group=self.group)
        ref = allg[0]
        for r, other in enumerate(allg[1:], start=1):
            for i in range(max(len(ref), len(other))):
                a = ref[i] if i < len(ref) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise DivergenceError(
                        f"step {step}: the ranks did different things since the last step: "
                        f"event {i} on rank 0 is {_event(a)}, on rank {r} {_event(b)}; "
                        "every rank must admit, alloc and finish alike")
        raise DivergenceError(f"step {step}: the ranks' step digests differ but their events "
                              "match (a hash collision or an event that is not repr-stable)")

    def _compare(self, step: int, digest: Any) -> None:
        allg = hd.all_gather_object(digest, self.world_size, group=self.group)
        ref = allg[0]
        for r, other in enumerate(allg[1:], start=1):
            if other == ref:
                continue
            if isinstance(ref, list) and isinstance(other, list):
                for i, (a, b) in enumerate(zip(ref, other)):
                    if a != b:
                        raise DivergenceError(f"step {step}: rank {r} differs from rank 0 "
                                              f"at digest entry {i}: rank 0 {a!r}, rank {r} {b!r}")
                raise DivergenceError(f"step {step}: rank {r} has {len(other)} digest "
                                      f"entries, rank 0 has {len(ref)} (first extra: "
                                      f"{(other + ref)[min(len(ref), len(other))]!r})")
            raise DivergenceError(f"step {step}: rank {r} digest {other!r} != rank 0 "
                                  f"{ref!r}")
