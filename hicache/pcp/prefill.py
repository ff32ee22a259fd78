"""PCP prefill: one prompt's prefill spread over the N ranks of a process group.

Run inside a launched process group (every rank of ``group`` calls it with the same tokens).
Rank r computes its DualChunkSwap chunks (r and 2N-1-r) through every layer; attention over the
other ranks' keys is ``full_kv`` (one all-gather of latent rows per layer) or ``ring``
(point-to-point block passing, LSE merge). See ``hicache.pcp.ring``.

The latent rows it produces go into the DCP-striped decode pools with ``write_pcp_kv_to_pool``:
KV shards are set by DCP alone (slot v lives on rank ``layout.owner(v)``), whatever the PCP size.

Exact signatures (for the ``--pcp N`` wiring of ``hicache decode``):

    pcp_prefill(model: MLAModel, tokens: Sequence[int] | Tensor, mode: str = "ring",
                group=None) -> PCPPrefillResult
        PCPPrefillResult.positions   int64 [n_r]   global positions this rank computed
        PCPPrefillResult.logits      fp32 [n_r, V] their logits
        PCPPrefillResult.last_logits fp32 [V]      logits of the prompt's last token, on EVERY rank
        PCPPrefillResult.kv_rows     tuple of L tensors [n_r, kv_dim] (model dtype), per layer

    slots_for_pages(pages: Sequence[int] | Tensor, length: int, page_tokens: int)
        -> int64 [length]: the virtual slot of every prompt position from a widened page table

    write_pcp_kv_to_pool(rows_by_layer, positions, slots, kv, group=None, layout=None) -> int
        Every rank of ``group`` calls it (collective: one small check all-reduce, one small
        all-gather of counts and one all_to_all). ``rows_by_layer``/``positions`` are this rank's prefill output (may be
        empty); ``slots`` int64 [L] the virtual slot of each global position (same on every
        rank); ``kv`` this rank's KV port (``HiCache.kv`` or a ``DeviceKVPool``; None on a rank
        outside the DCP group, i.e. group rank >= dcp size; then pass ``layout`` of any DCP
        rank for routing). Returns the rows this rank stored. DCP rank d is group rank d.

    pcp_prefill_request(model, kv, state, prompt, mode="ring", group=None, layout=None,
                        pcp_group=None) -> last_logits fp32 [V]
        The one call for ``--pcp N``: prefill a fresh engine ``RequestState`` (page table
        reserved) and leave ``state.length == len(prompt)``; then decode with
        ``DCPRunner.extend(state, [next_token])`` as usual. PCP N == DCP C: call it on the C
        ranks with the defaults. N != C: launch max(N, C) ranks, ``pcp_group =
        dist.new_group(range(N))`` on every rank, a KV port on ranks < C (``layout`` elsewhere),
        and give the DCP runner ``group=dist.new_group(range(C))`` when C < max(N, C).

Failures are agreed: before its first data collective, ``pcp_prefill`` and
``write_pcp_kv_to_pool`` each take one small fixed-size all-reduce (``hicache.outcome.checkpoint``)
and ``pcp_prefill_request`` two (its own before the prefill, the write's before the exchange).
Each carries this rank's bad input as a fault code (a bad mode, an empty prompt, a token id
outside the vocabulary anywhere in the prompt, rows that do not fit, a page the pool refuses) and
the values every rank must share as min/max pairs: prompt length, mode and a digest of the tokens
(the prefills); slot count, row width, DCP size, page tokens, interleave and a digest of the
slots (the write; the request's own check has the same layout and slots digest). A rank whose
input is bad raises its error, the others ``PeerError`` naming it, and ranks whose prompts, page
tables or layouts differ all raise ``DivergenceError``, at the same point, instead of a rank
waiting in a collective the others never join. (With one rank nothing is communicated and the
slots are not hashed.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hicache.errors import DivergenceError, UsageError
from hicache import distributed as hdist
from hicache import minvec, outcome
from hicache.layout import DCPLayout, slot_of
from hicache.pcp.partition import DualChunkSwap
from hicache.pcp.ring import PCP_MODES, ContextParallelAttention, KVPlacement


@dataclass(frozen=True)
class PCPPrefillResult:
    positions: torch.Tensor  # int64 [n_r]
    logits: torch.Tensor  # fp32 [n_r, vocab]
    last_logits: torch.Tensor  # fp32 [vocab], identical on every rank
    kv_rows: tuple[torch.Tensor, ...]  # per layer [n_r, kv_dim]
    pairs_computed: int  # query-key pairs this rank scored, summed over layers
    partition: DualChunkSwap


def _group_info(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _prompt(tokens, mode: str, vocab_size: int) -> torch.Tensor:
    """The prompt as int64 [n] on the CPU; raises UsageError for what cannot be prefilled. The
    whole prompt's ids are range-checked here: each rank embeds only its own positions, so a
    bad id found there would stop one rank while the others wait in the ring."""
    if mode not in PCP_MODES:
        raise UsageError(f"mode must be one of {PCP_MODES}, got {mode!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).cpu()
    if tokens.numel() == 0:
        raise UsageError("cannot prefill an empty prompt")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise UsageError(f"token ids must be in [0, {vocab_size}); got range [{lo}, {hi}]")
    return tokens


def _pairs(*values: int) -> list[int]:
    return [v for x in values for v in (x, -x)]


def _spread(h: Sequence[int], i: int) -> tuple[int, int]:
    """(min, max) over ranks of value ``i`` of a ``_pairs`` header reduced by MIN."""
    return h[2 * i], -h[2 * i + 1]


def _digest(values: torch.Tensor) -> int:
    """A 60-bit hash of int64 [n] CPU values (a prompt's tokens, a request's slots)."""
    raw = hashlib.blake2b(values.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 4


NO_ROUTE = (0, 0, 0, 0)
# the larger check header (_agree_prompt: 3 values + the route, as pairs) fits the fixed one
assert 2 * (3 + len(NO_ROUTE)) <= minvec.HEADER_SLOTS


def _route(layout: DCPLayout, slots: torch.Tensor, world: int) -> tuple[int, int, int, int]:
    """What every rank must route rows by: DCP size, page tokens, interleave and a digest of
    the slots (0 alone: with one rank nothing is compared, so nothing is hashed)."""
    return (layout.dcp_size, layout.page_tokens, layout.interleave,
            _digest(slots) if world > 1 else 0)


def _check_route(where: str, h: Sequence[int], first: int, mine: tuple[int, ...]) -> None:
    """DivergenceError unless the ranks' ``_route`` values (from value ``first`` of ``h``) agree."""
    spreads = [_spread(h, first + i) for i in range(4)]
    if any(lo != hi for lo, hi in spreads[:3]):
        size, tokens, inter = (f"{lo}" if lo == hi else f"{lo} to {hi}" for lo, hi in spreads[:3])
        raise DivergenceError(
            f"{where}: the ranks' DCP layouts differ (DCP size {size}, {tokens} tokens a page, "
            f"interleave {inter}; this rank {mine[0]}, {mine[1]}, {mine[2]}); every rank must "
            "route by the same layout")
    lo, hi = spreads[3]
    if lo != hi:
        raise DivergenceError(f"{where}: the ranks' page tables differ (same prompt, other "
                              "slots); every rank must write through the same page table")


