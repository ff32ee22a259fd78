"""The serving loop's speculative steps (``hicache.serving``; docs/speculative.md "Batched").

Every decoding request drafts up to k tokens with its own drafter (an MTP module fed the
target's final hidden states, or a draft model), all on one replicated draft runner over the
cache's draft pool (``HiCache.draft.kv``, its checked port, indexed by the target's page ids;
draft models draft together: one batched draft extend per draft step,
``engine.spec.propose_batch``); the batch then verifies ``[last, d_1..d_k]`` of every request
in ONE target step (``runner.verify_batch``) and each request accepts its own longest agreeing
prefix. Rejected positions are rolled back (``runner.rewind``: MLA rows are overwritten by the
next step, a hybrid target's KDA state is restored from the state kept at the accepted
position) and never reach the cache: ``finish`` gets the committed tokens and the drafter's
``valid_len`` (``finished``); a hybrid request's snapshots are
taken at committed positions only. A hit restores the draft's KV with the target's (from L1,
L2 or L3: ``Prefix.draft_len``); the drafter recomputes only what is absent.

Each request's draft KV has one source (``SOURCES``): ``cold`` (no hit), the deepest tier the
hit came from (``l1``, ``l2``, ``l3``) when the draft KV of the whole hit came back, else
``recomputed`` (a draft model recomputed the absent part, a hybrid draft all of it: its KDA
state is not cached; an MTP module, which cannot recompute a hit's rows, started at the hit's
end). Acceptance by source is the alarm for
restored draft state that is wrong (``hicache.commands.bench_spec``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..engine.spec import SpecStats
from ..errors import ConfigError

SOURCES = ("cold", "l1", "l2", "l3", "recomputed")

__all__ = ["SOURCES", "SpecServing", "RequestSpec", "source_of"]


@dataclass(frozen=True)
class SpecServing:
    """What the serving loop drafts with: the draft module (``load_draft``: an ``MTPModule``
    or a model) and k, the draft tokens per request per round."""

    draft: object
    num_draft_tokens: int = 3


@dataclass
class RequestSpec:
    """One request's drafter, its counts and where its draft KV came from."""

    drafter: object
    source: str
    stats: SpecStats = field(default_factory=SpecStats)

    def to_dict(self) -> dict:
        return {"source": self.source, **self.stats.to_dict(), "emitted": self.stats.emitted}


def source_of(prefix) -> str:
    """Where the request's draft KV came from (see the module doc)."""
    if prefix.hit_len == 0:
        return "cold"
    if prefix.draft_len < prefix.hit_len:
        return "recomputed"
    if prefix.storage_len:
        return "l3"
    return "l2" if prefix.host_len else "l1"


def draft_runner(spec: SpecServing, cache):
    """The one replicated draft runner of a server, on the cache's draft pool."""
    from ..engine.spec import replicated_runner
    if cache.draft is None:
        raise ConfigError("speculative serving needs a cache built with the draft's pages: "
                          "HiCache(..., draft=draft_spec(draft, page_tokens))")
    return replicated_runner(spec.draft, cache.page_tokens, cache.config.l1.num_pages,
                             pool=cache.draft.kv)


def start(runner, a) -> RequestSpec:
    """Before request ``a``'s prefill: its drafter, started from what its hit restored."""
    from ..engine.mtp import MTPModule
    from ..engine.spec import DraftModelDrafter, MTPDrafter
    cls = MTPDrafter if isinstance(runner.model, MTPModule) else DraftModelDrafter
    drafter = cls(runner, a.prefix.page_table)
    recomputed = drafter.restored(a.prefix.draft_len, a.prefix.hit_len)
    # a hybrid draft recomputes its whole hit (its KDA state is not cached)
    rs = RequestSpec(drafter, "recomputed" if recomputed else source_of(a.prefix))
    rs.stats.draft_recomputed_tokens = recomputed
    return rs


def prefilled(target, a, start_pos: int) -> None:
    """A prefill chunk of ``a`` ran positions [start_pos, a.state.length): the drafter sees
    the target's final hidden states there."""
    a.spec.drafter.observe(target.last_hidden, start_pos, a.state.length)


def caught_up(a) -> None:
    """After the prefill and the first token: the draft's own prefill (what it lacks)."""
    t0 = time.perf_counter()
    a.spec.drafter.catch_up(_seq(a))
    a.spec.stats.draft_prefill_s += time.perf_counter() - t0


def _seq(a) -> list[int]:
    return [int(t) for t in a.job.tokens] + a.output


@torch.no_grad()
def round_(target, decoding: list, k: int, hybrid: bool) -> None:
    """One speculative round of every decoding request: drafts, one batched verify, per
    request acceptance, rollback, the drafter told what was committed."""
    from ..engine.spec import propose_batch
    ks = [min(k, a.job.output_len - len(a.output) - 1) for a in decoding]  # never past the end
    drafted = propose_batch([a.spec.drafter for a in decoding], [_seq(a) for a in decoding], ks)
    lists = [[a.output[-1]] + d for a, d in zip(decoding, drafted)]
    states = [a.state for a in decoding]
    logits = target.verify_batch(states, lists)
    hidden = torch.split(target.last_hidden, [len(t) for t in lists])
    for a, toks, lg, h in zip(decoding, lists, logits, hidden):
        drafts, picks = toks[1:], lg.argmax(-1).tolist()
        acc = 0
        while acc < len(drafts) and drafts[acc] == picks[acc]:
            acc += 1
        start = a.state.length - len(toks)
        target.rewind(a.state, start + acc + 1)  # rejected positions: rolled back
        a.output += drafts[:acc] + [picks[acc]]
        a.spec.drafter.observe(h[:acc + 1], start, a.state.length)
        a.spec.stats.add_round(len(drafts), acc)
        if hybrid:
            _committed_snapshots(target, a, start)


def _committed_snapshots(target, a, start: int) -> None:
    """A hybrid request keeps the KDA states the cache wants at positions the round
    committed (never at a rejected one)."""
    kept = target.kept.get(id(a.state), {})
    for p in a.want:
        if start < p <= a.state.length and p in kept:
            a.snaps[p] = (kept[p].conv, kept[p].rec)


def finished(a) -> dict:
    """At ``finish``: ``{"draft_len": n}``, the leading committed tokens whose draft KV the
    request's drafter wrote (nothing without speculation); a hybrid draft's state slot and
    kept states are freed."""
    if a.spec is None:
        return {}
    d = a.spec.drafter
    n = d.valid_len()
    release = getattr(d.runner, "release", None)
    if release is not None:
        release(d.state)
    return {"draft_len": n}


def report(a) -> Optional[dict]:
    return a.spec.to_dict() if a.spec is not None else None
