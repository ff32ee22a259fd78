"""The engine's one forward path: ``extend`` (prefill, chunked prefill, decode, multi-token verify).

The engine reaches its rank's KV through a port (``hicache.kvport.KVPort``): ``HiCache.kv`` when
a cache is embedded, or a bare ``DeviceKVPool``. A request is a ``RequestState``: its widened
page table and ``length``, the number of leading positions whose KV is already in the pool
(written by an earlier extend, or restored from a cache tier). ``runner.extend(state,
new_tokens) -> logits [k, vocab]`` runs the k new tokens at positions ``length .. length+k-1``
through every layer:

  1. latent rows of the new tokens -> ``port.write(layer, RowWrite, rows)``, which keeps only
     the rows this rank owns (positions, not arrival order, decide ownership);
  2. the full query on every rank (replicated weights, or this rank's heads + one all-gather);
  3. attention over this rank's local shard of positions ``0 .. length+k-1`` with global
     positions (so k > 1 stays causal across shards);
  4. the DCP merge (a2a or ag_rs) to this rank's head shard, the row-parallel o_proj and its
     TP all-reduce, then the (replicated) MLP.

Then ``state.length += k``. Token i of a request lives at virtual slot
``layout.slot_of(page_table, i)``; the caller owns the pages (``reserve`` helps) and only
appends to ``page_table``. Each request keeps the pool rows of its owned positions on the device
(``DeviceIndex``), appended per step: where the new tokens' rows go is arithmetic on the host
page table, uploaded for the whole batch in one copy, so a step costs two small device copies
per request and neither the index nor the KV write reads device data back. Every rank of the group must call ``extend`` with the
same requests and tokens (the control path is replicated). ``extend_batch`` runs several
requests in one pass with one set of collectives per layer (continuous batching).
``layer_hook(i)`` runs before layer i (e.g. a cache's ``wait_layer``).

    pool = DeviceKVPool(DCPLayout(c, rank, P), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, pages)
    runner = DCPRunner(model.to(pool.device), pool, backend="a2a", replicate_q=True)
    state = RequestState()
    reserve(state, PageAllocator(pages), len(prompt) + 1, pool.layout.page_tokens)
    logits = runner.extend(state, prompt)           # prefill: [len(prompt), vocab]
    logits = runner.extend(state, [int(logits[-1].argmax())])   # one decode step
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hicache.distributed import CollectiveCounter
from hicache.engine.attention import attend_latent
from hicache.engine.dcp import DCPComm
from hicache.engine.model import MLAModel
from hicache.errors import UsageError
from hicache.kvport import KVPort, RowWrite, frozen_ids, span_slots
from hicache.layout import DCPLayout, slot_of


class _DeviceVector:
    """An int64 vector on a device that grows by appending (amortised: capacity doubles)."""

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.empty(0, dtype=torch.int64, device=device)
        self.n = 0

    def append(self, values: torch.Tensor) -> None:
        need = self.n + values.shape[0]
        if need > self.buf.shape[0]:
            grown = torch.empty(max(need, 2 * self.buf.shape[0], 16), dtype=torch.int64,
                                device=self.buf.device)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:need] = values
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def view(self) -> torch.Tensor:
        return self.buf[:self.n]


class DeviceIndex:
    """One request's index on this rank's device: for its owned positions below ``indexed``,
    their pool rows (``rows``) and positions (``kv_pos``), both int64 [local_length(indexed)].
    Where a position's row lies is arithmetic on the host page table (``DCPLayout.owned_rows``):
    each step appends its new positions' entries, uploaded with the whole batch's in one copy
    (``DCPRunner._index``). Rebuilt only when the state's page table object is replaced or
    shrinks."""

    def __init__(self, layout: DCPLayout, device: torch.device, page_table: list) -> None:
        self.layout, self.device, self.source = layout, device, page_table
        self.rows = _DeviceVector(device)
        self.kv_pos = _DeviceVector(device)
        self.indexed = 0
        self.pages = len(page_table)  # the table's length at the last sync (it only grows)

    def fits(self, layout: DCPLayout, device: torch.device, page_table: list) -> bool:
        return (self.layout == layout and self.device == device and self.source is page_table
                and self.pages <= len(page_table))

    def sync(self, length: int) -> None:
        """Index positions [0, length)."""
        self.pages = len(self.source)
        if self.indexed > length:  # an extend that failed part-way: forget its positions
            keep = self.layout.local_length(length)
            self.rows.truncate(keep)
            self.kv_pos.truncate(keep)
            self.indexed = length
        if self.indexed < length:  # KV placed by someone else (a cache tier, PCP prefill)
            self.advance(self.indexed, length)

    def plan(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host int64 (positions [m], pool rows [m], widened pages touched [p]) of positions
        [start, end) (``start == indexed``): what ``append`` then takes, on the device."""
        w = self.layout.page_tokens
        touched = np.array(self.source[start // w:-(-end // w)], dtype=np.int64)
        return (*self.layout.owned_rows(touched, start, end), touched)

    def append(self, rows: torch.Tensor, pos: torch.Tensor, end: int) -> None:
        """Positions up to ``end`` are indexed: their rows and positions (int64 [m], device)."""
        self.rows.append(rows)
        self.kv_pos.append(pos)
        self.indexed = end

    def advance(self, start: int, end: int, base: int = 0) -> RowWrite:
        """Index positions [start, end) (``start == indexed``) and say where their rows go:
        the write of new tokens whose rows are input rows ``base ..`` (one upload)."""
        pos, rows, pages = self.plan(start, end)
        m = len(pos)
        dev = _upload(np.concatenate([rows, pos, pos - (start - base)]), self.device)
        self.append(dev[:m], dev[m:2 * m], end)
        return RowWrite(end - start, dev[2 * m:], dev[:m], frozen_ids(pages),
                        span_slots(pages, start, end, self.layout.page_tokens))


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 host array -> the device (a view of ``host`` on the CPU). On CUDA through pinned
    staging: an asynchronous copy from pageable memory may wait inside the driver; torch's
    caching host allocator keeps the staging block until the copy that reads it is done."""
    t = torch.from_numpy(host)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class RequestState:
    """Page table (widened page ids) and the number of positions already in the KV pool.
    ``page_table`` only grows by appending (``reserve``, ``HiCache.alloc``)."""

    page_table: list[int] = field(default_factory=list)
    length: int = 0
    index: Optional[DeviceIndex] = field(default=None, repr=False, compare=False)

    def capacity(self, page_tokens: int) -> int:
        return len(self.page_table) * page_tokens

    def slots(self, start: int, end: int, page_tokens: int) -> torch.Tensor:
        """Virtual slots (int64 [end - start]) of positions ``start .. end-1``."""
        pos = torch.arange(start, end, dtype=torch.int64)
        return slot_of(torch.as_tensor(self.page_table, dtype=torch.int64), pos,
                       page_tokens)

    def device_index(self, layout: DCPLayout, device: torch.device) -> DeviceIndex:
        """This request's index on ``device``, in step with ``page_table`` and ``length``."""
        if self.index is None or not self.index.fits(layout, device, self.page_table):
            self.index = DeviceIndex(layout, device, self.page_table)
        self.index.sync(self.length)
        return self.index


def reserve(state: RequestState, allocator, total_tokens: int, page_tokens: int) -> list[int]:
    """Grow ``state.page_table`` from ``allocator`` until it holds ``total_tokens``; new pages."""
    need = -(-total_tokens // page_tokens) - len(state.page_table)
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
    """One rank's engine: a model, the KV port of its rank and its DCP group. A hybrid model
    (one with a ``hybrid`` part: Kimi Linear) gets a ``HybridRunner`` (engine.hybrid_runner)."""

    def __new__(cls, model=None, *args, **kwargs):
        if cls is DCPRunner and getattr(model, "hybrid", None) is not None:
            from hicache.engine.hybrid_runner import HybridRunner
            cls = HybridRunner
        return super().__new__(cls)

    def __init__(self, model: MLAModel, kv: KVPort, *, backend: str = "a2a",
                 replicate_q: bool = True, group=None, attn_backend: str = "auto",
                 layer_hook: Optional[Callable[[int], None]] = None) -> None:
        cfg = model.cfg
        if kv.kv_dim != cfg.kv_dim or kv.num_layers != cfg.num_layers:
            raise UsageError(
                f"pool holds {kv.num_layers} layers of {kv.kv_dim}-wide rows; the model needs "
                f"{cfg.num_layers} layers of {cfg.kv_dim}")
        model_dev = model.embed_tokens.device
        if model_dev != kv.device:
            raise UsageError(f"model weights are on {model_dev} but the KV pool is on "
                             f"{kv.device}; move the model with model.to(pool.device)")
        if kv.dtype != cfg.torch_dtype:
            raise UsageError(f"pool dtype {kv.dtype} != model dtype {cfg.torch_dtype}")
        self.model = model
        self.kv = kv
        self.layout = kv.layout
        self.comm = DCPComm(self.layout.dcp_size, self.layout.rank, cfg.num_heads, backend,
                            replicate_q, group)
        self.attn_backend = attn_backend
        self.layer_hook = layer_hook
        self.stats = EngineStats()
        self.last_hidden: Optional[torch.Tensor] = None  # the last extend's final normed h

    @property
    def page_tokens(self) -> int:
        return self.layout.page_tokens

    # ---- the one forward path ----------------------------------------------------------------
    def extend(self, state: RequestState, new_tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Run ``new_tokens`` after ``state.length`` cached positions: logits [k, vocab] fp32."""
        return self.extend_batch([state], [new_tokens])[0]

    def _check(self, states: Sequence[RequestState], token_lists) -> list[torch.Tensor]:
        """The batch's token ids (int64 [k] each), or UsageError before anything changes."""
        if len(states) != len(token_lists) or not states:
            raise UsageError(
                f"need one token list per request state, got {len(states)} states and "
                f"{len(token_lists)} token lists")
        page_tokens = self.page_tokens
        toks = []
        for st, tk in zip(states, token_lists):
            tk = torch.as_tensor(tk, dtype=torch.int64).reshape(-1)
            if tk.numel() == 0:
                raise UsageError("extend needs at least one new token per request")
            end = st.length + tk.numel()
            if end > st.capacity(page_tokens):
                raise UsageError(
                    f"request needs {end} slots but its page table holds "
                    f"{st.capacity(page_tokens)} ({len(st.page_table)} pages of {page_tokens}); "
                    "reserve pages first")
            toks.append(tk)
        return toks

    def _index(self, states: Sequence[RequestState], sizes: list[int]) -> tuple:
        """Advance every request's device index over its new positions. Returns the step's KV
        write (one ``RowWrite`` for the batch's rows, reused by every layer), the query
        positions int64 [sumK] and per request (pool rows, positions) of its owned KV, all on
        the device. Computed on the host (``DeviceIndex.plan``) and uploaded in one copy; on
        the device, two appends per request."""
        lay, dev = self.layout, self.kv.device
        idxs, rows, pos, pages, q_pos, src, slots = [], [], [], [], [], [], []
        base = 0
        for st, k in zip(states, sizes):
            idx = st.device_index(lay, dev)
            p, r, touched = idx.plan(st.length, st.length + k)
            idxs.append((idx, len(p), st.length + k))
            rows.append(r)
            pos.append(p)
            pages.append(touched)
            slots.append(span_slots(touched, st.length, st.length + k, lay.page_tokens))
            q_pos.append(np.arange(st.length, st.length + k, dtype=np.int64))
            if lay.dcp_size > 1:  # the input rows this rank keeps (with c = 1: all, in order)
                src.append(p - (st.length - base))
            base += k
        m = sum(len(p) for p in pos)
        buf = _upload(np.concatenate(rows + pos + q_pos + src), dev)  # [m | m | sumK | m?]
        dst, kv_pos, q_dev = buf[:m], buf[m:2 * m], buf[2 * m:2 * m + base]
        local, o = [], 0
        for idx, n, end in idxs:
            idx.append(dst[o:o + n], kv_pos[o:o + n], end)
            local.append((idx.rows.view(), idx.kv_pos.view()))
            o += n
        write = RowWrite(base, buf[2 * m + base:] if src else None, dst,
                         frozen_ids(np.concatenate(pages)), frozen_ids(np.concatenate(slots)))
        return write, q_dev, local

    @torch.no_grad()
    def extend_batch(self, states: Sequence[RequestState],
                     token_lists: Sequence[Sequence[int] | torch.Tensor],
                     inputs: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """``extend`` for several requests at once; one set of collectives per layer.
        ``inputs`` (fp32 [sumK, hidden]) replaces the token embeddings (an MTP module's input);
        ``self.last_hidden`` keeps the final representation [sumK, hidden]: the last layer's
        output after the model's final norm, what the LM head reads and an MTP module is fed
        (as vLLM's, SGLang's and Megatron's MTP are; docs/speculative.md)."""
        toks = self._check(states, token_lists)
        sizes = [t.numel() for t in toks]
        write, pos_dev, local = self._index(states, sizes)
        model = self.model
        # [sumK, hidden]; ids checked on the host, then uploaded
        h = model.embed(torch.cat(toks)) if inputs is None else inputs
        for i, layer in enumerate(model.layers):
            if self.layer_hook is not None:
                self.layer_hook(i)
            self.kv.write(i, write, layer.kv_rows(h, pos_dev))
            h = self._layer(i, layer, h, pos_dev, local, sizes)
        self.last_hidden = model.final_norm(h)
        logits = model.head_logits(self.last_hidden)  # [sumK, vocab]
        for st, k in zip(states, sizes):
            st.length += k
        return list(torch.split(logits, sizes))

    # ---- speculative verify ------------------------------------------------------------------
    def verify_batch(self, states: Sequence[RequestState], token_lists: Sequence,
                     keep: bool = False) -> list[torch.Tensor]:
        """``extend_batch`` of drafted tokens, after which ``rewind`` may take each request back
        to any position the step ran (``keep``: to those of the previous verify too, a
        drafter's chained steps). MLA rows need nothing kept: rows past the committed length
        are overwritten by the next step (a hybrid runner keeps its KDA state per position)."""
        return self.extend_batch(states, token_lists)

    def rewind(self, state: RequestState, length: int) -> None:
        """Forget the positions ``>= length`` of ``state`` (a rejected draft's): they were
        written by a ``verify_batch`` and are overwritten by the next step."""
        if isinstance(length, bool) or not isinstance(length, int) or \
                not 0 <= length <= state.length:
            raise UsageError(f"rewind to {length!r}: the request is at {state.length}")
        state.length = length

    def _layer(self, i: int, layer, h: torch.Tensor, pos_dev: torch.Tensor, local: list,
               sizes: list[int]) -> torch.Tensor:
        """Layer ``i`` after its KV is written: attention over each request's owned rows, the
        DCP merge, o_proj with its TP all-reduce, the MLP. h [sumK, hidden] -> same."""
        cfg, comm = self.model.cfg, self.comm
        with CollectiveCounter.measure() as m_dcp:
            if comm.size == 1 or comm.replicate_q:
                q_lat, q_pe = layer.query(h, pos_dev)  # [sumK, H, R], [sumK, H, Dr]
            else:
                q_lat, q_pe = comm.gather_query(*layer.query(h, pos_dev, comm.head_slice))
            kv_layer = self.kv.layer_view(i)
            o_parts, lse_parts, s = [], [], 0
            for (rows, kv_pos), k in zip(local, sizes):
                o_b, lse_b = attend_latent(q_lat[s:s + k], q_pe[s:s + k], kv_layer,
                                           pos_dev[s:s + k], kv_pos, cfg.softmax_scale,
                                           cfg.kv_lora_rank, backend=self.attn_backend,
                                           rows=rows)  # the owned rows, read in place
                o_parts.append(o_b)
                lse_parts.append(lse_b)
                s += k
            o, _ = comm.merge(torch.cat(o_parts), torch.cat(lse_parts))  # [sumK, H/c, R]
        with CollectiveCounter.measure() as m_tp:
            attn = comm.all_reduce_sum(layer.attn_out(o, comm.head_slice))
        self.stats.layers_run += 1
        self.stats.dcp_collectives += m_dcp["n"]
        self.stats.tp_collectives += m_tp["n"]
        return layer.finish(attn, h)

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
                    self.page_tokens)
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
