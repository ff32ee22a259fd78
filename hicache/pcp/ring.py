"""Context-parallel attention over latent rows spread over the ranks of a group.

Each rank holds the queries and the latent KV rows of its own positions (any positions; PCP uses
DualChunkSwap chunks). Two ways to attend over everyone's keys, both exact:

- ``full_kv``: one all-gather of the (padded) latent rows per layer; padding is stripped with the
  true per-rank lengths before attention, so it never reaches a score.
- ``ring``: each rank keeps its rows and passes blocks around the ring with point-to-point
  send/recv (N-1 steps, the next block in flight while the current one is attended); partial
  outputs are merged with ``merge_attn_states`` (the exact LSE merge decode uses).

In both, a (query run, key run) pair that lies wholly in the causal future is skipped, so each
rank does only its causal work. Positions are global; causality is ``kv_pos <= q_pos``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from hicache.at_exit import lend
from hicache.errors import UsageError
from hicache import distributed as hdist
from hicache.engine.attention import attend_latent
from hicache.kernels.merge import merge_attn_states

PCP_MODES = ("full_kv", "ring")


@dataclass(frozen=True)
class Run:
    """Rows [lo, hi) of a rank's block hold consecutive positions [first, last]."""

    lo: int
    hi: int
    first: int
    last: int


def contiguous_runs(positions: torch.Tensor, chunk: int = 0) -> tuple[Run, ...]:
    """Split positions [n] (any order) into maximal runs of consecutive positions; with
    ``chunk`` > 0 a run also ends at every multiple of ``chunk`` (PCP chunk boundaries), so
    causal skipping and balance work per chunk."""
    pos = torch.as_tensor(positions, dtype=torch.int64).cpu()
    n = pos.numel()
    if n == 0:
        return ()
    cut = pos[1:] != pos[:-1] + 1
    if chunk > 0:
        cut |= pos[1:] % chunk == 0
    breaks = (torch.nonzero(cut).flatten() + 1).tolist()
    edges = [0, *breaks, n]
    return tuple(Run(a, b, int(pos[a]), int(pos[b - 1])) for a, b in zip(edges[:-1], edges[1:]))


