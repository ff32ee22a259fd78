"""DualChunkSwap: how a prompt is cut over N prefill-context-parallel (PCP) ranks.

The prompt of ``length`` tokens is cut into ``2N`` chunks of ``ceil(length / 2N)`` positions (the
trailing chunks may be short, or empty for very short prompts). Rank ``r`` computes chunk ``r`` (an
early, cheap chunk) and chunk ``2N-1-r`` (a late, expensive one), so the causal attention work

    work(r) = sum over its query positions q of (q + 1)   (query-key pairs with k <= q)

is the same on every rank when ``2N`` divides the length and within one chunk's tail otherwise.
Pure math: no torch.distributed, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.errors import TopologyError


@dataclass(frozen=True)
class Chunk:
    """Positions [start, stop) of chunk ``index`` (stop - start may be 0)."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def causal_pairs(start: int, stop: int) -> int:
    """Query-key pairs with k <= q for queries q in [start, stop) (keys from position 0)."""
    if stop <= start:
        return 0
    return (stop * (stop + 1) - start * (start + 1)) // 2


@dataclass(frozen=True)
class DualChunkSwap:
    length: int  # prompt tokens
    pcp_size: int  # N ranks

    def __post_init__(self) -> None:
        for name in ("length", "pcp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TopologyError(f"{name} must be an int, got {value!r}")
        if self.length < 0:
            raise TopologyError(f"length must be >= 0, got {self.length}")
        if self.pcp_size < 1:
            raise TopologyError(f"pcp_size must be >= 1, got {self.pcp_size}")

    @property
    def num_chunks(self) -> int:
        return 2 * self.pcp_size

    @property
    def chunk_size(self) -> int:
        """Positions in a full chunk: ``ceil(length / 2N)``."""
        return -(-self.length // self.num_chunks)

    def chunk(self, index: int) -> Chunk:
        if not 0 <= index < self.num_chunks:
            raise TopologyError(f"chunk index {index} is outside [0, {self.num_chunks})")
        cs = self.chunk_size
        return Chunk(index, min(index * cs, self.length), min((index + 1) * cs, self.length))

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.pcp_size:
            raise TopologyError(f"rank {rank!r} is outside the PCP group [0, {self.pcp_size})")

    def rank_chunks(self, rank: int) -> tuple[Chunk, Chunk]:
        """(early chunk ``rank``, late chunk ``2N-1-rank``)."""
        self._check_rank(rank)
        return self.chunk(rank), self.chunk(self.num_chunks - 1 - rank)

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions rank ``rank`` computes, ascending: int64 [n_r]."""
        early, late = self.rank_chunks(rank)
        return torch.cat([torch.arange(early.start, early.stop, dtype=torch.int64),
                          torch.arange(late.start, late.stop, dtype=torch.int64)])

    def num_positions(self, rank: int) -> int:
        early, late = self.rank_chunks(rank)
        return early.size + late.size

    def owner_of(self, position: int) -> int:
        """The rank that computes global ``position``."""
        if not 0 <= position < self.length:
            raise TopologyError(f"position {position} is outside the prompt [0, {self.length})")
        idx = position // self.chunk_size
        return idx if idx < self.pcp_size else self.num_chunks - 1 - idx

    def causal_work(self, rank: int) -> int:
        """Query-key pairs (k <= q) rank ``rank`` attends over in a causal prefill."""
        return sum(causal_pairs(c.start, c.stop) for c in self.rank_chunks(rank))

    def work_per_rank(self) -> list[int]:
        return [self.causal_work(r) for r in range(self.pcp_size)]

    def imbalance(self) -> float:
        """max / mean - 1 of the per-rank causal work (0.0 is perfect balance)."""
        work = self.work_per_rank()
        mean = sum(work) / len(work)
        return 0.0 if mean == 0 else max(work) / mean - 1.0


def contiguous_work_per_rank(length: int, pcp_size: int) -> list[int]:
    """Causal work per rank for the naive split into N contiguous chunks (the baseline)."""
    if pcp_size < 1 or length < 0:
        raise TopologyError(f"need length >= 0 and pcp_size >= 1, got {length}, {pcp_size}")
    cs = -(-length // pcp_size)
    return [causal_pairs(min(r * cs, length), min((r + 1) * cs, length)) for r in range(pcp_size)]
