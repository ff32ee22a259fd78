"""The two-rank embedded-API sequence, run again and again (issue 34 point 7): divergent admits,
allocs and a finish on one rank make the agreement raise on both ranks; each run's ranks close
their caches, leave no hicache thread behind, and exit with their results (a rank lost to a
signal, e.g. SIGABRT from a joinable thread destroyed at exit, fails the run with RankError)."""

import threading

from hicache.distributed import launch
from hicache.errors import DivergenceError

from helpers import make_cfg
from test_agreement_contents import CASES

REPS = 4


def _sequence(rank, world, base):
    from hicache.service import HiCache
    out = {}
    for name, fn in CASES.items():
        cache = HiCache(make_cfg(f"{base}/{name}", dcp=2, l1_pages=16), rank, mode="l1+l2")
        fn(cache, rank)
        try:
            cache.step()
            out[name] = "ok"
        except DivergenceError:
            out[name] = "DivergenceError"
        for rid in list(cache._reqs):
            cache.abort(rid)
        cache.close()
    out["threads"] = sorted(t.name for t in threading.enumerate()
                            if t is not threading.main_thread() and t.is_alive())
    return out


def test_the_two_rank_sequence_exits_cleanly_every_run(tmp_path):
    for i in range(REPS):
        runs = launch(2, _sequence, str(tmp_path / f"run{i}"), timeout_s=30)
        for rank, r in enumerate(runs):
            assert r.pop("threads") == [], (i, rank)
            assert r == {"admit_tokens": "DivergenceError", "admit_rid": "DivergenceError",
                         "alloc_len": "DivergenceError", "finish_tokens": "DivergenceError",
                         "same": "ok"}, (i, rank, r)
