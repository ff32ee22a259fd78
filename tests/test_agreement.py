"""Cross-rank agreement under divergence, on ONE real 2-rank gloo group (20 s collective timeout:
a mismatched or missing collective fails the test instead of stalling it).

In every fault check only rank 1 diverges (an extra op, a missing op, more extras, bad done ids,
more ops than the vector's capacity, a missing debug digest, ...). Both ranks must raise
``DivergenceError`` at the same step, and the group must still carry a further collective: proof
that no rank issued a collective of another size or skipped one. HiCache stops alike on both
ranks when its agreement raises, and leaks nothing.
"""

import numpy as np
import pytest

from hicache.distributed import CollectiveCounter, launch
from hicache.errors import DivergenceError, L3Error

from helpers import write_kv_rows, make_cfg


def _usable(rank) -> bool:
    """A further collective completes with the expected result."""
    from hicache.distributed import min_across_ranks
    return min_across_ranks([rank, -rank, 7]) == [0, -1, 7]


def _attempt(fn):
    """(error type name, message) of ``fn()``, or ("ok", result)."""
    try:
        return "ok", fn()
    except (DivergenceError, L3Error) as e:
        return type(e).__name__, str(e)


# rank 0's and rank 1's arguments of one step: (op ids, done, extras, digest)
FAULTS = {
    "extra_op": (([1, 2], {1}, [5]), ([1, 2, 3], {1}, [5])),
    "missing_op": (([1, 2], {1}, [5]), ([1], {1}, [5])),
    "same_count_other_ops": (([1, 2], set(), []), ([1, 3], set(), [])),
    "more_extras": (([4], set(), [5, 6]), ([4], set(), [5, 6, 7])),
    "bad_done_ids": (([4, 6], {4}, []), ([4, 6], {9}, [])),
    "not_ascending": (([4, 6], set(), []), ([6, 4], set(), [])),
    "flag_count": (([4, 6], [True, False], []), ([4, 6], [True], [])),
    "extra_too_big": (([4], set(), [1]), ([4], set(), [1 << 70])),
    "over_capacity_on_one_rank": ((list(range(3)), {0}, [1]), (list(range(200)), {0}, [1])),
}


def _faults(rank):
    from hicache.controller import StepAgreement
    out = {}
    for name, args in FAULTS.items():
        a = StepAgreement()
        a.step([1], {1}, [0])  # one good step first
        op_ids, done, extras = args[rank]
        with CollectiveCounter.measure() as n:
            kind, msg = _attempt(lambda: a.step(op_ids, done, extras))
        out[name] = {"kind": kind, "msg": msg, "steps": a.steps, "collectives": n["n"],
                     "usable": _usable(rank)}
    return out


def _overflow(rank):
    """Every rank has more ops + extras than the capacity: the rest rides a second, agreed-size
    collective; a step that fits takes one."""
    from hicache.controller import StepAgreement
    a = StepAgreement()
    ops = list(range(0, 300, 2))                     # 150 ops
    done = {o for o in ops if rank == 0 or o % 4 == 0}
    extras = [1000 * rank + i for i in range(40)]
    with CollectiveCounter.measure() as big:
        res = a.step(ops, done, extras)
    with CollectiveCounter.measure() as small:
        small_res = a.step(ops[:10], set(ops[:10]), [rank])
    return {"done": res.done_ops, "extras": res.extras, "big": big["n"], "small": small["n"],
            "small_res": tuple(small_res), "usable": _usable(rank)}


def _debug(rank):
    from hicache.controller import StepAgreement
    out = {}
    a = StepAgreement(debug=True)
    with CollectiveCounter.measure() as n:
        out["same"] = _attempt(lambda: a.step([1], {1}, [], digest=[("clock", 3), ("node", 1)]))
    out["same_collectives"] = n["n"]  # equal digests: no gather
    out["differ"] = _attempt(lambda: a.step([1], set(), [], digest=[("clock", 3),
                                                                    ("node", 1 + rank)]))
    out["missing"] = _attempt(lambda: a.step([1], set(), [], digest=None if rank else [1]))
    out["unpicklable"] = _attempt(lambda: a.step([1], set(), [],
                                                 digest=(lambda: 0) if rank else [1]))
    b = StepAgreement(debug=rank == 0)  # debug on one rank only: no lone gather
    out["mixed"] = _attempt(lambda: b.step([1], set(), [], digest=[1]))
    out["usable"] = _usable(rank)
    return out


