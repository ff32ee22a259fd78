"""The engine step of a hybrid model (Kimi Linear): MLA layers as ``DCPRunner``, KDA layers local.

``DCPRunner(model, kv, ...)`` returns a ``HybridRunner`` when ``model`` has a ``hybrid`` part
(``KimiLinearModel``), so every caller of the engine runs hybrid checkpoints unchanged. Per step:

- an MLA layer (KV pool layer ``model.kv_layer[i]``) runs exactly the MLA path of
  ``DCPRunner``: its rows are written striped ``v mod c`` across the DCP ranks, attention over
  the local shard, the DCP merge and the o_proj all-reduce; ``layer_hook`` gets the KV layer;
- a KDA layer runs whole on every rank, each request from its state in the rank's
  ``KDAStatePool`` (replicated: every rank holds the same state), with no collective.

The requests' next KDA states are stored only after the last layer succeeded. ``release(state)``
frees a finished request's state slot early (it is freed anyway when the ``RequestState`` is
garbage-collected).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hicache.engine.runner import DCPRunner, RequestState
from hicache.engine.state_pool import KDAStatePool


class HybridRunner(DCPRunner):
    def __init__(self, model, kv, *, state_slots: int = 8, **kwargs) -> None:
        super().__init__(model, kv, **kwargs)
        self.states = KDAStatePool(model.hybrid, model.cfg.torch_dtype, kv.device, state_slots)

    def release(self, state: RequestState) -> None:
        self.states.release(state)

    @torch.no_grad()
    def extend_batch(self, states: Sequence[RequestState],
                     token_lists: Sequence) -> list[torch.Tensor]:
        toks = self._check(states, token_lists)
        slots = [self.states.slot_for(st) for st in states]
        if len(set(slots)) != len(slots):
            from hicache.errors import UsageError
            raise UsageError("the same request appears twice in one batch")
        sizes = [t.numel() for t in toks]
        write, pos_dev, local = self._index(states, sizes)
        model = self.model
        h = model.embed(torch.cat(toks))
        updates: list[list] = [[] for _ in states]  # per request: (conv, rec) per KDA layer
        for i, layer in enumerate(model.layers):
            j = model.kv_layer[i]
            if j is None:
                h = self._kda(model.kda_index[i], layer, h, slots, sizes, updates)
                continue
            if self.layer_hook is not None:
                self.layer_hook(j)
            self.kv.write(j, write, layer.kv_rows(h, pos_dev))
            h = self._layer(j, layer, h, pos_dev, local, sizes)
        logits = model.logits(h)
        for st, slot, k, upd in zip(states, slots, sizes, updates):
            self.states.commit(slot, upd, st.length + k)
            st.length += k
        return list(torch.split(logits, sizes))

    def _kda(self, j: int, layer, h: torch.Tensor, slots: list[int], sizes: list[int],
             updates: list[list]) -> torch.Tensor:
        """KDA layer (pool layer ``j``) for every request from its state; no collective."""
        x, qkv = layer.inputs(h)
        outs, s = [], 0
        for r, (slot, k) in enumerate(zip(slots, sizes)):
            o, conv, rec = layer.mix(x[s:s + k], qkv[s:s + k], self.states.conv[j, slot],
                                     self.states.rec[j, slot])
            outs.append(o)
            updates[r].append((conv, rec))
            s += k
        return layer.finish(torch.cat(outs), h)
