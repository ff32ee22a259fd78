"""The fixed-size vector every cross-rank MIN agreement sends (pure: no torch, no I/O).

A MIN all-reduce is only defined when every rank sends a tensor of the same size. The number of
values a rank wants to agree on (in-flight ops, prefetch signals, restore lengths) comes from its
own state, which is exactly what may have diverged; and a rank whose input is bad must still
send, or the others wait in the collective until it times out. So every rank sends

    [fault, len, -len, header_0 .. header_{H-1}, payload_0 .. payload_{C-1}]

of size ``3 + H + C`` whatever its state: ``H`` is fixed by the caller's code, ``C`` is
``capacity`` (payload padded with zeros, or cut there: ``rest`` is the part past it).

- ``fault``: ``NO_FAULT`` when this rank's input is fine, else ``rank * FAULT_CODES + code``:
  the MIN names the lowest faulty rank and its reason code on every rank.
- ``len, -len``: the payload length; the MIN gives (min, -max) over ranks, so every rank learns
  whether the lengths agree. Only then, and when they exceed ``C``, a second collective of the
  agreed size ``len - C`` carries the rest: every rank decides that from the same reduced
  vector, so no rank ever sends a tensor of another size than the others.
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
HEADER = 3          # fault, len, -len
# Payload slots in the fixed vector. A scheduler step agrees on a few in-flight copies (one or
# two per running request) plus 1 + 2 per request waiting on L3; 64 covers a busy step, and a
# 3 + H + 64 int64 vector (< 1 KiB) costs one small all-reduce like the 10-value one it replaces
# (latency-bound; see the README). A step with more rides a second, agreed-size collective.
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


def pack(header: Sequence, payload: Sequence, *, rank: int, code: int = 0,
         capacity: int = CAPACITY) -> Packed:
    """This rank's vector (never raises for bad values: they become the ``BAD_VALUE`` fault,
    with header and payload zeroed; the payload's length is kept). The vectors are ``array``
    buffers, so a tensor can wrap them without a copy (``torch.frombuffer``)."""
    n = len(payload)
    if not code:
        try:
            head, body = _int64s(header), _int64s(payload)
        except (TypeError, ValueError, OverflowError):
            code = BAD_VALUE
    if code:
        head, body = array("q", bytes(8 * len(header))), array("q", bytes(8 * n))
    vec = array("q", (fault_slot(rank, code), n, -n))
    vec += head
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

    @property
    def agreed(self) -> bool:
        """No fault and every rank's payload has the same length."""
        return self.fault is None and self.length[0] == self.length[1]

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
    start = HEADER + header_len
    head = vec[start:start + min(lo, capacity)] if lo == hi else []
    return Unpacked(fault, (lo, hi), vec[HEADER:start], head, capacity)
