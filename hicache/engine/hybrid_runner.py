"""The engine step of a hybrid model (Kimi Linear): MLA layers as ``DCPRunner``, KDA layers local.

``DCPRunner(model, kv, ...)`` returns a ``HybridRunner`` when ``model`` has a ``hybrid`` part
(``KimiLinearModel``), so every caller of the engine runs hybrid checkpoints unchanged. Per step:

- an MLA layer (KV pool layer ``model.kv_layer[i]``) runs exactly the MLA path of
  ``DCPRunner``: its rows are written striped ``v mod c`` across the DCP ranks, attention over
  the local shard, the DCP merge and the o_proj all-reduce; ``layer_hook`` gets the KV layer;
- a KDA layer runs whole on every rank, each request from its state in the rank's
  ``KDAStatePool`` (replicated: every rank holds the same state), with no collective.

The requests' next KDA states are stored only after the last layer succeeded.
``extend_snapshots`` (or ``extend_batch(..., snapshot_at=...)``) also returns the KDA state
after chosen positions inside the step (page-aligned snapshots for a prefix cache); a request
restored with ``states.restore(state, snapshot)`` over its cached MLA KV continues exactly. ``release(state)``
frees a finished request's state slot early (it is freed anyway when the ``RequestState`` is
garbage-collected).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hicache.engine.runner import DCPRunner, RequestState
from hicache.engine.state_pool import KDAStatePool, StateSnapshot
from hicache.errors import UsageError


class HybridRunner(DCPRunner):
    def __init__(self, model, kv, *, state_slots: int = 8, **kwargs) -> None:
        super().__init__(model, kv, **kwargs)
        self.states = KDAStatePool(model.hybrid, model.cfg.torch_dtype, kv.device, state_slots)
        self.last_snapshots: list = []
        # per request (id of its RequestState): position -> its KDA state, kept by verify_batch
        self.kept: dict[int, dict[int, StateSnapshot]] = {}

    def release(self, state: RequestState) -> None:
        self.states.release(state)
        self.kept.pop(id(state), None)

    def verify_batch(self, states: Sequence[RequestState], token_lists: Sequence,
                     keep: bool = False) -> list[torch.Tensor]:
        """``extend_batch`` keeping every request's KDA state (conv window and recurrent
        matrix, every KDA layer) at the step's start and after each of its positions, so
        ``rewind`` rolls a rejection back without recompute. Each position runs the token loop from the state
        before it, as a decode step does (``KDALayer.mix`` cut at every position)."""
        at = [list(range(st.length, st.length + len(t) + 1))
              for st, t in zip(states, token_lists)]
        logits = self.extend_batch(states, token_lists, snapshot_at=at)
        for st, snaps in zip(states, self.last_snapshots):
            mine = self.kept.get(id(st)) if keep else None
            if mine is None:
                mine = self.kept[id(st)] = {}
            mine.update((sn.length, sn) for sn in snaps)
        return logits

    def rewind(self, state: RequestState, length: int) -> None:
        """Back to ``length``: the KDA state kept there by ``verify_batch`` is restored (no
        recompute); a position no verify kept is a ``UsageError`` (the state cannot be
        rewound further)."""
        if length == state.length:
            return
        snap = self.kept.get(id(state), {}).get(length)
        if snap is None or length > state.length:
            raise UsageError(f"rewind to {length!r}: no KDA state kept there (the request is "
                             f"at {state.length}; a hybrid request rewinds only within the "
                             "positions of its verify steps)")
        super().rewind(state, length)
        self.states.restore(state, snap)

    def extend_snapshots(self, state: RequestState, new_tokens, at: Sequence[int]
                         ) -> tuple[torch.Tensor, list[StateSnapshot]]:
        """``extend`` that also returns the request's KDA state after exactly each position of
        ``at`` (``state.length <= p <= state.length + len(new_tokens)``): one pass, no extra
        compute beyond copying the states (a prefix cache's snapshots)."""
        logits = self.extend_batch([state], [new_tokens], snapshot_at=[at])[0]
        return logits, self.last_snapshots[0]

    @torch.no_grad()
    def extend_batch(self, states: Sequence[RequestState], token_lists: Sequence,
                     snapshot_at: Optional[Sequence[Sequence[int]]] = None
                     ) -> list[torch.Tensor]:
        """``DCPRunner.extend_batch``; ``snapshot_at[r]`` lists positions of request r whose
        KDA state to keep (in ``self.last_snapshots[r]``, ``StateSnapshot`` each)."""
        toks = self._check(states, token_lists)
        slots = [self.states.slot_for(st) for st in states]
        if len(set(slots)) != len(slots):
            raise UsageError("the same request appears twice in one batch")
        sizes = [t.numel() for t in toks]
        cuts = [[] for _ in states]
        for r, at in enumerate(snapshot_at or []):
            st, k = states[r], sizes[r]
            for p in at:
                if isinstance(p, bool) or not isinstance(p, int) or not \
                        st.length <= p <= st.length + k:
                    raise UsageError(f"snapshot position {p!r} is outside this step's "
                                     f"positions [{st.length}, {st.length + k}]")
                cuts[r].append(p - st.length)
        write, pos_dev, local = self._index(states, sizes)
        model = self.model
        h = model.embed(torch.cat(toks))
        updates: list[list] = [[] for _ in states]  # per request: (conv, rec) per KDA layer
        marks: list[list] = [[] for _ in states]  # per request: per KDA layer, (conv, rec) per cut
        for i, layer in enumerate(model.layers):
            j = model.kv_layer[i]
            if j is None:
                h = self._kda(model.kda_index[i], layer, h, slots, sizes, updates, cuts, marks)
                continue
            if self.layer_hook is not None:
                self.layer_hook(j)
            self.kv.write(j, write, layer.kv_rows(h, pos_dev))
            h = self._layer(j, layer, h, pos_dev, local, sizes)
        self.last_hidden = model.final_norm(h)  # what an MTP module or a drafter reads
        logits = model.head_logits(self.last_hidden)
        dtype = self.states.conv.dtype
        self.last_snapshots = [
            [StateSnapshot(st.length + c,
                           torch.stack([m[n][0] for m in marks[r]]).to(dtype),
                           torch.stack([m[n][1] for m in marks[r]]))
             for n, c in enumerate(cuts[r])] for r, st in enumerate(states)]
        for st, slot, k, upd in zip(states, slots, sizes, updates):
            self.states.commit(slot, upd, st.length + k)
            st.length += k
        return list(torch.split(logits, sizes))

    def _kda(self, j: int, layer, h: torch.Tensor, slots: list[int], sizes: list[int],
             updates: list[list], cuts: list[list], marks: list[list]) -> torch.Tensor:
        """KDA layer (pool layer ``j``) for every request from its state; no collective."""
        x, qkv = layer.inputs(h)
        outs, s = [], 0
        for r, (slot, k) in enumerate(zip(slots, sizes)):
            o, conv, rec, mk = layer.mix(x[s:s + k], qkv[s:s + k], self.states.conv[j, slot],
                                         self.states.rec[j, slot], cuts[r])
            outs.append(o)
            updates[r].append((conv, rec))
            marks[r].append(mk)
            s += k
        return layer.finish(torch.cat(outs), h)
