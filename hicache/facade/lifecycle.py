"""The agreed points of a ``HiCache``'s life (``hicache.service``): its construction (one
checkpoint: a failure on any rank is raised on every rank, what was built is closed) and its
close (whether every rank flushes), plus the constructor's argument checks, its pools and the
digest of the settings every rank must share.

Each agreement is one fixed-size all-reduce (``hicache.outcome`` / ``minvec``), so a rank that
fails here makes every rank raise at the same point instead of leaving them in a collective.
"""

from __future__ import annotations

import hashlib

from hicache import distributed as hd
from hicache import minvec, outcome, preflight
from hicache.companions import memory_need
from hicache.config import HiCacheConfig
from hicache.controller import StepAgreement
from hicache.errors import ConfigError, DivergenceError, PeerError, UsageError
from hicache.l1.pool import DeviceKVPool, pick_device
from hicache.l2.pool import HostKVPool
from hicache.tenancy import close_events

CACHE_MODES = {"recompute": (), "l1": ("l1",), "l1+l2": ("l1", "l2"),
               "l1+l2+l3": ("l1", "l2", "l3")}
__all__ = ["CACHE_MODES", "agree_close", "agree_construction", "build_pools", "check_args",
           "discard", "settings_digest"]


def agree_construction(cache, error: BaseException | None, group, world: int,
                       debug: bool) -> None:
    """Construction is agreed: whatever failed on one rank (``error``: a preflight check, a
    pool, the L3 store, a bad argument), every rank still takes the construction's
    collectives (the control group, then one checkpoint) and then every rank raises at that
    point; what was built is closed on every rank."""
    try:
        # the control plane runs on CPU tensors: over a gloo twin of an NCCL group (made
        # once, by every rank: a collective of its own under NCCL)
        cache.control_group = hd.control_group(group) if world > 1 else group
        digest = 0
        if error is None:
            cache.agreement = StepAgreement(group=cache.control_group, debug=debug,
                                            local=world == 1)
            digest = cache._settings_digest()
        h = outcome.checkpoint("HiCache construction", error, group,
                               header=[digest, -digest], detail=True)
        if h[0] != -h[1]:
            raise DivergenceError(
                "HiCache construction: the ranks' replicated settings differ (mode, page "
                "size, L1/L2 pages, policy, debug: the controllers would diverge); build "
                "every rank's HiCache from the same policy file")
    except BaseException:
        cache._discard()
        raise


def check_args(config: HiCacheConfig, world: int, mode: str | None,
                replica: tuple[int, int], weights_signature: str | None
                ) -> tuple[str, str]:
    """The constructor's arguments checked against the config (UsageError, ConfigError):
    the mode and weights signature, defaults filled in."""
    if mode is None:
        mode = "l1+l2+l3" if config.l3.enabled else "l1+l2"
    if mode not in CACHE_MODES:
        raise UsageError(f"unknown mode {mode!r}; expected one of {', '.join(CACHE_MODES)}")
    if weights_signature is None:
        weights_signature = config.model.signature or checkpoint_signature(config, mode)
    if not isinstance(weights_signature, str):
        raise UsageError(f"weights_signature must be a str, got {weights_signature!r}")
    if "l3" in CACHE_MODES[mode] and not weights_signature:
        raise ConfigError(
            "model.signature: L3 is enabled but no weights signature is set, so another "
            "checkpoint of the same shapes could be served this one's KV; set [model] "
            "signature (a checkpoint hash or revision) or pass HiCache(weights_signature=...)")
    if world != config.parallel.dcp:
        raise UsageError(f"the process group has {world} ranks but parallel.dcp is "
                         f"{config.parallel.dcp}: one HiCache per DCP rank")
    if not (len(replica) == 2 and 0 <= replica[0] < replica[1]):
        raise UsageError(f"replica must be (id, count) with 0 <= id < count, got {replica}")
    return mode, weights_signature


def checkpoint_signature(config: HiCacheConfig, mode: str) -> str:
    """With L3 on and no signature given, the checkpoint ``[model] path`` names (by content,
    never by path: the engine's own ``MLAModel.weights_signature()`` for it); else ""."""
    if not config.model.path or "l3" not in CACHE_MODES[mode]:
        return ""
    from hicache.checkpoints.signature import weights_signature
    return f"mla-file:{weights_signature(config.model.path)}"


