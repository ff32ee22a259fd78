"""Real 2-rank (gloo) agreement: one rank's transfers lag, trees must stay identical."""

import hashlib

import numpy as np

from hicache.controller import CacheController, StepAgreement
from hicache.distributed import CollectiveCounter, launch
from hicache.errors import DeviceFullError, DivergenceError

PT = 4


def _requests(n):
    rng = np.random.default_rng(7)
    base = [rng.integers(0, 50, PT * 6) for _ in range(4)]
    out = []
    for _ in range(n):
        b = base[int(rng.integers(0, 4))]
        k = int(rng.integers(1, 7)) * PT
        out.append(np.concatenate([b[:k], rng.integers(0, 50, int(rng.integers(0, 3)) * PT)]))
    return out


def _worker(rank, world, steps):
    return [_run(rank, world, steps, w) for w in ("write_through", "write_back")]


def _run(rank, world, steps, write):
    ctrl = CacheController(PT, 12, 10, write=write)
    agree = StepAgreement()
    assert not agree.local and agree.world_size == world
    taken_at, done_at, applied_at = {}, {}, {}
    digests, per_step, host_hits = [], [], 0
    for step, toks in enumerate(_requests(steps)):
        m = ctrl.match(toks)
        for n in m.host_nodes:            # a host hit is only ever a copy every rank finished
            assert n.host_valid
        host_hits += m.host_len
        h = ctrl.lock(m)
        ld = ctrl.load_back(m)
        have = m.device_len // PT + (len(ld.device_pages) if ld else 0)
        try:
            new = ctrl.alloc_device(len(toks) // PT - have)
            pages = list(m.device_pages) + (list(ld.device_pages) if ld else []) + new
            ctrl.insert(toks, pages)
        except DeviceFullError:
            pass
        ctrl.unlock(h)
        for op in ctrl.take_ops():
            taken_at[op.op_id] = step
            delay = 0 if rank == 0 else 1 + op.op_id % 3   # rank 1 lags
            done_at[op.op_id] = step + delay
        local_done = {o for o in ctrl.inflight_ops() if done_at[o] <= step}
        before = set(ctrl.inflight_ops())
        with CollectiveCounter.measure() as cnt:
            res = ctrl.agree(agree, local_done, extras=[10 * rank + step, 100 - rank])
        per_step.append(cnt["n"])
        assert res.extras == (step, 99)
        for o in before - set(ctrl.inflight_ops()):
            applied_at[o] = step
        ctrl.check()
        digests.append(hashlib.sha1(repr(ctrl.digest()).encode()).hexdigest())
    # debug mode: identical trees pass, then a divergence is named
    dbg = StepAgreement(debug=True)
    ctrl.agree(dbg, set())
    if rank == 1:
        ctrl.match(_requests(1)[0])       # only rank 1 advances its clock
    try:
        ctrl.agree(dbg, set())
        diverged = None
    except DivergenceError as e:
        diverged = str(e)
    return dict(digests=digests, per_step=per_step, done_at=done_at, applied_at=applied_at,
                host_hits=host_hits, stats=vars(ctrl.stats), diverged=diverged,
                inflight=ctrl.inflight_ops())


def _check(results, steps):
    r0, r1 = results
    assert r0["digests"] == r1["digests"], "trees diverged"
    assert r0["per_step"] == r1["per_step"] == [1] * steps, "exactly one collective per step"
    assert r0["applied_at"] == r1["applied_at"]
    assert r0["applied_at"], "some transfer must complete"
    for o, s in r0["applied_at"].items():
        assert s >= max(r0["done_at"][o], r1["done_at"][o]), f"op {o} applied early"
    assert any(r1["done_at"][o] > r0["done_at"][o] for o in r0["applied_at"])
    for r in results:
        assert r["diverged"] is not None and "rank 1 differs from rank 0" in r["diverged"]
        assert "clock" in r["diverged"]


def test_two_ranks_agree_with_lagging_transfers():
    steps = 30
    out = launch(2, _worker, steps, timeout_s=90)
    for policy in range(2):  # write_through, then write_back (eviction-time backups)
        results = [out[0][policy], out[1][policy]]
        _check(results, steps)
        assert results[0]["stats"]["device_evicted_pages"] > 0
        assert results[0]["host_hits"] > 0
