"""The serving loop's hybrid-model steps (``hicache.serving``; docs/hybrid.md): a request whose
hit came with a KDA state snapshot restores it before its first extend, and every extend also
returns the KDA state at the page-aligned positions the cache wants (``extend_snapshots``), which
the request hands to ``HiCache.finish`` with its tokens.
"""

from __future__ import annotations

import torch

from ..engine.state_pool import StateSnapshot
from ..errors import ConfigError


def check(runner, cache) -> bool:
    """True when ``runner`` runs a hybrid model. Its cache must keep snapshots (``model.path``
    names the checkpoint) unless it caches nothing: a hit without its KDA state cannot run."""
    if not hasattr(runner, "states"):
        return False
    if cache.tiers and cache.companion("hybrid") is None:
        raise ConfigError("model.path: the engine runs a hybrid (KDA) model but the cache's "
                          "policy names no hybrid checkpoint, so its hits would have no KDA "
                          "state; set [model] path to the checkpoint directory")
    return True


def prefill(runner, cache, a, state, suffix: torch.Tensor, chunk: int, seen=None
            ) -> torch.Tensor:
    """The unmatched suffix of request ``a`` (``state`` at its hit), in chunks; returns the
    last chunk's logits. Snapshots land in ``a.snaps``; ``seen(start)`` after each chunk (a
    drafter reads ``runner.last_hidden``)."""
    job, prefix = a.job, a.prefix
    if prefix.hit_len:  # (the cache cut the hit back to a snapshot: the same position)
        pos, conv, rec = prefix.state
        pool = runner.states  # (an L3 copy comes flat: the pool's shapes)
        runner.states.restore(state, StateSnapshot(
            pos, conv.reshape(pool.conv.shape[0], *pool.conv.shape[2:]),
            rec.reshape(pool.rec.shape[0], *pool.rec.shape[2:])))
    a.want = cache.snapshot_positions(job.request_id, len(job.tokens) + job.output_len - 1)
    logits = None
    for s in range(0, len(suffix), chunk):
        part = suffix[s:s + chunk]
        lo = state.length
        at = [p for p in a.want if lo < p <= lo + len(part)]
        if at:
            logits, snaps = runner.extend_snapshots(state, part, at)
            a.snaps.update((sn.length, (sn.conv, sn.rec)) for sn in snaps)
        else:
            logits = runner.extend(state, part)
        if seen is not None:
            seen(lo)
    return logits


def decode(runner, decoding: list) -> list:
    """One token for every decoding request (one batched extend), keeping the KDA state of a
    request whose next position the cache wants."""
    at = [[p for p in a.want if p == a.state.length + 1] for a in decoding]
    logits = runner.extend_batch([a.state for a in decoding],
                                 [[a.output[-1]] for a in decoding], snapshot_at=at)
    for a, snaps in zip(decoding, runner.last_snapshots):
        a.snaps.update((sn.length, (sn.conv, sn.rec)) for sn in snaps)
    return logits


def finished(runner, a) -> dict:
    """The snapshots ``a`` took (for ``HiCache.finish``); its KDA state slot is freed."""
    runner.release(a.state)
    return a.snaps