def _agree_prompt(where: str, error: BaseException | None, tokens, mode: str, group,
                  route: tuple[int, ...] = ()) -> None:
    """Every rank of ``group``: one fixed-size check before the first data collective. Raises on
    every rank when one failed (``error``) or when the ranks' prompts (length, tokens), modes
    or ``route`` values (``_route``; the same count on every rank) differ."""
    n = int(tokens.numel()) if error is None else 0
    vals = (n, PCP_MODES.index(mode), _digest(tokens), *route) if error is None \
        else (0,) * (3 + len(route))
    h = outcome.checkpoint(where, error, group, header=_pairs(*vals), detail=True,
                           kind=minvec.PCP)
    lo, hi = _spread(h, 0)
    if lo != hi:
        raise DivergenceError(f"{where}: the ranks' prompts have {lo} to {hi} tokens (this rank "
                              f"{n}); every rank must prefill the same prompt")
    lo, hi = _spread(h, 1)
    if lo != hi:
        raise DivergenceError(f"{where}: the ranks use different modes ({PCP_MODES[lo]!r}, "
                              f"{PCP_MODES[hi]!r}; this rank {mode!r})")
    if h[4] != -h[5]:
        raise DivergenceError(f"{where}: the ranks' prompts have the same length ({n}) but "
                              "different tokens; every rank must prefill the same prompt")
    if route:
        _check_route(where, h, 3, route)


