"""HiCache construction and close are agreed across ranks, on ONE real 2-rank gloo group (20 s
collective timeout: a rank left waiting in a collective fails the test instead of stalling it).

In every fault check ONE rank fails (rank 1: a preflight check, a bad argument, an exception
inside its ``with HiCache(...)`` block, ``close(flush=False)``) and the other does not. Every
rank must raise at the same point: the failing rank its own error, the other ``PeerError``
naming rank 1 and what it raised (or ``DivergenceError`` at the step it was in). Nothing leaks:
no pool, thread or L3 store of a failed construction outlives it, every close stops its threads,
and the group still carries a further collective (no rank skipped or added one).
"""

import gc
import threading

import numpy as np
import pytest

from hicache.distributed import CollectiveCounter, launch
from hicache.errors import HiCacheError, UsageError

from helpers import make_cfg


def _usable(rank) -> bool:
    """A further collective completes with the expected result."""
    from hicache.distributed import min_across_ranks
    return min_across_ranks([rank, -rank, 7]) == [0, -1, 7]


class Boom(ValueError):
    """The engine's own error on one rank (not hicache's)."""


def _attempt(fn):
    """(error type name, message) of ``fn()``, or ("ok", result)."""
    try:
        return "ok", fn()
    except (HiCacheError, Boom) as e:
        return type(e).__name__, str(e)


def _threads() -> set:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def _live() -> dict:
    """Pools, transfer engines and L3 stores still alive after a collection."""
    from hicache.l1.pool import DeviceKVPool
    from hicache.l2.pool import HostKVPool
    from hicache.l2.transfer import TransferEngine
    from hicache.l3.guard import GuardedStore
    from hicache.service import HiCache
    gc.collect()
    kinds = (HiCache, DeviceKVPool, HostKVPool, TransferEngine, GuardedStore)
    out = {}
    for o in gc.get_objects():
        if isinstance(o, kinds):
            out[type(o).__name__] = out.get(type(o).__name__, 0) + 1
    return out


def _build(rank, cfg, **kw):
    """Construct on every rank; what each raised, with the threads left behind (checked while
    the error is still held, so nothing relies on a later collection)."""
    from hicache.service import HiCache
    before = _threads()
    with CollectiveCounter.measure() as n:
        try:
            cache = HiCache(cfg, rank, **kw)
            res = ("ok", "")
        except (HiCacheError, Boom) as e:
            cache, res = None, (type(e).__name__, str(e))
            res += (getattr(e, "rank", None),)
    out = {"res": res, "collectives": n["n"], "threads_left": sorted(_threads() - before)}
    if cache is not None:
        cache.close()
        out["threads_left"] = sorted(_threads() - before)
    del cache
    out["live"] = _live()
    out["usable"] = _usable(rank)
    return out


def _construction(rank, base):
    from hicache.config import HiCacheConfig
    from helpers import tiny_sections
    good = make_cfg(f"{base}/l3", dcp=2, l1_pages=16)
    out = {"ok": _build(rank, good, mode="l1+l2+l3")}
    # rank 1's preflight refuses its pools (more host memory than the node has); rank 0 built
    # everything (pools, transfer threads, L3 store and writer) by then
    d = tiny_sections(f"{base}/l3", dcp=2, l1_pages=16, model={"signature": "test-weights"},
                      l3={"size_bytes": 64 << 20})
    d["l2"] = {"size_bytes": 1 << 50}
    huge = HiCacheConfig.from_dict(d)
    out["preflight"] = _build(rank, huge if rank == 1 else good, mode="l1+l2+l3")
    # a bad argument on rank 1 only
    out["bad_arg"] = _build(rank, good, mode="l1+l2+l3" if rank == 0 else "l1+l4")
    # rank 1 built from another policy: both built, neither may run
    other = make_cfg(f"{base}/l3", dcp=2, l1_pages=16 + 4 * rank)
    out["settings"] = _build(rank, other, mode="l1+l2+l3")
    # ... or with another prefetch threshold (a policy key every rank decides alike by)
    other = make_cfg(f"{base}/l3", dcp=2, l1_pages=16, prefetch_min_tokens=4 + 4 * rank)
    out["policy"] = _build(rank, other, mode="l1+l2+l3")
    return out


