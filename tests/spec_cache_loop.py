"""The speculative engine loop over a ``HiCache`` with draft pages (tests/test_spec_cache*.py):
one request admitted, prefilled past its hit, decoded with k drafts per target step, finished
with its target and draft KV cached."""

import numpy as np
import torch

from hicache.checkpoints.drafter import drafter_for
from hicache.engine.runner import DCPRunner, RequestState
from hicache.engine.spec import SpecStats, speculative_generate


def spec_request(cache, model, draft, rid, prompt, k: int, new_tokens: int, group=None,
                 hidden: bool = True):
    """Tokens, the prefix, the stats and the drafter of one speculative request (``hidden``
    False: the drafter gets no prefill hidden states, as after a PCP prefill)."""
    prefix = cache.admit(rid, prompt)
    while not prefix.ready:
        cache.step()
    cache.alloc(rid, len(prompt) + new_tokens)
    runner = DCPRunner(model, cache.kv, group=group,
                       layer_hook=lambda i: cache.wait_layer(rid, i))
    state = RequestState(page_table=prefix.page_table, length=prefix.hit_len)
    logits = runner.extend(state, torch.as_tensor(np.asarray(prompt[prefix.hit_len:])))
    stats = SpecStats()
    if draft is None:  # a run without speculation: its pages carry no draft KV
        out = [int(logits[-1].argmax())]
        for _ in range(new_tokens - 1):
            out.append(int(runner.extend(state, [out[-1]])[-1].argmax()))
        cache.finish(rid, np.concatenate([prompt, out[:-1]]))
        return out, prefix, stats, None
    drafter = drafter_for(draft, cache.page_tokens, prefix.page_table, cache.l1.num_pages,
                          pool=cache.draft.kv)
    stats.draft_recomputed_tokens = drafter.restored(prefix.draft_len, prefix.hit_len)
    out = speculative_generate(runner, state, list(prompt), logits[-1], drafter, k, new_tokens,
                               hidden=runner.last_hidden if hidden else None, stats=stats)
    cache.finish(rid, np.concatenate([prompt, out[:-1]]), draft_len=drafter.valid_len())
    return out, prefix, stats, drafter


def draft_rows(cache, table, n: int) -> torch.Tensor:
    """The draft pool's rows of positions [0, n) of a request whose page table is ``table``."""
    w = cache.page_tokens
    pos = torch.arange(n)
    virt = torch.tensor(table)[pos // w] * w + pos % w
    pool = cache.draft.l1
    return torch.stack([pool.read(i, virt)[1] for i in range(pool.num_layers)])
