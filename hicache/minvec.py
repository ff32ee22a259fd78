"""The fixed-size vector every cross-rank MIN agreement sends (pure: no torch, no I/O).

A MIN all-reduce is only defined when every rank sends a tensor of the same size. The number of
values a rank wants to agree on (in-flight ops, prefetch signals, restore lengths) comes from its
own state, which is exactly what may have diverged; and a rank whose input is bad must still
send, or the others wait in the collective until it times out. So every rank sends

    [fault, len, -len, kind_lo, kind_hi, header_0 .. header_{H-1}, payload_0 .. payload_{C-1}]

of size ``5 + H + C`` whatever its state. ``hicache.distributed.agree_min`` sends EVERY kind
of agreement (a step, a close, a checkpoint, ...) with ``H = HEADER_SLOTS`` (a kind's header
padded with zeros) and ``C = CAPACITY`` (payload padded with zeros, or cut there: ``rest`` is the
part past it), so ranks that meet in agreements of different kinds still send one size.

- ``fault``: ``NO_FAULT`` when this rank's input is fine, else ``rank * FAULT_CODES + code``:
  the MIN names the lowest faulty rank and its reason code on every rank.
- ``len, -len``: the payload length; the MIN gives (min, -max) over ranks, so every rank learns
  whether the lengths agree. Only then, and when they exceed ``C``, a second collective of the
  agreed size ``len - C`` carries the rest: every rank decides that from the same reduced
  vector, so no rank ever sends a tensor of another size than the others.
- ``kind_lo, kind_hi``: ``kind * KIND_RANKS + rank`` and ``-kind * KIND_RANKS + rank``: the
  MIN gives the lowest kind and the lowest rank in it, and the highest kind and the lowest rank
  in that, so ranks in agreements of different kinds (``KINDS``) learn it, and who, from the one
  collective.
- The header is the caller's: MIN-reduced as it is (send ``x, -x`` for a min/max pair).

``unpack`` reads a reduced vector. Values must be int64; a value that is not (or cannot be
made an int) turns into the fault ``BAD_VALUE`` rather than an exception before the collective.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple, Sequence

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
NO_FAULT = INT64_MAX
FAULT_CODES = 256   # reason codes per rank in the fault slot (0 = fine)
BAD_VALUE = 1       # reserved reason: a header or payload value that is not an int64
HEADER = 5          # fault, len, -len, kind_lo, kind_hi
HEADER_SLOTS = 16   # every kind's header, padded to this (agree_min)
KIND_RANKS = 1 << 24  # ranks per kind in the kind slots
# the kinds of agreement (0: a vector packed without one, as in the pure tests)
PLAIN, STEP, CLOSE, CHECKPOINT, PCP, RESTORE, PREFETCH = 1, 2, 3, 4, 5, 6, 7
KINDS = {0: "an unnamed agreement", PLAIN: "a plain min_across_ranks",
         STEP: "a step agreement", CLOSE: "a HiCache close", CHECKPOINT: "a checkpoint",
         PCP: "a PCP check", RESTORE: "restore_lengths", PREFETCH: "a prefetch agreement"}
# Payload slots in the fixed vector. A scheduler step agrees on a few in-flight copies (one or
# two per running request) plus 1 + 2 per request waiting on L3; 64 covers a busy step, and a
# 3 + H + 64 int64 vector (< 1 KiB) costs one small all-reduce like the 10-value one it replaces
# (latency-bound; see bench/README.md). A step with more rides a second, agreed-size collective.
CAPACITY = 64


def pair(x: int) -> tuple[int, int]:
    """``(x, -x)``: MIN-reduced, ``(min, -max)`` over ranks."""
    return x, -x


def fault_slot(rank: int, code: int) -> int:
    if code == 0:
        return NO_FAULT
    if not 0 < code < FAULT_CODES or rank < 0:
        raise ValueError(f"fault code {code} must be in 1..{FAULT_CODES - 1} (rank {rank})")
    return rank * FAULT_CODES + code


class Packed(NamedTuple):
    vec: array        # int64: [fault, len, -len, *header, *payload[:capacity] zero-padded]
    rest: array       # int64: payload[capacity:] (sent only when every rank agreed on the length)
    code: int         # this rank's fault code (BAD_VALUE when a value was not an int64)


def _int64s(values: Sequence) -> array:
    try:
        return array("q", values)  # ints (and anything with __index__), range-checked in C
    except TypeError:
        return array("q", [int(v) for v in values])  # e.g. floats, as int() reads them


def kind_name(kind: int) -> str:
    return KINDS.get(kind, f"agreement kind {kind}")


def pack(header: Sequence, payload: Sequence, *, rank: int, code: int = 0,
         capacity: int = CAPACITY, kind: int = 0, header_slots: int | None = None) -> Packed:
    """This rank's vector (never raises for bad values: they become the ``BAD_VALUE`` fault,
    with header and payload zeroed; the payload's length is kept). ``header_slots``: pad the
    header with zeros to this many values (a longer header is a bug of the calling code:
    ``ValueError``). The vectors are ``array`` buffers, so a tensor can wrap them without a copy
    (``torch.frombuffer``)."""
    n = len(payload)
    pad = 0
    if header_slots is not None:
        pad = header_slots - len(header)
        if pad < 0:
            raise ValueError(f"a header of {len(header)} values does not fit the fixed "
                             f"{header_slots} header slots")
    if not code:
        try:
            head, body = _int64s(header), _int64s(payload)
        except (TypeError, ValueError, OverflowError):
            code = BAD_VALUE
    if code:
        head, body = array("q", bytes(8 * len(header))), array("q", bytes(8 * n))
    k = kind * KIND_RANKS
    vec = array("q", (fault_slot(rank, code), n, -n, k + rank, rank - k))
    vec += head
    if pad:
        vec.frombytes(bytes(8 * pad))
    vec += body[:capacity]
    if n < capacity:
        vec.frombytes(bytes(8 * (capacity - n)))
    return Packed(vec, body[capacity:], code)


class Unpacked(NamedTuple):
    fault: tuple[int, int] | None  # (rank, code) of the lowest faulty rank; None: all fine
    length: tuple[int, int]        # (min, max) of the payload length over ranks
    header: list[int]              # MIN over ranks
    head: list[int]                # the payload's first slots (MIN), meaningful when agreed
    capacity: int
    kinds: tuple[int, int, int, int]  # (lowest kind, lowest rank in it, highest kind, ...)

    @property
    def same_kind(self) -> bool:
        return self.kinds[0] == self.kinds[2]

    def other_kind(self, kind: int) -> tuple[int, int]:
        """(kind, rank): a rank in another kind than ``kind`` (when not ``same_kind``)."""
        lo, r_lo, hi, r_hi = self.kinds
        return (hi, r_hi) if kind == lo else (lo, r_lo)

    @property
    def agreed(self) -> bool:
        """One kind, no fault and every rank's payload has the same length."""
        return (self.fault is None and self.length[0] == self.length[1]
                and self.kinds[0] == self.kinds[2])

    @property
    def overflow(self) -> int:
        """Size of the second collective (0: none): the agreed length past the capacity."""
        return max(0, self.length[0] - self.capacity) if self.agreed else 0


def unpack(vec: Sequence[int], header_len: int, capacity: int = CAPACITY) -> Unpacked:
    """Read a MIN-reduced vector of :func:`pack` (``header_len`` = len of the header packed)."""
    if len(vec) != HEADER + header_len + capacity:
        raise ValueError(f"a vector of {len(vec)} values for a header of {header_len} and "
                         f"capacity {capacity}")
    vec = list(vec)  # python ints (a tensor's tolist() already is)
    f = vec[0]
    fault = None if f == NO_FAULT else divmod(f, FAULT_CODES)
    lo, hi = vec[1], -vec[2]
    k_lo, r_lo = divmod(vec[3], KIND_RANKS)
    k_hi, r_hi = divmod(vec[4], KIND_RANKS)
    start = HEADER + header_len
    head = vec[start:start + min(lo, capacity)] if lo == hi else []
    return Unpacked(fault, (lo, hi), vec[HEADER:start], head, capacity,
                    (k_lo, r_lo, -k_hi, r_hi))
