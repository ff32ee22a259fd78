"""The engine's one forward path: ``extend`` (prefill, chunked prefill, decode, multi-token verify).

A request is a ``RequestState``: its widened page table and ``length``, the number of leading
positions whose KV is already in the pool (written by an earlier extend, or restored from a cache
tier). ``runner.extend(state, new_tokens) -> logits [k, vocab]`` runs the k new tokens at
positions ``length .. length+k-1`` through every layer:

  1. latent rows of the new tokens -> ``kv_writer(layer, slots, rows)`` (default ``pool.write``,
     which keeps only the rows this rank owns; positions, not arrival order, decide ownership);
  2. the full query on every rank (replicated weights, or this rank's heads + one all-gather);
  3. attention over this rank's local shard of positions ``0 .. length+k-1`` with global
     positions (so k > 1 stays causal across shards);
  4. the DCP merge (a2a or ag_rs) to this rank's head shard, the row-parallel o_proj and its
     TP all-reduce, then the (replicated) MLP.

Then ``state.length += k``. Token i of a request lives at virtual slot
``page_table[i // (P*c)] * (P*c) + i % (P*c)``; the caller owns the pages (``reserve`` helps).
Every rank of the group must call ``extend`` with the same requests and tokens (the control path
is replicated). ``extend_batch`` runs several requests in one pass with one set of collectives
per layer (continuous batching). ``layer_hook(i)`` runs before layer i (e.g. a cache's
``wait_layer``); a custom ``kv_writer`` must still land the rows in ``pool`` (attention reads it).

    pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, pages)
    runner = DCPRunner(model.to(pool.device), pool, backend="a2a", replicate_q=True)
    state = RequestState()
    reserve(state, PageAllocator(pages), len(prompt) + 1, pool.layout.virtual_page_size)
    logits = runner.extend(state, prompt)           # prefill: [len(prompt), vocab]
    logits = runner.extend(state, [int(logits[-1].argmax())])   # one decode step
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hicache.distributed import CollectiveCounter
from hicache.engine.attention import attend_latent
from hicache.engine.dcp import DCPComm
from hicache.engine.model import MLAModel


class EngineError(ValueError):
    """A request the engine cannot run (too few pages, empty input, mismatched pool)."""


@dataclass
class RequestState:
    """Page table (widened page ids) and the number of positions already in the KV pool."""

    page_table: list[int] = field(default_factory=list)
    length: int = 0

    def capacity(self, virtual_page_size: int) -> int:
        return len(self.page_table) * virtual_page_size

    def slots(self, start: int, end: int, virtual_page_size: int) -> torch.Tensor:
        """Virtual slots (int64 [end - start]) of positions ``start .. end-1``."""
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.as_tensor(self.page_table, dtype=torch.int64)
        return table[pos // virtual_page_size] * virtual_page_size + pos % virtual_page_size


def reserve(state: RequestState, allocator, total_tokens: int, virtual_page_size: int) -> list[int]:
    """Grow ``state.page_table`` from ``allocator`` until it holds ``total_tokens``; new pages."""
    need = -(-total_tokens // virtual_page_size) - len(state.page_table)
    new = allocator.alloc(need) if need > 0 else []
    state.page_table.extend(new)
    return new


@dataclass
class EngineStats:
    layers_run: int = 0
    dcp_collectives: int = 0  # query gathers and merges
    tp_collectives: int = 0  # o_proj all-reduces

    def dcp_collectives_per_layer(self) -> float:
        return self.dcp_collectives / self.layers_run if self.layers_run else 0.0


class DCPRunner:
    """One rank's engine: a model, its L1 pool shard and its DCP group."""

    def __init__(self, model: MLAModel, pool, *, backend: str = "a2a", replicate_q: bool = True,
                 group=None, attn_backend: str = "auto",
                 kv_writer: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None,
                 layer_hook: Optional[Callable[[int], None]] = None) -> None:
        cfg = model.cfg
        layout = pool.layout
        if pool.kv_dim != cfg.kv_dim or pool.num_layers != cfg.num_layers:
            raise EngineError(
                f"pool holds {pool.num_layers} layers of {pool.kv_dim}-wide rows; the model needs "
                f"{cfg.num_layers} layers of {cfg.kv_dim}")
        model_dev = model.embed_tokens.device
        if model_dev != pool.device:
            raise EngineError(f"model weights are on {model_dev} but the KV pool is on "
                              f"{pool.device}; move the model with model.to(pool.device)")
        if pool.dtype != cfg.torch_dtype:
            raise EngineError(f"pool dtype {pool.dtype} != model dtype {cfg.torch_dtype}")
        self.model = model
        self.pool = pool
        self.layout = layout
        self.comm = DCPComm(layout.dcp_size, layout.rank, cfg.num_heads, backend, replicate_q,
                            group)
        self.attn_backend = attn_backend
        self.kv_writer = kv_writer or pool.write
        self.layer_hook = layer_hook
        self.stats = EngineStats()

    @property
    def virtual_page_size(self) -> int:
        return self.layout.virtual_page_size

    # ---- the one forward path ----------------------------------------------------------------
    def extend(self, state: RequestState, new_tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Run ``new_tokens`` after ``state.length`` cached positions: logits [k, vocab] fp32."""
        return self.extend_batch([state], [new_tokens])[0]

    @torch.no_grad()
    def extend_batch(self, states: Sequence[RequestState],
                     token_lists: Sequence[Sequence[int] | torch.Tensor]) -> list[torch.Tensor]:
        """``extend`` for several requests at once; one set of collectives per layer."""
        if len(states) != len(token_lists) or not states:
            raise EngineError(
                f"need one token list per request state, got {len(states)} states and "
                f"{len(token_lists)} token lists")
        vps = self.virtual_page_size
        dev = self.pool.device
        toks, q_pos, new_slots, local = [], [], [], []
        for st, tk in zip(states, token_lists):
            tk = torch.as_tensor(tk, dtype=torch.int64).reshape(-1)
            k = tk.numel()
            if k == 0:
                raise EngineError("extend needs at least one new token per request")
            end = st.length + k
            if end > st.capacity(vps):
                raise EngineError(
                    f"request needs {end} slots but its page table holds {st.capacity(vps)} "
                    f"({len(st.page_table)} pages of {vps}); reserve pages first")
            slots = st.slots(0, end, vps)  # [end]
            mask = self.layout.owned_mask(slots)
            kv_pos = torch.arange(end, dtype=torch.int64)[mask]
            rows = self.layout.physical(slots[mask])
            toks.append(tk)
            q_pos.append(torch.arange(st.length, end, dtype=torch.int64))
            new_slots.append(slots[st.length:])
            local.append((rows.to(dev), kv_pos.to(dev)))
        tokens = torch.cat(toks)
        pos = torch.cat(q_pos)
        slots_all = torch.cat(new_slots)
        sizes = [t.numel() for t in toks]
        pos_dev = pos.to(dev)

        model, cfg, comm = self.model, self.model.cfg, self.comm
        h = model.embed(tokens.to(dev))  # [sumK, hidden]
        for i, layer in enumerate(model.layers):
            if self.layer_hook is not None:
                self.layer_hook(i)
            self.kv_writer(i, slots_all, layer.kv_rows(h, pos_dev))
            with CollectiveCounter.measure() as m_dcp:
                if comm.size == 1 or comm.replicate_q:
                    q_lat, q_pe = layer.query(h, pos_dev)  # [sumK, H, R], [sumK, H, Dr]
                else:
                    q_lat, q_pe = comm.gather_query(*layer.query(h, pos_dev, comm.head_slice))
                kv_layer = self.pool.layer_view(i)
                o_parts, lse_parts, s = [], [], 0
                for b, (rows, kv_pos) in enumerate(local):
                    e = s + sizes[b]
                    o_b, lse_b = attend_latent(q_lat[s:e], q_pe[s:e],
                                               kv_layer.index_select(0, rows), pos_dev[s:e],
                                               kv_pos, cfg.softmax_scale, cfg.kv_lora_rank,
                                               backend=self.attn_backend)
                    o_parts.append(o_b)
                    lse_parts.append(lse_b)
                    s = e
                o, _ = comm.merge(torch.cat(o_parts), torch.cat(lse_parts))  # [sumK, H/c, R]
            with CollectiveCounter.measure() as m_tp:
                attn = comm.all_reduce_sum(layer.attn_out(o, comm.head_slice))
            h = layer.finish(attn, h)
            self.stats.layers_run += 1
            self.stats.dcp_collectives += m_dcp["n"]
            self.stats.tp_collectives += m_tp["n"]
        logits = model.logits(h)  # [sumK, vocab]
        for st, k in zip(states, sizes):
            st.length += k
        return list(torch.split(logits, sizes))

    # ---- greedy decode -----------------------------------------------------------------------
    def generate(self, state: RequestState, prompt: Sequence[int], new_tokens: int,
                 allocator=None) -> tuple[list[int], list[float]]:
        """Prefill ``prompt`` then greedily decode ``new_tokens``: (token ids, decode step times).

        Each emitted token is fed back, so the pool ends with ``len(prompt) + new_tokens`` rows
        of this request. With ``allocator`` the page table grows as needed. Every rank returns
        the same ids.
        """
        if allocator is not None:
            reserve(state, allocator, state.length + len(prompt) + new_tokens,
                    self.virtual_page_size)
        out: list[int] = []
        times: list[float] = []
        logits = self.extend(state, prompt)
        for _ in range(new_tokens):
            nxt = int(logits[-1].argmax())
            out.append(nxt)
            t0 = time.perf_counter()
            logits = self.extend(state, [nxt])  # every emitted token's KV enters the pool
            times.append(time.perf_counter() - t0)
        return out, times