def _helpers(rank):
    from hicache.distributed import min_across_ranks
    from hicache.l3 import agree_prefetch, restore_lengths
    out = {"min_len": _attempt(lambda: min_across_ranks([1, 2] + [3] * rank)),
           "min_value": _attempt(lambda: min_across_ranks([1, "x" if rank else 2])),
           "restore_bad": _attempt(lambda: restore_lengths([8, -1 if rank else 8], 4)),
           "restore_len": _attempt(lambda: restore_lengths([8] * (1 + rank), 4)),
           "restore_ok": _attempt(lambda: restore_lengths([9 + 4 * rank, 30 - 4 * rank], 4)),
           "prefetch_len": _attempt(lambda: agree_prefetch([], group=None)
                                    if rank == 0 else agree_prefetch_one()),
           "usable": _usable(rank)}
    return out


def agree_prefetch_one():
    """agree_prefetch over one finished handle (rank 1) vs none (rank 0)."""
    from hicache.l3 import agree_prefetch
    from hicache.l3.prefetch import PrefetchHandle, PrefetchPolicy
    h = PrefetchHandle("r", [], 4, PrefetchPolicy("best_effort"))
    h._finished.set()
    return agree_prefetch([h])


def _service(rank, base):
    """Rank 1 alone finishes a request (write_through: a backup only it has in flight): the next
    step raises DivergenceError on both ranks, the cache stops alike, nothing leaks."""
    from hicache.service import HiCache
    from test_faults import leaks
    cfg = make_cfg(f"{base}/svc", dcp=2, l1_pages=16)
    prompt = np.random.default_rng(0).integers(0, 128, 17)
    cache = HiCache(cfg, rank, mode="l1+l2")
    cache.admit("a", prompt)
    cache.step()
    cache.alloc("a", len(prompt))
    write_kv_rows(cache, "a", len(prompt))
    cache.admit("b", prompt[:9])
    if rank == 1:
        cache.finish("a", prompt)
    kind, msg = _attempt(cache.step)
    out = {"step": (kind, msg), "steps": cache._stats.steps}
    if rank == 0:
        cache.finish("a", prompt)  # stopped: only releases
    cache.abort("b")
    out["after"] = [_attempt(lambda: cache.admit("c", prompt)), _attempt(cache.step),
                    _attempt(cache.drain)]
    out["leaks"] = leaks(cache)
    cache.close()
    out["closed"] = cache._closed
    out["usable"] = _usable(rank)
    return out


def _server(rank, base):
    """The same divergence inside Server.run: the requests it was running are released."""
    import torch

    from hicache.engine.model import MLAModel
    from hicache.serving import Server, model_config
    from hicache.service import HiCache
    from test_faults import leaks, req
    cfg = make_cfg(f"{base}/srv", dcp=2, l1_pages=16)
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    cache = HiCache(cfg, rank, mode="l1+l2")
    server = Server(model, cache, chunk_tokens=16)
    real = cache.agreement.step
    calls = []

    def step(op_ids, done, extras=(), digest=None):  # rank 1 sends one extra too many, once
        calls.append(1)
        more = [0] if rank == 1 and len(calls) == 2 else []
        return real(op_ids, done, list(extras) + more, digest)
    cache.agreement.step = step
    rng = np.random.default_rng(1)
    kind, msg = _attempt(lambda: server.run([req(i, rng.integers(0, 128, 21), out=3)
                                             for i in range(2)]))
    out = {"run": (kind, msg), "steps": cache._stats.steps, "leaks": leaks(cache),
           "admitted": len(cache._reqs)}
    cache.close()
    out["usable"] = _usable(rank)
    return out