def _work(cache, rng, n=3):
    """A few requests finished (backups and L3 writes in flight or queued)."""
    from helpers import admit_ready
    for i in range(n):
        prompt = rng.integers(0, 128, 17)
        admit_ready(cache, ("r", i), prompt)
        cache.step()
        cache.finish(("r", i), prompt)


def _exit(rank, base, fail_rank, how):
    """Both ranks run a ``with HiCache`` block; ``fail_rank`` leaves it ``how``: "raise" (an
    exception), "no_flush" (close(flush=False) inside), "step_other" (an exception while the
    other rank keeps stepping), "close_other" (a normal close while the other keeps stepping)."""
    from hicache.service import HiCache
    from test_faults import leaks
    before = _threads()
    cfg = make_cfg(f"{base}/l3", dcp=2, l1_pages=16, write="write_through")
    cache = HiCache(cfg, rank, mode="l1+l2+l3")
    rng = np.random.default_rng(7)
    out = {}

    def block():
        with cache:
            _work(cache, rng)
            if how == "both":
                raise Boom(f"rank {rank} engine error")
            if rank == fail_rank and how != "normal":
                if how in ("raise", "step_other"):
                    raise Boom(f"rank {rank} engine error")
                if how == "no_flush":
                    cache.close(flush=False)
                return "closed_early"  # "close_other": leave normally, at once
            if how in ("step_other", "close_other"):
                for _ in range(3):  # the other rank is gone from the steps
                    cache.step()
            return "left"

    with CollectiveCounter.measure() as n:
        out["res"] = _attempt(block)
    out["collectives"] = n["n"]
    out["closed"] = cache._closed
    out["inflight"] = len(cache.ctrl.inflight_ops())
    out["leaks"] = leaks(cache)
    out["threads_left"] = sorted(_threads() - before)
    out["usable"] = _usable(rank)
    return out


def _exits(rank, base):
    return {how: _exit(rank, base, 1, how)
            for how in ("normal", "raise", "no_flush", "step_other", "close_other", "both")}


