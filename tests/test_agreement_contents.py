"""The per-step agreement compares what each rank did, not only how many ops it has in flight
(issue 27, point 3), on ONE real 2-rank gloo group with a 20 s collective timeout.

In each case rank 1 alone does something else (admits other tokens, another request id,
allocates another length, finishes other tokens): the next ``step`` raises ``DivergenceError``
on BOTH ranks naming the first event that differs, the caches stop alike and leak nothing, and
the group still carries a collective. Ranks that did the same pay one collective per step.
"""

import numpy as np
import pytest

from hicache.distributed import CollectiveCounter, launch
from hicache.errors import DivergenceError

from helpers import make_cfg, write_kv_rows


def _usable(rank) -> bool:
    from hicache.distributed import min_across_ranks
    return min_across_ranks([rank, -rank, 7]) == [0, -1, 7]


PROMPT = np.random.default_rng(0).integers(0, 128, 17)
OTHER = PROMPT.copy()
OTHER[5] += 1


def _admit_tokens(cache, rank):
    cache.admit("a", OTHER if rank else PROMPT)


def _admit_rid(cache, rank):
    cache.admit("b" if rank else "a", PROMPT)


def _alloc_len(cache, rank):
    cache.admit("a", PROMPT)
    cache.step()
    cache.alloc("a", 40 if rank else 17)


def _finish_tokens(cache, rank):
    cache.admit("a", PROMPT)
    cache.step()
    cache.alloc("a", 17)
    write_kv_rows(cache, "a", 17)
    cache.step()
    cache.finish("a", PROMPT[:9] if rank else PROMPT[:8])


def _same(cache, rank):
    cache.admit("a", PROMPT)
    cache.alloc("a", 17)
    write_kv_rows(cache, "a", 17)
    cache.finish("a", PROMPT)


CASES = {"admit_tokens": _admit_tokens, "admit_rid": _admit_rid, "alloc_len": _alloc_len,
         "finish_tokens": _finish_tokens, "same": _same}


def _group(rank, world, base):
    from hicache.service import HiCache
    from test_faults import leaks
    out = {}
    for name, fn in CASES.items():
        cache = HiCache(make_cfg(f"{base}/{name}", dcp=2, l1_pages=16), rank, mode="l1")
        fn(cache, rank)
        with CollectiveCounter.measure() as n:
            try:
                res = "ok", cache.step()
            except DivergenceError as e:
                res = "DivergenceError", str(e)
        for rid in list(cache._reqs):
            cache.abort(rid)
        out[name] = {"res": res, "collectives": n["n"], "steps": cache._stats.steps,
                     "leaks": leaks(cache), "stopped": cache._failed is not None}
        cache.close()
        out[name]["usable"] = _usable(rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(2, _group, str(tmp_path_factory.mktemp("contents")), timeout_s=20)


WANT = {  # what the message names: the first event that differs on each rank
    "admit_tokens": ("admit('a', 17, ", "admit('a', 17, "),
    "admit_rid": ("admit('a', 17", "admit('b', 17"),
    "alloc_len": ("alloc('a', 17, 3)", "alloc('a', 40, 5)"),
    "finish_tokens": ("finish('a', 8, ", "finish('a', 9, "),
}


@pytest.mark.parametrize("name", list(WANT))
def test_ranks_that_did_different_things_raise_at_the_same_step_naming_it(runs, name):
    r0, r1 = (r[name] for r in runs)
    assert r0["res"][0] == r1["res"][0] == "DivergenceError", (r0, r1)
    assert r0["res"][1] == r1["res"][1]  # the same message on every rank
    msg = r0["res"][1]
    first, second = WANT[name]
    assert f"on rank 0 is {first}" in msg and f"on rank 1 {second}" in msg, msg
    assert r0["steps"] == r1["steps"]
    assert r0["stopped"] and r1["stopped"]
    assert r0["leaks"] == r1["leaks"] == {}
    assert r0["usable"] and r1["usable"]


def test_other_tokens_of_the_same_length_are_named_by_their_digests(runs):
    msg = runs[0]["admit_tokens"]["res"][1]
    d0 = msg.split("on rank 0 is admit('a', 17, ")[1].split(")")[0]
    d1 = msg.split("on rank 1 admit('a', 17, ")[1].split(")")[0]
    assert d0 != d1


def test_ranks_that_did_the_same_pay_one_collective_and_go_on(runs):
    r0, r1 = (r["same"] for r in runs)
    assert r0["res"] == r1["res"] == ("ok", [])
    assert r0["collectives"] == r1["collectives"] == 1
    assert not r0["stopped"] and r0["leaks"] == r1["leaks"] == {}