def _kinds(rank):
    """The ranks meet in agreements of different kinds: one collective of one size, then both
    raise DivergenceError naming both kinds (never a mismatched collective: gloo would abort)."""
    import torch

    from hicache import outcome
    from hicache.controller import StepAgreement
    from hicache.distributed import min_across_ranks
    from hicache.l3 import restore_lengths
    from hicache.pcp.prefill import PCP_MODES, _agree_prompt
    step = StepAgreement()
    pairs = {  # name -> (rank 0's agreement, rank 1's)
        "checkpoint_vs_step": (
            lambda: outcome.checkpoint("HiCache construction", None, None, header=[5, -5]),
            lambda: step.step([1, 2], {1}, [3])),
        "min_vs_step": (lambda: min_across_ranks([1, 2]), lambda: step.step([], set(), [])),
        "pcp_vs_restore": (
            lambda: _agree_prompt("PCP prefill", None, torch.arange(5), PCP_MODES[0], None),
            lambda: restore_lengths([8, 12], 4)),
    }
    out = {}
    for name, fns in pairs.items():
        with CollectiveCounter.measure() as n:
            try:
                res = "ok", fns[rank]()
            except DivergenceError as e:  # KindMismatch is one
                res = "DivergenceError", str(e)
        out[name] = {"res": res, "collectives": n["n"], "usable": _usable(rank)}
    out["step_after"] = _attempt(lambda: tuple(step.step([4], {4}, [rank])))
    return out


