"""DCP communication for one MLA layer: query gather and the exact merge backends.

The DCP group of ``c`` ranks doubles as the attention-TP group: rank r owns the head shard
``[r*H/c, (r+1)*H/c)``. Every rank attends with ALL H heads over its own KV shard, giving partial
(o_r [T, H, R], lse_r [T, H]); the merge hands each rank the exact result for its head shard:

- ``a2a``:   one packed all-to-all of (o | lse) per head shard, merged locally with
             ``merge_attn_states``.
- ``ag_rs``: all-gather of the LSEs, local rescale ``o_r * exp(lse_r - lse)``, then an fp32
             reduce-scatter of the rescaled outputs over the head shards.

Without replicated query weights each rank projects only its own heads and one all-gather
(``gather_query``) gives every rank the full query. ``c == 1`` needs none of this.
All collectives go through ``hicache.distributed`` (counted, torch-version detected).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.checks import check_int
from hicache.errors import TopologyError
from hicache import distributed as hd
from hicache.kernels.merge import merge_attn_states, merge_weights

DCP_BACKENDS = ("a2a", "ag_rs")


@dataclass(frozen=True)
class DCPComm:
    """One rank's view of its DCP group for the merge collectives."""

    size: int
    rank: int
    num_heads: int
    backend: str = "a2a"
    replicate_q: bool = True
    group: Any = None  # torch.distributed process group; None = the default group

    def __post_init__(self) -> None:
        if self.backend not in DCP_BACKENDS:
            raise TopologyError(f"unknown DCP backend {self.backend!r}; choose one of "
                                f"{DCP_BACKENDS}")
        check_int(self.size, "DCP size", error=TopologyError)
        if not 0 <= self.rank < self.size:
            raise TopologyError(f"rank {self.rank} is outside the DCP group [0, {self.size})")
        if self.num_heads % self.size:
            raise TopologyError(
                f"num_heads {self.num_heads} is not divisible by the DCP size {self.size}: "
                "every rank must own the same number of heads")

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def head_slice(self) -> slice:
        """This rank's head shard."""
        return slice(self.rank * self.heads_per_rank, (self.rank + 1) * self.heads_per_rank)

    def collectives_per_layer(self) -> int:
        """DCP collectives one layer's attention issues (the TP o_proj all-reduce not counted)."""
        if self.size == 1:
            return 0
        merge = 1 if self.backend == "a2a" else 2
        return merge + (0 if self.replicate_q else 1)

    # ---- query -------------------------------------------------------------------------------
    def gather_query(self, q_lat: torch.Tensor, q_pe: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shards q_lat [T, H/c, R], q_pe [T, H/c, Dr] -> full [T, H, R], [T, H, Dr]; one
        all-gather of the packed query."""
        t, hs, r = q_lat.shape
        packed = torch.cat([q_lat.float(), q_pe.float()], -1).contiguous()  # [T, Hs, R+Dr]
        # gloo wants the gathered tensor concatenated along dim 0: [c*T, Hs, R+Dr]
        out = torch.empty((self.size * t,) + tuple(packed.shape[1:]), dtype=packed.dtype,
                          device=packed.device)
        hd.all_gather_into_tensor(out, packed, group=self.group)
        full = out.view(self.size, t, hs, -1).permute(1, 0, 2, 3).reshape(t, self.size * hs, -1)
        return full[..., :r], full[..., r:]

    # ---- merge -------------------------------------------------------------------------------
    def merge(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial (o [T, H, R], lse [T, H]) -> merged head shard (o [T, H/c, R], lse [T, H/c])."""
        if self.size == 1:
            return o.float(), lse.float()
        if self.backend == "a2a":
            return self._merge_a2a(o, lse)
        return self._merge_ag_rs(o, lse)

    def _merge_a2a(self, o: torch.Tensor, lse: torch.Tensor):
        t, h, r = o.shape
        c, hs = self.size, self.heads_per_rank
        packed = torch.cat([o.float(), lse.float()[..., None]], -1)  # [T, H, R+1]
        send = packed.view(t, c, hs, r + 1).permute(1, 0, 2, 3).contiguous()  # [c, T, Hs, R+1]
        recv = torch.empty_like(send)  # recv[i] = rank i's partial for my heads
        hd.all_to_all_single(recv, send, group=self.group)
        return merge_attn_states(recv[..., :r], recv[..., r])

    def _merge_ag_rs(self, o: torch.Tensor, lse: torch.Tensor):
        t, h, r = o.shape
        c, hs = self.size, self.heads_per_rank
        lse_all = torch.empty((c * t, h), dtype=torch.float32, device=lse.device)
        hd.all_gather_into_tensor(lse_all, lse.float().contiguous(), group=self.group)
        w, lse_g = merge_weights(lse_all.view(c, t, h))  # w [c, T, H]
        mine = w[self.rank]
        scaled = torch.where(mine[..., None] > 0, o.float() * mine[..., None],
                             torch.zeros((), dtype=torch.float32, device=o.device))
        send = scaled.view(t, c, hs, r).permute(1, 0, 2, 3).reshape(c * t, hs, r)  # by dest
        out = torch.empty((t, hs, r), dtype=torch.float32, device=o.device)
        hd.reduce_scatter_tensor(out, send, group=self.group)
        return out, lse_g[:, self.head_slice]

    # ---- tensor parallel tail ----------------------------------------------------------------
    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The attention-TP all-reduce after the row-parallel o_proj (identity when c == 1)."""
        if self.size > 1:
            hd.all_reduce(x, group=self.group)
        return x
