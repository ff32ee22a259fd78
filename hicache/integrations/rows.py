"""Which bytes of one vLLM CPU offload row are distinct shards (pure; no engine import).

vLLM's CPU tier keeps one row per offloaded chunk with every worker's slot side by side:
``| W0 | W1 | ... | W(n-1) | pad |`` (``worker_bytes`` each), or one slot when vLLM itself keeps a
single copy (its replicated layout). Under MLA every TP rank holds the same latent KV, except that
DCP splits the tokens: worker ``w`` of pipeline stage ``w // tp`` holds DCP shard
``(w % tp) % dcp`` (vLLM's DCP groups are consecutive TP ranks), so a row holds ``tp / dcp``
identical copies of each of the ``pp * dcp`` distinct shards. Without MLA (or with prefill context
parallelism, whose token split this tier does not model) every worker's slot is its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int
from ..errors import L3Error


@dataclass(frozen=True)
class RowLayout:
    worker_bytes: int  # bytes of one worker slot
    shard_of: tuple[int, ...]  # shard index of each slot in the row, slot order
    num_shards: int

    @property
    def slots(self) -> int:
        return len(self.shard_of)

    @property
    def used_bytes(self) -> int:
        """Bytes of the row the slots cover (the rest is alignment padding)."""
        return self.slots * self.worker_bytes

    def slots_of(self, shard: int) -> tuple[int, ...]:
        """Slots holding ``shard``, in slot order (the first is the one stored)."""
        return tuple(i for i, s in enumerate(self.shard_of) if s == shard)

    def span(self, slot: int) -> slice:
        """Byte range of ``slot`` within the row."""
        return slice(slot * self.worker_bytes, (slot + 1) * self.worker_bytes)


def row_layout(*, world_size: int, tp: int, pp: int, pcp: int, dcp: int, mla: bool,
               single_copy: bool, worker_bytes: int) -> RowLayout:
    """The distinct shards of a row for these parallel sizes (see the module docstring)."""
    for name, v in (("world_size", world_size), ("tp", tp), ("pp", pp), ("pcp", pcp),
                    ("dcp", dcp), ("worker_bytes", worker_bytes)):
        check_int(v, name, error=L3Error)
    if world_size != tp * pp * pcp:
        raise L3Error(f"world_size {world_size} != tp*pp*pcp = {tp}*{pp}*{pcp}: the offload row "
                      "of one engine holds exactly its TP x PP x PCP workers")
    if tp % dcp:
        raise L3Error(f"tp {tp} is not a multiple of dcp {dcp}")
    if single_copy:
        if dcp > 1 or pp > 1 or pcp > 1:
            raise L3Error("a single-copy (replicated) row cannot hold DCP/PP/PCP shards "
                          f"(dcp={dcp}, pp={pp}, pcp={pcp})")
        return RowLayout(worker_bytes, (0,), 1)
    if not mla or pcp > 1:
        return RowLayout(worker_bytes, tuple(range(world_size)), world_size)
    shard_of = tuple((w // tp) * dcp + (w % tp) % dcp for w in range(world_size))
    return RowLayout(worker_bytes, shard_of, pp * dcp)
