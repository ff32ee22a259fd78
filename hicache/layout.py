"""DCP striping math: which rank owns a virtual slot and where it lives locally.

Pure functions and a frozen dataclass; no I/O, no threads, so every tier shares it.

A DCP group of ``c`` ranks shares ONE virtual token space. With interleave ``I`` (vLLM's
``VLLM_DCP_KV_INTERLEAVE_SIZE``, default 1), runs of ``I`` consecutive slots go to one rank:

    owner(v)    = (v // I) mod c
    physical(v) = (v // (I*c)) * I + v mod I

With I = 1 this is the source's ``v mod c`` and ``floor(v / c)``. A widened virtual page of
``P*c`` slots maps onto exactly one physical page of ``P`` rows on every rank (P % I == 0).
Its size ``P*c`` (the spec's "virtual page size") is ``page_tokens`` throughout hicache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from hicache.checks import check_int
from hicache.errors import TopologyError

IntOrTensor = Union[int, torch.Tensor]


@dataclass(frozen=True)
class DCPLayout:
    dcp_size: int
    rank: int
    page_size: int  # physical page size P (rows per page on each rank)
    interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("dcp_size", "page_size", "interleave"):
            check_int(getattr(self, name), name, error=TopologyError)
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.dcp_size:
            raise TopologyError(f"rank {self.rank!r} is outside the DCP group [0, {self.dcp_size})")
        if self.page_size % self.interleave != 0:
            raise TopologyError(
                f"page_size {self.page_size} is not a multiple of interleave {self.interleave}: "
                "a widened page would not map onto one physical page per rank"
            )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def page_tokens(self) -> int:
        """Slots (tokens) in one widened page: ``P * c``, the spec's "virtual page size" and the
        attention block size a serving engine reports to users. hicache calls it
        ``page_tokens`` everywhere (config, controller, L3 keys, engine)."""
        return self.page_size * self.dcp_size

    def virtual_capacity(self, physical_capacity: int) -> int:
        """Virtual slots addressable when every rank holds ``physical_capacity`` rows."""
        return physical_capacity * self.dcp_size

    # ---- per-slot maps -----------------------------------------------------------------------
    def owner(self, v: IntOrTensor) -> IntOrTensor:
        return (v // self.interleave) % self.dcp_size

    def physical(self, v: IntOrTensor) -> IntOrTensor:
        run = self.interleave * self.dcp_size
        return (v // run) * self.interleave + v % self.interleave

    def owns(self, v: IntOrTensor) -> IntOrTensor:
        return self.owner(v) == self.rank

    def virtual(self, row: IntOrTensor) -> IntOrTensor:
        """Inverse of ``physical`` for this rank: the virtual slot stored at local ``row``."""
        i = self.interleave
        return (row // i) * (i * self.dcp_size) + self.rank * i + row % i

    # ---- vectorised filters ------------------------------------------------------------------
    def local_rows(self, virtual_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots this rank owns (in input order) and their physical rows.

        ``virtual_slots``: int64 [n]. Returns (owned_slots [m], rows [m]), one vectorised pass.
        """
        slots = torch.as_tensor(virtual_slots, dtype=torch.int64)
        if self.dcp_size == 1:
            return slots, self.physical(slots)
        owned = slots[self.owner(slots) == self.rank]
        return owned, self.physical(owned)

    def owned_mask(self, virtual_slots: torch.Tensor) -> torch.Tensor:
        return self.owns(torch.as_tensor(virtual_slots, dtype=torch.int64))

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Physical rows of whole widened pages on this rank: [len(pages) * P], page-major."""
        pages = torch.as_tensor(pages, dtype=torch.int64)
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def slot_of(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Virtual slots of token ``positions`` of a request whose widened pages are
        ``page_table`` (see ``slot_of``); on the device of the two tensors."""
        return slot_of(page_table, positions, self.page_tokens)

    def owned_positions(self, start: int, end: int, device=None) -> torch.Tensor:
        """The token positions in [start, end) this rank holds, ascending: int64 [m] with
        m = local_length(end) - local_length(start). Ownership follows the position alone (a
        widened page is a whole number of ``I*c`` runs), so no mask and no page table is
        needed; built by ``arange`` on ``device`` (no host round trip)."""
        local = torch.arange(self.local_length(start), self.local_length(end),
                             dtype=torch.int64, device=device)
        return self.virtual(local)

    def owned_rows(self, pages: np.ndarray, start: int, end: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The host twin of ``owned_positions`` then ``slot_of`` then ``physical``: (positions,
        pool rows), both int64 [m], of the positions in [start, end) this rank holds, for a
        request whose widened pages from page ``start // page_tokens`` on are ``pages`` (int64,
        covering ``end``)."""
        w = self.page_tokens
        first = start // w
        pos = self.virtual(np.arange(self.local_length(start), self.local_length(end),
                                     dtype=np.int64))
        return pos, self.physical(pages[pos // w - first] * w + pos % w)

    def local_length(self, length: int) -> int:
        """How many of the first ``length`` positions this rank holds."""
        return local_length(length, self.dcp_size, self.rank, self.interleave)

    def for_rank(self, rank: int) -> "DCPLayout":
        return DCPLayout(self.dcp_size, rank, self.page_size, self.interleave)


def local_length(length: int, dcp_size: int, rank: int, interleave: int = 1) -> int:
    """Positions in [0, length) owned by ``rank``; exact at every length (c | L included)."""
    if length < 0:
        raise TopologyError(f"length must be >= 0, got {length}")
    cycle = interleave * dcp_size
    full, rem = divmod(length, cycle)
    return full * interleave + min(max(rem - rank * interleave, 0), interleave)


def slot_of(page_table: torch.Tensor, positions: torch.Tensor,
            page_tokens: int) -> torch.Tensor:
    """The one home of "the slot of token i": ``table[i // W] * W + i % W`` with W the widened
    page size (``P * c``). ``page_table`` int64 [pages], ``positions`` int64 [n] -> [n]; pure
    tensor arithmetic on whatever device both live on (an index past the table raises)."""
    w = page_tokens
    return page_table[positions // w] * w + positions % w


def common_page_tokens(page_sizes: Sequence[int], dcp_size: int) -> int | None:
    """The one block size to report for several KV groups, or None when they disagree."""
    distinct = set(page_sizes)
    if len(distinct) != 1:
        return None
    return distinct.pop() * dcp_size


# ---- prefill/decode relayout -----------------------------------------------------------------
@dataclass(frozen=True)
class RankShard:
    """What decode rank ``dst_rank`` receives: rows ``src_rows`` of source rank ``src_rank``
    land at its physical rows ``dst_rows`` (both int64 [n], n = rows it owns below token_count)."""

    dst_rank: int
    src_rank: int
    positions: torch.Tensor  # global token positions, int64 [n]
    src_rows: torch.Tensor
    dst_rows: torch.Tensor


@dataclass(frozen=True)
class RelayoutPlan:
    src_dcp: int
    dst_dcp: int
    token_count: int
    shards: tuple[RankShard, ...]


def plan_relayout(src_dcp: int, dst_dcp: int, token_count: int, interleave: int = 1) -> RelayoutPlan:
    """Plan moving a prefill's KV (DCP ``src_dcp``) into decode storage (DCP ``dst_dcp``).

    Same size: each rank keeps its own rows. DCP1 -> DCPc: each decode rank selects and packs the
    positions it owns from the dense source. Never a row at or past ``token_count``.
    """
    if token_count < 0:
        raise TopologyError(f"token_count must be >= 0, got {token_count}")
    if src_dcp < 1 or dst_dcp < 1:
        raise TopologyError(f"DCP sizes must be >= 1, got src {src_dcp} and dst {dst_dcp}")
    if src_dcp != dst_dcp and src_dcp != 1:
        raise TopologyError(
            f"cannot relayout KV from DCP {src_dcp} to DCP {dst_dcp}: only the same size or "
            "DCP1 -> DCPc is supported"
        )
    positions = torch.arange(token_count, dtype=torch.int64)
    shards = []
    for r in range(dst_dcp):
        dst = DCPLayout(dst_dcp, r, interleave, interleave)
        mine = positions[dst.owner(positions) == r]
        rows = dst.physical(mine)
        src_rows = rows if src_dcp == dst_dcp else mine
        shards.append(RankShard(r, r if src_dcp == dst_dcp else 0, mine, src_rows, rows))
    return RelayoutPlan(src_dcp, dst_dcp, token_count, tuple(shards))
