"""Companions: everything a ``HiCache`` keeps beside the target KV under the same page ids
(docs/architecture.md, "Companions"; /work DESIGN "Companions").

- ``base``: the protocol (``Companion``), what a companion may use of its service (``Host``),
  the named step fields (``StepFields``), a target job with its companions' (``JobSet``);
- ``draft`` + ``draft_format``: a draft's KV pages (speculative decoding), allocated per page;
- ``snapshots`` + ``snapshot_format`` + ``snapshot_tier`` + ``snapshot_l3``: a hybrid model's
  KDA state snapshots, allocated per snapshot position.

``build_all`` makes a service's companions (the built-in kinds that its config and arguments
ask for, then any extra factories ``HiCache(companions=...)`` was given); the service loops over
them and knows none by name. This module imports nothing heavy (``hicache.config`` reaches the
formats through it).
"""

from __future__ import annotations

from typing import Callable, Sequence

from hicache.errors import UsageError

from .base import Companion, Host, JobSet, StepFields, wait_future

__all__ = ["Companion", "Host", "JobSet", "StepFields", "build_all", "controller_options",
           "memory_need", "step_fields", "agreed_of"]


def controller_options(config, tiers) -> dict:
    """Keyword arguments the companions of ``config`` add to the ``CacheController``."""
    from .snapshots import controller_options as snapshots
    return snapshots(config, tiers)


def memory_need(need, config, draft, host_pages: int):
    """The node memory ``need`` (``preflight.MemoryNeed``) with the companions' pools that the
    policy does not count already (a draft handed to the constructor)."""
    if draft is None:
        return need
    from .draft import draft_need
    return draft_need(need, config, draft, host_pages)


def build_all(host: Host, draft=None, host_pages: int = 0,
              extra: Sequence[Callable[[Host], Companion | None]] = ()) -> list[Companion]:
    """This rank's companions: KDA snapshots (a hybrid checkpoint), the draft's pages (a
    ``DraftSpec``), then ``extra`` factories. What was built is closed if one fails."""
    from . import draft as draft_kind, snapshots
    makers = [snapshots.build]
    if draft is not None:
        makers.append(lambda h: draft_kind.build(h, draft, host_pages))
    made: list[Companion] = []
    try:
        for make in [*makers, *extra]:
            c = make(host)
            if c is not None:
                try:
                    _check(c, made)
                except BaseException:
                    if isinstance(c, Companion):
                        c.close()
                    raise
                made.append(c)
    except BaseException:
        for c in made:
            c.close()
        raise
    return made


def _check(c, made: list) -> None:
    if not isinstance(c, Companion):
        raise UsageError(f"a companion must be a hicache.companions.Companion, got {c!r}")
    if not c.name or not c.finish_arg:
        raise UsageError(f"companion {c!r} needs a name and a finish_arg")
    for o in made:
        if o.name == c.name or o.finish_arg == c.finish_arg:
            raise UsageError(f"two companions named {c.name!r} (or taking "
                             f"finish({c.finish_arg}=))")


def step_fields(companions: Sequence[Companion], pending: Sequence, signals: list) -> StepFields:
    """The companions' named fields of a step, one value per request waiting on L3
    (``pending``). First each companion takes its read of every request whose target prefetch
    is ready on this rank (``signals``: ``prefetch_signals``), within the prefetch's deadline:
    only a step where every rank is ready restores, so each rank then contributes what its
    read found (a timeout or an error is nothing, which the MIN makes a miss on every rank)."""
    for i, req in enumerate(pending):
        if signals[2 * i]:
            bound = req.prefetch.handle.policy.deadline_s(int(req.tokens.size))
            rid = req.prefix.request_id
            for c in companions:
                c.resolve(req, lambda f, d, what: wait_future(f, d, bound, what, rid))
    fields = StepFields(len(pending))
    for c in companions:
        per = [c.fields(req) for req in pending]
        for k in sorted(per[0]) if per else ():
            fields.add(f"{c.name}.{k}", [p[k] for p in per])
    return fields


def agreed_of(agreed: dict, name: str, i: int) -> dict:
    """Companion ``name``'s agreed fields for request ``i`` (``StepFields.unpack`` output)."""
    return {k.split(".", 1)[1]: v[i] for k, v in agreed.items() if k.startswith(name + ".")}