@dataclass(frozen=True)
class KVPlacement:
    """Global positions of every rank's local rows, identical on every rank."""

    positions: tuple[torch.Tensor, ...]  # per rank: int64 [n_r], the order of its rows
    chunk: int = 0  # > 0: runs (and query runs) also break at multiples of ``chunk``
    runs: tuple[tuple[Run, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pos = tuple(torch.as_tensor(p, dtype=torch.int64).cpu() for p in self.positions)
        if not pos:
            raise UsageError("a KV placement needs at least one rank")
        allpos = torch.cat(pos)
        if allpos.numel() and (allpos.min() < 0 or allpos.unique().numel() != allpos.numel()):
            raise UsageError("placement positions must be >= 0 and held by one rank each")
        object.__setattr__(self, "positions", pos)
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise UsageError(f"chunk must be an int >= 0, got {self.chunk!r}")
        object.__setattr__(self, "runs", tuple(contiguous_runs(p, self.chunk) for p in pos))

    @property
    def world_size(self) -> int:
        return len(self.positions)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(p.numel() for p in self.positions)

    @property
    def capacity(self) -> int:
        """Rows of the largest rank block (the padded size of a gather)."""
        return max(self.lengths)

    @classmethod
    def from_partition(cls, partition) -> "KVPlacement":
        """From a ``DualChunkSwap`` (no communication)."""
        return cls(tuple(partition.positions(r) for r in range(partition.pcp_size)),
                   partition.chunk_size)

    @classmethod
    def gather(cls, local_positions: torch.Tensor, group=None) -> "KVPlacement":
        """Every rank passes its own positions; one all_gather_object."""
        world = dist.get_world_size(group)
        got = hdist.all_gather_object(torch.as_tensor(local_positions, dtype=torch.int64).cpu(),
                                      world, group=group)
        return cls(tuple(got))


def _global_rank(group, rank: int) -> int:
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


class ContextParallelAttention:
    """Attention of this rank's queries over all ranks' latent rows, built once per prefill.

    ``q_pos`` int64 [T] are this rank's query positions (fixed for every layer); per layer call
    ``attn(q_lat [T,H,R], q_pe [T,H,Dr], kv_local [n_rank, R+Dr], scale, kv_lora_rank)``
    -> (o [T,H,R] fp32, lse [T,H] natural log).
    """

    def __init__(self, placement: KVPlacement, rank: int, q_pos: torch.Tensor, mode: str = "ring",
                 group=None) -> None:
        if mode not in PCP_MODES:
            raise UsageError(f"mode must be one of {PCP_MODES}, got {mode!r}")
        if not 0 <= rank < placement.world_size:
            raise UsageError(
                f"rank {rank} is outside the placement's {placement.world_size} ranks")
        self.placement = placement
        self.rank = rank
        self.mode = mode
        self.group = group
        self.q_pos = torch.as_tensor(q_pos, dtype=torch.int64).cpu()
        self.q_runs = contiguous_runs(self.q_pos, placement.chunk)
        self.pairs_computed = 0  # query-key pairs attended (before the causal mask), last call
        if mode == "full_kv":
            cap = placement.capacity
            valid = torch.cat([torch.arange(n, dtype=torch.int64) + s * cap
                               for s, n in enumerate(placement.lengths)])
            allpos = torch.cat(placement.positions)
            order = torch.argsort(allpos)
            self._gather_index = valid[order]  # padded gather buffer -> keys sorted by position
            self._sorted_pos = allpos[order]
            # keys a query run may see form a prefix of the sorted keys
            self._prefix = [int(torch.searchsorted(self._sorted_pos, run.last, right=True))
                            for run in self.q_runs]
        self._dev_cache: dict = {}

    # ---- helpers ---------------------------------------------------------------------------
    def _on(self, t: torch.Tensor, device) -> torch.Tensor:
        key = (id(t), str(device))
        if key not in self._dev_cache:
            self._dev_cache[key] = t.to(device)
        return self._dev_cache[key]

    def _check(self, q_lat, kv_local) -> None:
        if q_lat.shape[0] != self.q_pos.numel():
            raise UsageError(
                f"q_lat has {q_lat.shape[0]} queries but q_pos has {self.q_pos.numel()}")
        n = self.placement.lengths[self.rank]
        if kv_local.dim() != 2 or kv_local.shape[0] != n:
            raise UsageError(
                f"rank {self.rank} must hold [{n}, kv_dim] latent rows, "
                f"got {tuple(kv_local.shape)}")

    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_local: torch.Tensor,
                 scale: float, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(q_lat, kv_local)
        if self.mode == "full_kv":
            return self._full_kv(q_lat, q_pe, kv_local, scale, kv_lora_rank)
        return self._ring(q_lat, q_pe, kv_local, scale, kv_lora_rank)

    # ---- full KV -----------------------------------------------------------------------------
    def _full_kv(self, q_lat, q_pe, kv_local, scale, kv_lora_rank):
        pl = self.placement
        cap, dim = pl.capacity, kv_local.shape[1]
        dev = kv_local.device
        send = kv_local.new_zeros(cap, dim)
        send[: kv_local.shape[0]] = kv_local
        gathered = kv_local.new_empty(pl.world_size * cap, dim)  # [N*cap, D]
        if pl.world_size == 1:
            gathered.copy_(send)
        else:
            hdist.all_gather_into_tensor(gathered, send, group=self.group)
        keys = gathered.index_select(0, self._on(self._gather_index, dev))  # sorted by position
        key_pos = self._on(self._sorted_pos, dev)
        q_pos = self._on(self.q_pos, dev)
        t, h, r = q_lat.shape
        o = torch.zeros(t, h, r, dtype=torch.float32, device=dev)
        lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=dev)
        self.pairs_computed = 0
        for run, k in zip(self.q_runs, self._prefix):
            if k == 0:
                continue
            sl = slice(run.lo, run.hi)
            o[sl], lse[sl] = attend_latent(q_lat[sl], q_pe[sl], keys[:k], q_pos[sl], key_pos[:k],
                                           scale, kv_lora_rank)
            self.pairs_computed += (run.hi - run.lo) * k
        return o, lse

    # ---- ring --------------------------------------------------------------------------------
    def _ring(self, q_lat, q_pe, kv_local, scale, kv_lora_rank):
        pl = self.placement
        world, me = pl.world_size, self.rank
        dev = kv_local.device
        t, h, r = q_lat.shape
        q_pos = self._on(self.q_pos, dev)
        cap, dim = pl.capacity, kv_local.shape[1]
        bufs = [kv_local.new_empty(cap, dim), kv_local.new_empty(cap, dim)]
        bufs[0][: kv_local.shape[0]] = kv_local
        nxt = _global_rank(self.group, (me + 1) % world)
        prv = _global_rank(self.group, (me - 1) % world)
        parts: list[list] = [[] for _ in self.q_runs]  # per query run: (o, lse) per block
        self.pairs_computed = 0
        for step in range(world):
            src = (me - step) % world  # the rank whose block we hold now
            cur = bufs[step % 2]
            reqs = []
            if step < world - 1:  # pass the current block on while attending over it
                incoming = (me - step - 1) % world
                n_out, n_in = pl.lengths[src], pl.lengths[incoming]
                ops = []
                if n_out:
                    ops.append(dist.P2POp(dist.isend, lend(cur[:n_out]), nxt, self.group))
                if n_in:
                    ops.append(dist.P2POp(dist.irecv, lend(bufs[(step + 1) % 2][:n_in]), prv,
                                          self.group))
                if ops:
                    hdist.CollectiveCounter.bump()
                    reqs = dist.batch_isend_irecv(ops)
            self._attend_block(q_lat, q_pe, q_pos, cur, src, parts, scale, kv_lora_rank)
            for req in reqs:
                req.wait()
        o = torch.zeros(t, h, r, dtype=torch.float32, device=dev)
        lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=dev)
        for run, got in zip(self.q_runs, parts):  # one exact N-way LSE merge per query run
            if len(got) == 1:
                o[run.lo:run.hi], lse[run.lo:run.hi] = got[0]
            elif got:
                o[run.lo:run.hi], lse[run.lo:run.hi] = merge_attn_states(
                    [p[0] for p in got], [p[1] for p in got])
        return o, lse

    def _attend_block(self, q_lat, q_pe, q_pos, block, src, parts, scale, kv_lora_rank) -> None:
        pos = self._on(self.placement.positions[src], block.device)
        kv_runs = self.placement.runs[src]
        for i, run in enumerate(self.q_runs):
            visible = [kr for kr in kv_runs if kr.first <= run.last]  # drop the causal future
            if not visible:
                continue
            if len(visible) == len(kv_runs):
                n = self.placement.lengths[src]
                keys, key_pos = block[:n], pos
            else:
                keys = torch.cat([block[kr.lo:kr.hi] for kr in visible])
                key_pos = torch.cat([pos[kr.lo:kr.hi] for kr in visible])
            sl = slice(run.lo, run.hi)
            parts[i].append(attend_latent(q_lat[sl], q_pe[sl], keys, q_pos[sl], key_pos, scale,
                                          kv_lora_rank))
            self.pairs_computed += (run.hi - run.lo) * keys.shape[0]


__all__: Sequence[str] = ["PCP_MODES", "Run", "contiguous_runs", "KVPlacement",
                          "ContextParallelAttention"]