@torch.no_grad()
def pcp_prefill(model, tokens, mode: str = "ring", group=None) -> PCPPrefillResult:
    """Prefill ``tokens`` with this rank's DualChunkSwap chunks (see module docstring). The
    prompt and mode are checked on every rank first (one small all-reduce): bad input or ranks
    with different prompts raise on every rank before any data moves."""
    error = None
    try:
        prompt = _prompt(tokens, mode, model.cfg.vocab_size)
    except Exception as e:  # agreed, then raised here
        error, prompt = e, torch.empty(0, dtype=torch.int64)
    _agree_prompt("PCP prefill", error, prompt, mode, group)
    return _prefill(model, prompt, mode, group)


@torch.no_grad()
def _prefill(model, tokens: torch.Tensor, mode: str, group) -> PCPPrefillResult:
    """``pcp_prefill`` once every rank agreed on ``tokens`` (int64 [n], CPU) and ``mode``."""
    rank, world = _group_info(group)
    part = DualChunkSwap(int(tokens.numel()), world)
    placement = KVPlacement.from_partition(part)
    positions = part.positions(rank)
    attn = ContextParallelAttention(placement, rank, positions, mode, group)
    cfg = model.cfg
    dev = model.embed_tokens.device
    pos_dev = positions.to(dev)
    h = model.embed(tokens[positions])  # [n_r, hidden]
    rows_by_layer = []
    pairs = 0
    for layer in model.layers:
        rows = layer.kv_rows(h, pos_dev)  # [n_r, R + Dr]
        q_lat, q_pe = layer.query(h, pos_dev)  # [n_r, H, R], [n_r, H, Dr]
        o, _ = attn(q_lat, q_pe, rows, cfg.softmax_scale, cfg.kv_lora_rank)
        pairs += attn.pairs_computed
        if h.shape[0]:  # a rank with no positions (prompt shorter than 2N) only relays
            h = layer.output(o, h)
        rows_by_layer.append(rows)
    logits = model.logits(h)  # [n_r, V]
    last_owner = part.owner_of(part.length - 1)
    last = torch.zeros(logits.shape[1], dtype=torch.float32, device=logits.device)
    if rank == last_owner:
        last.copy_(logits[-1])  # the late chunk ends the rank's positions
    if world > 1:
        hdist.all_reduce(last, group=group)  # others add exact zeros
    return PCPPrefillResult(positions, logits, last, tuple(rows_by_layer), pairs, part)