def _group(rank, world, base):
    return {"faults": _faults(rank), "overflow": _overflow(rank), "debug": _debug(rank),
            "helpers": _helpers(rank), "kinds": _kinds(rank), "service": _service(rank, base),
            "server": _server(rank, base)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("agreement")
    # a 20 s collective timeout: a rank left waiting in a collective fails the test quickly
    return launch(2, _group, str(base), timeout_s=20)


@pytest.mark.parametrize("name", list(FAULTS))
def test_one_diverging_rank_makes_every_rank_raise_at_the_same_step(runs, name):
    r0, r1 = (r["faults"][name] for r in runs)
    assert r0["kind"] == r1["kind"] == "DivergenceError", (r0, r1)
    assert "step 1" in r0["msg"] and "step 1" in r1["msg"]
    assert r0["steps"] == r1["steps"] == 2  # both counted the failed step
    assert r0["collectives"] == r1["collectives"] == 1  # one fixed-size all-reduce, no second
    assert r0["usable"] and r1["usable"]  # the group carries the next collective


def test_the_rank_with_bad_arguments_says_what_was_wrong_and_the_other_names_it(runs):
    f0, f1 = runs[0]["faults"], runs[1]["faults"]
    assert "not in flight" in f1["bad_done_ids"]["msg"] and "this rank" in f1["bad_done_ids"]["msg"]
    assert "rank 1 passed bad arguments (done ids that are not in flight)" in \
        f0["bad_done_ids"]["msg"]
    assert "strictly ascending" in f1["not_ascending"]["msg"]
    assert "rank 1" in f0["not_ascending"]["msg"] and "ascending" in f0["not_ascending"]["msg"]
    assert "1 done flags for 2" in f1["flag_count"]["msg"]
    assert "does not fit in int64" in f1["extra_too_big"]["msg"]
    assert "not an int64" in f0["extra_too_big"]["msg"]
    for r in runs:  # a length divergence names the min/max over ranks
        assert "ops 3/200" in r["faults"]["over_capacity_on_one_rank"]["msg"]
        assert "extras 2/3" in r["faults"]["more_extras"]["msg"]


def test_a_step_over_capacity_on_every_rank_takes_a_second_agreed_collective(runs):
    r0, r1 = (r["overflow"] for r in runs)
    ops = list(range(0, 300, 2))
    assert r0["done"] == r1["done"] == tuple(o for o in ops if o % 4 == 0)
    assert r0["extras"] == r1["extras"] == tuple(range(40))
    assert r0["big"] == r1["big"] == 2 and r0["small"] == r1["small"] == 1
    assert r0["small_res"] == r1["small_res"] == (tuple(range(0, 20, 2)), (0,), 1)
    assert r0["usable"] and r1["usable"]


def test_debug_mode_compares_digests_and_refuses_a_missing_one_on_every_rank(runs):
    d0, d1 = (r["debug"] for r in runs)
    assert d0["same"][0] == d1["same"][0] == "ok"
    assert d0["same_collectives"] == d1["same_collectives"] == 1  # a hash, no gather
    for d in (d0, d1):
        assert d["differ"][0] == "DivergenceError" and "digest entry 1" in d["differ"][1]
        assert d["missing"][0] == "DivergenceError" and "step 2" in d["missing"][1]
        assert d["unpicklable"][0] == "DivergenceError" and "step 3" in d["unpicklable"][1]
        assert d["mixed"][0] == "DivergenceError" and "debug mode" in d["mixed"][1]
        assert d["usable"]
    assert "needs a digest" in d1["missing"][1] and "no debug digest" in d0["missing"][1]
    assert "cannot be pickled" in d1["unpicklable"][1]


def test_min_helpers_raise_on_every_rank_instead_of_a_mismatched_collective(runs):
    h0, h1 = (r["helpers"] for r in runs)
    for h in (h0, h1):
        assert h["min_len"][0] == "DivergenceError" and "between 2 and 3" in h["min_len"][1]
        assert h["min_value"][0] == "DivergenceError" and "rank 1" in h["min_value"][1]
        assert h["restore_bad"][0] == "L3Error"
        assert h["restore_len"][0] == "DivergenceError"
        assert h["restore_ok"] == ("ok", [8, 24])
        assert h["prefetch_len"][0] == "DivergenceError"
        assert h["usable"]
    assert ">= 0" in h1["restore_bad"][1] or "local storage-hit" in h1["restore_bad"][1]
    assert "rank 1 passed a bad storage-hit length" in h0["restore_bad"][1]


@pytest.mark.parametrize("name,kinds", [
    ("checkpoint_vs_step", ("a checkpoint", "a step agreement")),
    ("min_vs_step", ("a plain min_across_ranks", "a step agreement")),
    ("pcp_vs_restore", ("a PCP check", "restore_lengths"))])
def test_ranks_in_agreements_of_different_kinds_raise_naming_both(runs, name, kinds):
    for rank, r in enumerate(runs):
        got = r["kinds"][name]
        assert got["res"][0] == "DivergenceError", got
        mine, other = kinds[rank], kinds[1 - rank]
        assert f"rank {1 - rank} is in {other} while this rank (rank {rank}) is in {mine}" \
            in got["res"][1], got
        assert got["collectives"] == 1  # one collective of one size, no second
        assert got["usable"]  # the group carries the next collective
    assert "PCP prefill" in runs[0]["kinds"]["pcp_vs_restore"]["res"][1]
    assert "step 0" in runs[1]["kinds"]["checkpoint_vs_step"]["res"][1]
    # then a step agrees as usual (rank 1's agreement counted its two refused steps)
    assert [r["kinds"]["step_after"] for r in runs] == [("ok", ((4,), (0,), 0)),
                                                         ("ok", ((4,), (0,), 2))]


def test_hicache_stops_alike_on_every_rank_when_its_agreement_diverges(runs):
    s0, s1 = (r["service"] for r in runs)
    assert s0["step"][0] == s1["step"][0] == "DivergenceError"
    assert s0["steps"] == s1["steps"]
    for s in (s0, s1):
        assert [k for k, _ in s["after"]] == ["DivergenceError"] * 3
        assert all("stopped" in m for _, m in s["after"])
        assert s["leaks"] == {}
        assert s["closed"] and s["usable"]


def test_a_divergence_inside_server_run_releases_its_requests_on_every_rank(runs):
    v0, v1 = (r["server"] for r in runs)
    assert v0["run"][0] == v1["run"][0] == "DivergenceError"
    assert v0["steps"] == v1["steps"]
    assert v0["admitted"] == v1["admitted"] == 0
    assert v0["leaks"] == v1["leaks"] == {}
    assert v0["usable"] and v1["usable"]


def test_agreement_benchmark_json():
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "agreement.py"), "--quick", "--json",
                        "--steps", "5", "--reps", "1"], capture_output=True, text=True,
                       timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["case"]: row for row in out["results"]}
    assert set(rows) == {"typical", "busy", "over_capacity", "debug"}
    assert [rows[c]["collectives"] for c in ("typical", "busy", "over_capacity", "debug")] == \
        [1, 1, 2, 1]  # one fixed-size all-reduce; a second only past the 64 slots
    for row in rows.values():
        assert row["agreement_us"] > 0 and row["baseline_us"] > 0
        assert abs(row["ratio"] - row["agreement_us"] / row["baseline_us"]) < 0.01
    bad = subprocess.run([sys.executable, str(root / "bench" / "agreement.py"), "--steps", "0"],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert bad.returncode == 2 and "--steps" in bad.stderr
