"""The fleet model: what a shared L3 store costs and serves at fleet width. Pure math, no I/O.

A *node* is one serving instance: ``tp`` GPU ranks, each a process with its own L3 client;
``dcp`` of them hold distinct shards of every page (DCP), the other ``tp / dcp`` copies are TP
replicas of those shards. Per request of ``prompt_tokens`` with a fraction ``hit_ratio`` found in
L3:

- every rank reads its shard of the hit tokens: ``hit * prompt * bytes_per_token_per_rank``
  (``topology.kv_bytes_per_token``), all ranks in parallel, so the load takes that over one
  process's store GB/s;
- the node writes each new page once per shard (one writer per shard among its TP replicas):
  ``(1 - hit) * prompt * bytes_per_token_per_rank * dcp``;
- prefill computes the miss tokens at the node's ``prefill_tokens_per_s``.

Loading overlaps compute, so time to first token is about ``max(load, compute)``: the store, not
the GPUs, bounds it once ``load > compute``, i.e. once the hit ratio passes
``h* = X / (1 + X)`` with ``X = process_GBps / (bytes_per_token_per_rank * prefill_tokens_per_s)``
(:func:`store_bound_hit_ratio`). Fleet-wide the store serves ``nodes * rate`` requests a second;
it saturates when the aggregate read + write bandwidth reaches the store's (``store_gbs``, e.g.
masters times one master's measured GB/s): :func:`max_nodes`.

A dead shard of ``shards`` (no replica) with the keys spread over shards (hicache's placement: no
hash tag) leaves a prefix of ``P`` pages its pages before the first one on the dead shard:
:func:`kept_spread`; co-locating a prefix's pages on one shard (a hash tag) keeps whole prefixes
with probability ``(N - 1) / N`` and loses the rest whole: :func:`kept_colocated`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import UsageError
from .topology import KVShape, kv_bytes_per_token, validate

GB = 1e9


@dataclass(frozen=True)
class FleetInputs:
    """One fleet: a model at a topology, its traffic and the measured store speeds."""

    shape: KVShape
    tp: int
    dcp: int
    prompt_tokens: int = 8192
    hit_ratio: float = 0.5
    requests_per_s: float = 1.0        # per node
    nodes: int = 1
    prefill_tokens_per_s: float = 20000.0  # per node (the whole TP group)
    process_gbs: float = 1.0           # one rank's store get GB/s (bench/l3.py --fleet 1)
    store_gbs: float = 0.0             # the store's aggregate GB/s (0: unbounded)

    def __post_init__(self) -> None:
        validate(self.tp, self.dcp, self.shape.num_kv_heads)
        if not 0.0 <= self.hit_ratio <= 1.0:
            raise UsageError(f"hit ratio must be in [0, 1], got {self.hit_ratio}")
        for name in ("prompt_tokens", "nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("requests_per_s", "prefill_tokens_per_s", "process_gbs"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.store_gbs < 0:
            raise UsageError(f"store_gbs must be >= 0, got {self.store_gbs!r}")


@dataclass(frozen=True)
class FleetPlan:
    """What :func:`plan` works out (bytes, seconds, GB/s)."""

    bytes_per_token_per_rank: float
    read_bytes_per_request_per_rank: float
    read_bytes_per_request_per_node: float
    write_bytes_per_request_per_node: float
    node_gbs: float            # one node's store traffic (read + write) at its request rate
    process_gbs_needed: float  # one rank's read GB/s at that rate
    aggregate_gbs: float       # the fleet's store traffic
    load_s: float              # one request's hit KV from L3 (ranks in parallel)
    compute_s: float           # its miss tokens' prefill
    ttft_s: float              # max(load, compute): loading overlaps compute
    store_bound: bool          # the store, not prefill, sets TTFT
    store_bound_hit_ratio: float  # h* above which the store bounds TTFT
    breakeven_process_gbs: float  # below this, recomputing a hit is faster than loading it
    max_nodes: float           # nodes the store serves before it saturates (inf: unbounded)

    def to_dict(self) -> dict:
        return asdict(self)


def load_seconds(nbytes: float, process_gbs: float) -> float:
    """One rank loading ``nbytes`` from the store at ``process_gbs``."""
    if not process_gbs > 0:
        raise UsageError(f"process_gbs must be > 0, got {process_gbs!r}")
    return nbytes / (process_gbs * GB)


def store_bound_hit_ratio(bytes_per_token_per_rank: float, prefill_tokens_per_s: float,
                          process_gbs: float) -> float:
    """The hit ratio above which loading the hit KV takes longer than prefilling the misses."""
    x = process_gbs * GB / (bytes_per_token_per_rank * prefill_tokens_per_s)
    return x / (1.0 + x)


def max_nodes(node_gbs: float, store_gbs: float) -> float:
    """Nodes the store carries at ``node_gbs`` each before its aggregate ``store_gbs`` is
    used up (``inf`` for an unbounded store or a node that moves nothing)."""
    if store_gbs <= 0 or node_gbs <= 0:
        return float("inf")
    return store_gbs / node_gbs


def plan(f: FleetInputs) -> FleetPlan:
    """The bytes, bandwidths and TTFT bound of fleet ``f``."""
    bpt = kv_bytes_per_token(f.shape, f.tp, f.dcp)
    hit_tokens = f.hit_ratio * f.prompt_tokens
    miss_tokens = f.prompt_tokens - hit_tokens
    read_rank = hit_tokens * bpt
    read_node = read_rank * f.tp
    write_node = miss_tokens * bpt * f.dcp
    node_gbs = f.requests_per_s * (read_node + write_node) / GB
    load_s = load_seconds(read_rank, f.process_gbs)
    compute_s = miss_tokens / f.prefill_tokens_per_s
    return FleetPlan(
        bytes_per_token_per_rank=bpt, read_bytes_per_request_per_rank=read_rank,
        read_bytes_per_request_per_node=read_node, write_bytes_per_request_per_node=write_node,
        node_gbs=node_gbs, process_gbs_needed=f.requests_per_s * read_rank / GB,
        aggregate_gbs=node_gbs * f.nodes, load_s=load_s, compute_s=compute_s,
        ttft_s=max(load_s, compute_s), store_bound=load_s > compute_s,
        store_bound_hit_ratio=store_bound_hit_ratio(bpt, f.prefill_tokens_per_s, f.process_gbs),
        breakeven_process_gbs=bpt * f.prefill_tokens_per_s / GB,
        max_nodes=max_nodes(node_gbs, f.store_gbs))


def shared_process_gbs(single_gbs: float, processes: int, store_gbs: float = 0.0) -> float:
    """One process's GB/s when ``processes`` share a store of aggregate ``store_gbs``: its own
    ``single_gbs`` until their sum reaches the store's, then an equal share."""
    if processes < 1:
        raise UsageError(f"processes must be >= 1, got {processes}")
    if store_gbs <= 0:
        return single_gbs
    return min(single_gbs, store_gbs / processes)


def kept_spread(pages: int, shards: int) -> float:
    """Expected pages a ``pages``-page prefix keeps with one of ``shards`` shards dead and each
    page on a shard of its own (uniform): the pages before the first on the dead shard."""
    _check_dead(pages, shards)
    q = (shards - 1) / shards
    return sum(q ** i for i in range(1, pages + 1))


def kept_colocated(pages: int, shards: int) -> float:
    """The same with a prefix's pages co-located on one shard: whole or nothing."""
    _check_dead(pages, shards)
    return pages * (shards - 1) / shards


def _check_dead(pages: int, shards: int) -> None:
    if pages < 0 or shards < 1:
        raise UsageError(f"pages must be >= 0 and shards >= 1, got {pages}, {shards}")