def _group(rank, world, base):
    return {"construction": _construction(rank, base), "exit": _exits(rank, base)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lifecycle")
    # a 20 s collective timeout: a rank left waiting in a collective fails the test quickly
    return launch(2, _group, str(base), timeout_s=20)


def _no_leak(r):
    assert r["threads_left"] == [], r
    assert r["live"] == {}, r
    assert r["usable"]


def test_a_good_construction_takes_one_small_collective(runs):
    for r in runs:
        c = r["construction"]["ok"]
        assert c["res"] == ("ok", "") and c["collectives"] == 1
        _no_leak(c)


def test_a_preflight_failure_on_one_rank_raises_on_every_rank_at_construction(runs):
    r0, r1 = (r["construction"]["preflight"] for r in runs)
    assert r1["res"][0] == "HostMemoryError", r1
    kind, msg, peer = r0["res"]
    assert kind == "PeerError" and peer == 1, r0
    # the failing rank's message travelled: the others say what failed, not only where
    assert "HiCache construction: rank 1 failed (HostMemoryError: memory:" in msg
    assert r0["collectives"] == r1["collectives"] == 2  # the checkpoint, then the gather
    _no_leak(r0)  # rank 0 had built its pools, transfer threads and L3 store: all closed
    _no_leak(r1)


def test_a_bad_argument_on_one_rank_raises_on_every_rank_at_construction(runs):
    r0, r1 = (r["construction"]["bad_arg"] for r in runs)
    assert r1["res"][0] == "UsageError" and "unknown mode 'l1+l4'" in r1["res"][1]
    assert r0["res"][0] == "PeerError" and r0["res"][2] == 1
    assert "UsageError: unknown mode" in r0["res"][1]
    _no_leak(r0)
    _no_leak(r1)


def test_ranks_built_from_different_settings_refuse_to_run_alike(runs):
    for r in runs:
        for case in ("settings", "policy"):
            s = r["construction"][case]
            assert s["res"][0] == "DivergenceError" and "settings differ" in s["res"][1]
            _no_leak(s)


def _exit_no_leak(e):
    assert e["closed"], e
    assert e["leaks"] == {}, e
    assert e["threads_left"] == [], e
    assert e["usable"]


def test_a_normal_exit_agrees_then_flushes_on_every_rank(runs):
    e0, e1 = (r["exit"]["normal"] for r in runs)
    assert e0["res"] == e1["res"] == ("ok", "left")
    assert e0["inflight"] == e1["inflight"] == 0  # drained: every backup applied
    assert e0["collectives"] == e1["collectives"]
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_an_exception_on_one_rank_makes_the_others_skip_the_flush_and_raise(runs):
    e0, e1 = (r["exit"]["raise"] for r in runs)
    assert e1["res"] == ("Boom", "rank 1 engine error")  # its own error goes on
    assert e0["res"][0] == "PeerError", e0
    assert "HiCache close: rank 1 failed (a ValueError)" in e0["res"][1]
    assert e0["collectives"] == e1["collectives"]  # the same collectives, none waiting alone
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_close_without_flush_on_one_rank_is_agreed(runs):
    e0, e1 = (r["exit"]["no_flush"] for r in runs)
    assert e1["res"] == ("ok", "closed_early")
    assert e0["res"][0] == "PeerError" and "close(flush=False)" in e0["res"][1]
    assert e0["collectives"] == e1["collectives"]
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_an_exception_while_the_other_rank_steps_stops_that_step(runs):
    e0, e1 = (r["exit"]["step_other"] for r in runs)
    assert e1["res"][0] == "Boom"
    assert e0["res"][0] == "DivergenceError", e0
    assert "rank 1 is closing its HiCache after a ValueError" in e0["res"][1]
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_a_normal_close_while_the_other_rank_steps_stops_both(runs):
    e0, e1 = (r["exit"]["close_other"] for r in runs)
    assert e0["res"][0] == "DivergenceError" and "closing its HiCache" in e0["res"][1]
    assert e1["res"][0] == "DivergenceError" and "still stepping" in e1["res"][1]
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_an_exception_on_every_rank_raises_each_its_own(runs):
    e0, e1 = (r["exit"]["both"] for r in runs)
    assert e0["res"] == ("Boom", "rank 0 engine error")
    assert e1["res"] == ("Boom", "rank 1 engine error")
    assert e0["collectives"] == e1["collectives"]
    _exit_no_leak(e0)
    _exit_no_leak(e1)


def test_fault_codes_name_the_exception_class():
    import torch

    from hicache import minvec, outcome
    from hicache.controller.agreement import FAULTS
    from hicache.errors import HostMemoryError, L3ForeignError, PeerError
    codes = [outcome.EXIT_BASE + i for i in range(len(outcome.KINDS))]
    assert max(codes) < minvec.FAULT_CODES and not set(codes) & set(FAULTS)
    assert outcome.SKIP_FLUSH not in FAULTS and outcome.SKIP_FLUSH not in codes
    assert outcome.describe(outcome.code_of(Boom("x"))) == "a ValueError"  # nearest listed base
    assert outcome.describe(outcome.code_of(HostMemoryError("x"))) == "a HostMemoryError"
    assert outcome.describe(outcome.code_of(L3ForeignError("x"))) == "a L3ForeignError"
    assert outcome.describe(outcome.code_of(KeyboardInterrupt())) == "a KeyboardInterrupt"
    assert outcome.describe(outcome.code_of(torch.OutOfMemoryError("x"))) == "a RuntimeError"

    class ValueError(Exception):  # a class that merely shares a builtin's name
        pass
    assert outcome.describe(outcome.code_of(ValueError())) == "an Exception"
    assert outcome.describe(3) is None
    e = PeerError("HiCache close", 3, "a ValueError")
    assert (e.where, e.rank, e.what) == ("HiCache close", 3, "a ValueError")
    assert str(e) == "HiCache close: rank 3 failed (a ValueError); every rank stops here"


def test_alone_nothing_is_communicated(tmp_path):
    from hicache.service import HiCache
    cfg = make_cfg(tmp_path / "l3", l1_pages=8)
    with CollectiveCounter.measure() as n:
        with pytest.raises(Boom):
            with HiCache(cfg, 0, mode="l1+l2+l3"):
                raise Boom("x")
        with pytest.raises(UsageError, match="unknown mode"):  # raised as it is
            HiCache(cfg, 0, mode="nope")
    assert n["n"] == 0