def agree_close(cache, flush: bool, error: BaseException | None) -> bool:
    """Whether every rank flushes (the same answer on every rank), raising ``PeerError`` on
    a rank that closes normally when another does not. One all-reduce, of the same size as
    every agreement's (``minvec.CLOSE``): a rank still stepping gets the closing rank's
    fault (or the close kind) and raises ``DivergenceError`` at that step, instead of a
    mismatched collective."""
    if cache._failed is not None:  # stopped at an agreed step: alike on every rank
        return False
    a = cache.agreement
    if a.local:
        return flush and error is None
    code = outcome.code_of(error) if error is not None else 0 if flush else \
        outcome.SKIP_FLUSH
    try:
        res = hd.agree_min_on(a._ctl, a.rank, (), (), code=code, kind=minvec.CLOSE)
    except hd.KindMismatch as e:
        if code:  # this rank is failing already: its own error goes on
            return False
        if e.other == minvec.STEP:
            raise DivergenceError("HiCache close: another rank is still stepping while "
                                  "this rank closes; every rank stops here (no flush)"
                                  ) from None
        raise hd.KindMismatch(e.kind, e.rank, e.other, e.other_rank, e.fault,
                              where="HiCache close") from None
    except Exception:
        if code:
            return False
        raise
    if code:
        return False
    if res.fault is not None:
        rank, first = res.fault
        raise PeerError("HiCache close", rank,
                        outcome.describe(first) or f"fault {first}") from None
    return True


def build_pools(cache, config: HiCacheConfig, rank: int, device) -> int:
    """Preflight checks, then ``cache``'s L1 and L2 pools on this rank (``cache.l1``,
    ``cache.l2``, ``cache.layout``, ``cache.page_tokens``); the L2 pages the controller
    manages (0 without an L2 tier)."""
    # the checks check-config and hicache-bench run (engine needs aside); this rank's pools
    machine = preflight.Machine.detect()
    preflight.validate(config, tiers=cache.tiers, ranks=1, engine=False, machine=machine)
    cache.layout = config.layout(rank)
    cache.page_tokens = cache.layout.page_tokens
    host_pages = config.l2_num_pages if "l2" in cache.tiers else 0
    # every rank of this node pins its L2 (and holds its L1 when that is on the host):
    # together against the node's total, since its siblings may have allocated already
    need = preflight.memory_need(config, hd.local_world_size(), l2="l2" in cache.tiers,
                                 cuda=pick_device(device).type != "cpu")
    need = memory_need(need, config, cache.draft_spec, host_pages)  # companions' pools
    preflight.check_node_memory(need, machine.host_total, "is the node's total")
    fmt = config.page_format  # every pool size below is the format's
    cache.l1 = DeviceKVPool.for_format(cache.layout, fmt, config.l1.num_pages, device=device)
    cache.l2 = HostKVPool.for_format(cache.layout, fmt, max(host_pages, 1),
                                    layout_kind=config.l2.layout, pin=config.l2.pin)
    return host_pages


def settings_digest(cache) -> int:
    """A 60-bit hash of what the replicated controller depends on (equal on every rank)."""
    c, p = cache.config, cache.config.policy
    key = (cache.mode, cache.page_tokens, c.l1.num_pages, cache.ctrl.host.num_pages,
           repr(p), cache.agreement.debug,  # the whole [policy]: every key drives a
           cache.weights_signature if cache.l3 is not None else "",  # replicated choice
           repr(c.hybrid), tuple(x.signature for x in cache.companions))
    raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 4


def close_local(cache) -> None:
    """This rank's part of closing, no collective: events, copies, writer (its queued L3 writes
    land), prefetcher, store, companions; their threads stop. ``HiCache.close`` ends with it,
    and ``hicache.at_exit`` runs it for a cache still open at interpreter exit (the other ranks
    are not told: they may be gone)."""
    cache._closed = True
    close_events(cache.events, cache.ctrl)
    cache.io.close()  # copies stop before the pools go; failures were reported already
    for c in cache.companions:
        c.close()


def discard(cache) -> None:
    """Construction failed (on some rank): close what this rank built, drop its pools."""
    io, cache.io = cache.io, None
    if io is not None:
        io.close()
    close_events(getattr(cache, "events", None), None)
    for part in cache.companions:  # their pools, copies, writers and stores
        part.close()
    cache.companions = []
    cache.l1 = cache.l2 = cache.ctrl = cache.transfer = None