def slots_for_pages(pages, length: int, page_tokens: int) -> torch.Tensor:
    """Virtual slot of positions [0, length) when widened page i of the request is ``pages[i]``."""
    pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    need = -(-length // page_tokens)
    if pages.numel() < need:
        raise UsageError(f"{length} tokens need {need} pages of {page_tokens} slots, "
                         f"got {pages.numel()}")
    return slot_of(pages, torch.arange(length, dtype=torch.int64), page_tokens)


def write_pcp_kv_to_pool(rows_by_layer: Sequence[torch.Tensor], positions: torch.Tensor,
                         slots: torch.Tensor, kv, group=None,
                         layout: Optional[DCPLayout] = None) -> int:
    """Route each prefill row to the DCP rank owning its slot and store it (see module doc)."""
    rank, world = _group_info(group)
    error, vals = None, (0, 0) + NO_ROUTE
    try:  # this rank's checks and packing; agreed before any data moves
        layout = _routing_layout(kv, layout, rank, world)
        positions, slots = _check_rows(rows_by_layer, positions, slots, kv)
        if kv is not None:  # a refusal at the store would stop this rank alone
            kv.check_pages(np.unique(slots.numpy() // layout.page_tokens))
        my_slots = slots[positions]
        packed, counts = _pack_by_owner(rows_by_layer, my_slots, layout.owner(my_slots), world)
        vals = (slots.numel(), packed.shape[1]) + _route(layout, slots, world)
    except Exception as e:
        error = e
    where = "PCP KV write"
    h = outcome.checkpoint(where, error, group, header=_pairs(*vals), detail=True,
                           kind=minvec.PCP)
    lo, hi = _spread(h, 0)
    if lo != hi:
        raise DivergenceError(f"{where}: the ranks pass {lo} to {hi} slots (this rank "
                              f"{vals[0]}); every rank must pass the slots of the whole prompt")
    lo, hi = _spread(h, 1)
    if lo != hi:
        raise DivergenceError(f"{where}: the ranks' packed rows are {lo} to {hi} bytes (slot and "
                              f"every layer; this rank {vals[1]}); every rank must write rows of "
                              "the same model")
    _check_route(where, h, 2, vals[2:])
    got = _exchange(packed, counts, rank, world, group)  # [m, 8 + L * D * elt]
    if kv is None:
        if got.shape[0]:
            raise UsageError(f"rank {rank} outside the DCP group received rows")
        return 0
    return _store(kv, got, rows_by_layer[0].dtype)


def _routing_layout(kv, layout: Optional[DCPLayout], rank: int, world: int) -> DCPLayout:
    """The DCP layout rows are routed by; checks this rank's port is the one it should hold."""
    layout = layout or (kv.layout if kv is not None else None)
    if layout is None:
        raise UsageError("a rank without a pool must pass the DCP layout for routing")
    if layout.dcp_size > world:
        raise UsageError(f"DCP size {layout.dcp_size} exceeds the group's {world} ranks")
    if rank < layout.dcp_size and kv is None:
        raise UsageError(f"group rank {rank} is DCP rank {rank} and needs its pool")
    if kv is not None and kv.layout.rank != rank:
        raise UsageError(f"pool of DCP rank {kv.layout.rank} given on group rank {rank}")
    return layout


def _check_rows(rows_by_layer, positions, slots, kv) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [n] and slots int64 [L] on the CPU, once the rows fit them."""
    positions = torch.as_tensor(positions, dtype=torch.int64).cpu().reshape(-1)
    slots = torch.as_tensor(slots, dtype=torch.int64).cpu().reshape(-1)
    if positions.numel() and int(positions.max()) >= slots.numel():
        raise UsageError(
            f"position {int(positions.max())} has no slot ({slots.numel()} given)")
    n = positions.numel()
    if any(r.shape[0] != n for r in rows_by_layer):
        raise UsageError(f"every layer needs {n} rows (one per position), got "
                         f"{[tuple(r.shape) for r in rows_by_layer]}")
    if kv is not None and len(rows_by_layer) != kv.num_layers:
        raise UsageError(f"{len(rows_by_layer)} layers of rows for a "
                         f"{kv.num_layers}-layer pool")
    if not rows_by_layer:
        raise UsageError("no layers of rows to write")
    return positions, slots


def _pack_by_owner(rows_by_layer, my_slots: torch.Tensor, owner: torch.Tensor,
                   world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row with its slot as raw bytes [n, 8 + L * D * elt], grouped by owning rank, and
    how many go to each rank (int64 [world], CPU)."""
    n = my_slots.numel()
    stacked = torch.stack(list(rows_by_layer), 1)  # [n, L, D]
    dev = stacked.device
    row_bytes = stacked.reshape(n, -1).view(torch.uint8) if n else torch.empty(
        0, stacked.shape[1] * stacked.shape[2] * stacked.element_size(), dtype=torch.uint8,
        device=dev)
    slot_bytes = my_slots.to(dev).view(torch.uint8).reshape(n, 8)
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=world)[:world]
    return torch.cat([slot_bytes, row_bytes], 1)[order.to(dev)], counts


def _exchange(packed: torch.Tensor, counts: torch.Tensor, rank: int, world: int,
              group) -> torch.Tensor:
    """One all-gather of the counts, one all_to_all of the rows padded to the largest count:
    the rows every rank sent here, in rank order [m, width]."""
    dev, width = packed.device, packed.shape[1]
    if world > 1:
        all_counts = torch.empty(world * world, dtype=torch.int64, device=dev)
        hdist.all_gather_into_tensor(all_counts, counts.to(dev), group=group)
        matrix = all_counts.cpu().view(world, world)  # [src, dst]
    else:
        matrix = counts.view(1, 1)
    cap = int(matrix.max())
    if cap == 0:
        return packed[:0]
    send = torch.zeros(world, cap, width, dtype=torch.uint8, device=dev)
    offs = (torch.cumsum(counts, 0) - counts).tolist()
    for d, c in enumerate(counts.tolist()):
        send[d, :c] = packed[offs[d]: offs[d] + c]
    if world > 1:
        recv = torch.empty_like(send)
        hdist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
    else:
        recv = send
    return torch.cat([recv[s, : int(matrix[s, rank])] for s in range(world)])


def _store(kv, got: torch.Tensor, dtype: torch.dtype) -> int:
    """Unpack received rows [m, 8 + L * D * elt] and write every layer through the port (one
    write plan for all layers); the rows stored."""
    m = got.shape[0]
    if m == 0:
        return 0
    got_slots = got[:, :8].contiguous().view(torch.int64).reshape(m).cpu()
    got_rows = got[:, 8:].contiguous().view(dtype).reshape(m, kv.num_layers, -1)
    where = kv.plan_write(got_slots)
    stored = 0
    for layer in range(kv.num_layers):
        stored = kv.write(layer, where, got_rows[:, layer].contiguous())
    return stored


def _member(pcp_group) -> bool:
    if pcp_group is None:
        return True
    return pcp_group != dist.GroupMember.NON_GROUP_MEMBER


def pcp_prefill_request(model, kv, state, prompt, mode: str = "ring", group=None,
                        layout: Optional[DCPLayout] = None, pcp_group=None) -> torch.Tensor:
    """PCP-prefill ``prompt`` for a fresh request and store its KV in the DCP pools.

    Every rank of ``group`` (default: the world; DCP rank d = group rank d) calls it.
    ``pcp_group`` (default: ``group``) is the set of ranks that compute the prefill, e.g.
    ``dist.new_group(range(N))`` when PCP N differs from the DCP size; ranks outside it (they
    got ``GroupMember.NON_GROUP_MEMBER`` from ``new_group``) compute nothing and only receive
    their rows. ``state`` is the engine's ``RequestState`` (``page_table`` reserved for at least
    ``len(prompt)`` tokens, ``length == 0``); on return ``state.length == len(prompt)``. Returns
    the logits [V] of the last prompt token, the same on every rank of ``group``.
    """
    error, tokens, route = None, torch.empty(0, dtype=torch.int64), NO_ROUTE
    try:  # this rank's checks, agreed by every rank of ``group`` before any collective
        if state.length != 0:
            raise UsageError(f"PCP prefill needs a fresh request, this one holds "
                             f"{state.length} positions")
        rank, world = _group_info(group)
        layout = _routing_layout(kv, layout, rank, world)
        tokens = _prompt(prompt, mode, model.cfg.vocab_size)
        length = int(tokens.numel())
        if kv is not None:  # (ranks receive different rows: a refusal at the write would
            # stop some ranks and not others)
            kv.check_pages(np.asarray(state.page_table[:-(-length // layout.page_tokens)],
                                      dtype=np.int64))
        slots = slots_for_pages(state.page_table, length, layout.page_tokens)
        route = _route(layout, slots, world)
    except Exception as e:
        error = e
    _agree_prompt("PCP prefill", error, tokens, mode, group, route=route)
    cfg = model.cfg
    member = _member(pcp_group)
    if member:  # the PCP group is within ``group``: its ranks agreed above
        res = _prefill(model, tokens, mode, pcp_group if pcp_group is not None else group)
        rows, positions, last = res.kv_rows, res.positions, res.last_logits
        lead = (dist.get_rank(pcp_group) if pcp_group is not None and dist.is_initialized()
                else 0) == 0
    else:
        dev = model.embed_tokens.device
        rows = tuple(torch.empty(0, cfg.kv_dim, dtype=cfg.torch_dtype, device=dev)
                     for _ in range(cfg.num_layers))
        positions = torch.empty(0, dtype=torch.int64)
        last = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)
        lead = False
    write_pcp_kv_to_pool(rows, positions, slots, kv, group=group, layout=layout)
    if pcp_group is not None and dist.is_initialized():
        # only the PCP group's rank 0 contributes; everyone else adds exact zeros
        last = last if lead else torch.zeros_like(last)
        hdist.all_reduce(last, group=group)
    state.length = length
    return last


__all__ = ["PCPPrefillResult", "pcp_prefill", "pcp_prefill_request", "slots_for_pages",
           "write_pcp_kv_to_pool"]
