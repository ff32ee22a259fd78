"""Every failure is agreed, nothing leaks, nothing wrong is returned.

Single-rank checks: a job failing between two reads of its state, caller mistakes refused, the
warm-restart livelock. Two-rank checks share ONE spawned gloo group with a short timeout (a hang
fails the test): in each, only rank 1 fails, both ranks must raise at the same step, no token
computed from failed KV reaches a caller, and no lock or page leaks.
"""

import threading

import numpy as np
import pytest
import torch

from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.errors import HiCacheError, TransferError
from hicache.l2.transfer import DONE, FAILED, PENDING, TransferJob
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.workloads import Request

from helpers import write_kv_rows, admit_ready, make_cfg


# what these tests count must not depend on how fast this machine reads L3
WAIT = {"prefetch": "wait_complete"}


def req(i, tokens, out=2):
    return Request(i, 0, np.asarray(tokens, dtype=np.int64), out, i)


def leaks(cache) -> dict:
    """Everything that must be back in the pools after a failure (empty dict: no leak)."""
    c = cache.ctrl
    c.check()  # raises on any inconsistency between the tree, the requests and the pools
    out = {}
    open_locks = [n.nid for n in c.iter_nodes() if n.parent is not None and n.lock_ref]
    if open_locks or cache.stats()["locks"]:
        out["locks"] = open_locks
    if c.request_pages:
        out["request_pages"] = sorted(c.request_pages)
    for tier, alloc in (("l1", c.device), ("l2", c.host)):
        if alloc.num_free + alloc.num_used != alloc.num_pages:
            out[tier] = (alloc.num_free, alloc.num_used, alloc.num_pages)
    if cache._owned.any():
        out["owned"] = np.flatnonzero(cache._owned).tolist()
    return out


# ---- one rank ---------------------------------------------------------------------------------
class _FailsAfterFirstRead:
    """A pending job whose copy fails right after the cache first reads its state: the
    interleaving in which ``failed`` (False) then ``done()`` (True) looked like success."""

    def __init__(self, job: TransferJob) -> None:
        self.job, self.nbytes, self.seconds = job, job.nbytes, 0.0
        self.reads = 0

    def _after_read(self):
        self.reads += 1
        if self.reads == 1:
            self.job._fail(OSError("failed between two reads"))

    @property
    def failed(self):
        r = self.job.failed
        self._after_read()
        return r

    def done(self):
        r = self.job.done()
        self._after_read()
        return r

    def status(self):
        r = self.job.status()
        self._after_read()
        return r

    def wait(self, timeout=None):
        self.job.wait(timeout)

    def wait_layer(self, layer, timeout=None):
        self.job.wait_layer(layer, timeout)


def test_a_copy_failing_between_two_state_reads_is_never_agreed(tmp_path):
    from hicache.l3 import PageStore, chain_hashes
    cfg = make_cfg(tmp_path / "l3", l1_pages=8, **WAIT)
    tokens = np.random.default_rng(0).integers(0, 128, 8)
    cache = HiCache(cfg, mode="l1+l2+l3")
    admit_ready(cache, "a", np.concatenate([tokens, [1]]))
    cache.finish("a", tokens)  # write_through: one backup
    (op_id, rec), = cache.io.inflight.items()
    job = rec.job
    job.wait()
    # the same op, now a job still pending that fails right after its first state read
    pending = TransferJob("d2h", job.plan, job.num_layers, job.nbytes)
    assert pending.status() == PENDING
    flaky = _FailsAfterFirstRead(pending)
    rec.job = flaky
    assert cache.step() == []  # read once: pending, so not applied
    assert flaky.reads == 1 and pending.status() == FAILED
    node = next(n for n in cache.ctrl.iter_nodes() if n.parent is not None)
    assert not node.host_valid and op_id in cache.ctrl.inflight_ops()
    with pytest.raises(TransferError, match="failed between two reads"):
        cache.step()
    assert not node.host_valid
    with pytest.raises(TransferError, match="stopped"):
        cache.drain()
    keys = cache.io.keys(chain_hashes(tokens, 4))
    cache.close()
    assert leaks(cache) == {}
    with PageStore(cfg.l3.path, cache.namespace, 0, cfg.l3.size_bytes) as store:
        assert store.exists_prefix(keys) == 0  # nothing of the failed copy reached L3


def test_job_status_moves_once(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, **WAIT)
    with HiCache(cfg, mode="l1+l2") as cache:
        job = cache.transfer.backup([0, 1], [2, 3])
        job.wait()
        assert job.status() == DONE and not job.failed
        bad = TransferJob("h2d", job.plan, job.num_layers, job.nbytes)
        bad._fail(OSError("x"))
        assert bad.status() == FAILED and bad.done()


def test_caller_mistakes_that_would_change_later_outputs_are_refused(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, **WAIT)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 128, 17)
    model = MLAModel(model_config(cfg))
    cache = HiCache(cfg, mode="l1+l2+l3")
    Server(model, cache, chunk_tokens=16).run([req("a", prompt, out=1)])
    cache.drain()
    cache.close()
    cache = HiCache(cfg, mode="l1+l2+l3")  # warm: the prompt is in L3 only
    p = cache.admit("warm", prompt)
    assert not p.ready
    with pytest.raises(HiCacheError, match="before prefix.ready"):
        cache.alloc("warm", 20)
        write_kv_rows(cache, "warm", 20)
    while not cache.step():
        pass
    assert p.storage_len == 16
    cache.alloc("warm", 20)
    write_kv_rows(cache, "warm", 20)
    rows = torch.zeros(1, cache.l1.kv_dim)
    cache.finish("warm", prompt)
    hit = cache.admit("hit", np.concatenate([prompt[:16], [5]]))
    assert hit.device_len == 16
    with pytest.raises(HiCacheError, match="no admitted request owns"):
        cache.write_kv(0, torch.tensor([hit.page_table[0] * 4]), rows)  # a cached page
    cache.alloc("hit", 20)
    write_kv_rows(cache, "hit", 20)
    own = hit.page_table[-1]
    assert cache.write_kv(0, torch.tensor([own * 4 + 1]), rows) == 1  # its own page: fine
    with pytest.raises(HiCacheError, match="token 2 is"):
        bad = prompt[:17].copy()
        bad[2] += 1
        cache.finish("hit", bad)
    cache.finish("hit", np.concatenate([prompt[:16], [5]]))
    assert leaks(cache) == {}
    cache.close()
    for call, args in (("admit", ("x", [1, 2])), ("alloc", ("x", 4)), ("finish", ("x", [1])),
                       ("abort", ("x",)), ("step", ()), ("drain", ()),
                       ("write_kv", (0, torch.tensor([0]), rows))):
        with pytest.raises(HiCacheError, match="after close"):
            getattr(cache, call)(*args)


def test_locked_hits_never_starve_every_l3_restore(tmp_path):
    """Warm restart, L1 nearly full of the active requests' locked L1 hits: every agreed L3
    restore finds no room. The loop must make progress without abort/re-admit cycles (no
    restore falling back to recompute, L3 read a bounded number of times) and give the tokens
    recompute gives."""
    cfg = make_cfg(tmp_path / "l3", l1_pages=22, l2_ratio=0.5, **WAIT)  # 4-token pages
    rng = np.random.default_rng(5)
    heads = [rng.integers(0, 128, 20) for _ in range(4)]  # 5 pages each: the locked L1 hits
    tails = [rng.integers(0, 128, 16) for _ in range(4)]  # 4 pages each: the L3 restores
    jobs = [req(f"r{i}", np.concatenate([h, t, [7]])) for i, (h, t) in enumerate(zip(heads, tails))]
    model = MLAModel(model_config(cfg))
    from hicache.l3 import chain_hashes
    with HiCache(cfg.replace(l2={"ratio": 4.0}), mode="l1+l2+l3") as cache:  # cold
        Server(model, cache, chunk_tokens=16, max_running=1).run(jobs)
        cache.drain()
        assert all(cache.l3.exists_prefix(cache.io.keys(chain_hashes(j.tokens[:-1], 4))) == 9
                   for j in jobs)  # every whole page of every prompt is in L3
    with HiCache(cfg.replace(l3={"path": str(tmp_path / "x")}), mode="recompute") as cache:
        ref = {r.request_id: r.output for r in Server(model, cache, chunk_tokens=16).run(jobs)}
    with HiCache(cfg, mode="l1+l2+l3") as cache:  # warm restart
        server = Server(model, cache, chunk_tokens=16, max_running=4, stall_steps=5000)
        # the heads come back into L1 (from L3): 4 x 5 = 20 of 22 pages, unlocked
        Server(model, cache, chunk_tokens=16, max_running=1).run(
            [req(f"h{i}", np.concatenate([h, [1]]), out=1) for i, h in enumerate(heads)])
        cache.drain()
        assert cache.ctrl.device.num_used == 20
        read0 = cache.stats()["bytes"]["l3_read"]
        # hold every L3 read until all four requests are admitted and hold their hits
        gate = threading.Event()
        cache.io.prefetcher._pool.submit(gate.wait, 60)
        opener = threading.Thread(target=lambda: (_wait_for(lambda: len(cache._reqs) == 4, 20),
                                                  gate.set()))
        opener.start()
        results = server.run(jobs)
        opener.join()
        st = cache.stats()
        assert leaks(cache) == {}
    assert {r.request_id: r.output for r in results} == ref
    assert st["restore_wait_steps"] > 0  # the starvation happened ...
    assert st["restore_fallbacks"] == 0  # ... and no restore gave up on it
    assert server.preemptions > 0 and server.longest_stall < 64
    page = cache.namespace.shard_bytes
    assert st["bytes"]["l3_read"] - read0 <= 2 * sum(len(j.tokens) // 4 for j in jobs) * page


def _wait_for(cond, timeout=60.0):
    import time
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.001)


# ---- two ranks, one group, one rank fails ------------------------------------------------------
def _broken_h2d(transfer):
    run = transfer.backend.copy

    def broken(job):
        if job.direction == "h2d":
            raise OSError("simulated H2D failure")
        run(job)
    transfer.backend.copy = broken


def _l2_hit_setup(cache, server, prompt, rng):
    """``prompt`` computed, backed up, then pushed out of L1: the next visit is an L2 hit."""
    server.run([req("a", prompt, out=1)])
    server.run([req(f"f{i}", rng.integers(0, 128, 33), out=1) for i in range(3)])
    cache.drain()
    m = cache.ctrl.match(prompt[:-1])
    assert m.host_len >= 16, m


def _outcome(fn):
    try:
        fn()
        return "no error"
    except TransferError as e:
        return str(e)


def _check_load_fails_in_layer_loop(rank, group, cfg, model):
    """Rank 1's H2D load fails under wait_layer, inside the runner's layer loop (between merge
    collectives): no hang, both raise at the same step, the request's token never returned."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 128, 33)
    cache = HiCache(cfg, rank, group, mode="l1+l2")
    server = Server(model, cache, group=group, chunk_tokens=16, max_running=2)
    _l2_hit_setup(cache, server, prompt, rng)
    if rank == 1:
        _broken_h2d(cache.transfer)
    emitted = []
    out = _outcome(lambda: server.run([req("b", prompt, out=1), req("c", prompt[:9], out=3)],
                                      on_done=lambda r: emitted.append(r.request_id)))
    steps = cache._stats.steps
    after = _outcome(lambda: cache.admit("z", prompt))  # stopped: every call raises alike
    lk = leaks(cache)
    cache.close()
    return {"out": out, "steps": steps, "emitted": emitted, "leaks": lk, "after": after}


def _check_finish_and_abort_after_failed_load(rank, group, cfg, model):
    """The engine finishes one request and aborts another whose L2 load failed on rank 1:
    neither raises there, nothing leaks, the next step raises on both ranks."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 128, 33)
    cache = HiCache(cfg, rank, group, mode="l1+l2")
    server = Server(model, cache, group=group, chunk_tokens=16)
    _l2_hit_setup(cache, server, prompt, rng)
    if rank == 1:
        _broken_h2d(cache.transfer)
    p = cache.admit("b", prompt)
    q = cache.admit("c", np.concatenate([prompt[:-1], [5, 6]]))
    loads = p.host_len + q.host_len
    cache.alloc("b", 40)
    write_kv_rows(cache, "b", 40)
    for layer in range(cache.l1.num_layers):
        cache.wait_layer("b", layer)  # never raises, even on rank 1
    cache.finish("b", prompt)
    cache.abort("c")
    out = _outcome(cache.step)
    lk = leaks(cache)
    cache.close()
    return {"out": out, "loads": loads, "leaks": lk}


def _check_issue_fails(rank, group, cfg, model):
    """Rank 1 cannot even issue copies (e.g. CUDA out of memory for the index tensors): the
    backup issued in finish and the load issued in admit become failed jobs, agreed at the
    next step; the finished request's tokens are not returned."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 128, 33)
    cache = HiCache(cfg, rank, group, mode="l1+l2")
    server = Server(model, cache, group=group, chunk_tokens=16)
    _l2_hit_setup(cache, server, prompt, rng)
    if rank == 1:
        def oom(*args):
            raise RuntimeError("CUDA out of memory (simulated)")
        cache.transfer.load = oom
    emitted = []
    out_admit = _outcome(lambda: server.run([req("b", prompt, out=2)],
                                            on_done=lambda r: emitted.append(r.request_id)))
    lk1 = leaks(cache)
    cache.close()
    cache = HiCache(cfg, rank, group, mode="l1+l2")
    server = Server(model, cache, group=group, chunk_tokens=16)
    if rank == 1:
        cache.transfer.backup = oom
    out_finish = _outcome(lambda: server.run([req("d", prompt, out=1)],
                                             on_done=lambda r: emitted.append(r.request_id)))
    lk2 = leaks(cache)
    cache.close()
    return {"admit": out_admit, "finish": out_finish, "emitted": emitted, "leaks": [lk1, lk2]}


def _check_l3_write_fails(rank, group, cfg, model):
    """Rank 1's L3 store fails every write (disk full): drain raises on both ranks at the same
    step, close raises on neither."""
    rng = np.random.default_rng(4)
    cache = HiCache(cfg, rank, group, mode="l1+l2+l3")
    if rank == 1:
        def full(*args, **kwargs):
            raise OSError(28, "No space left on device (simulated)")
        cache.l3.put = full
    server = Server(model, cache, group=group, chunk_tokens=16)

    def work():
        server.run([req("a", rng.integers(0, 128, 33), out=1)])
        cache.drain()
    out = _outcome(work)
    steps = cache._stats.steps
    lk = leaks(cache)
    try:
        cache.close()
        closed = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        closed = repr(e)
    return {"out": out, "steps": steps, "leaks": lk, "close": closed}


def _check_restore_fails(rank, group, cfg, model):
    """Warm restart: the prompt is in L3 only. Rank 1's copy of its agreed L3 pages into L1 (a
    restore job of the transfer engine) fails: both ranks raise at the same step, the request's
    tokens are never returned, nothing leaks."""
    prompt = np.random.default_rng(6).integers(0, 128, 33)
    cache = HiCache(cfg, rank, group, mode="l1+l2+l3")
    Server(model, cache, group=group, chunk_tokens=16).run([req("a", prompt, out=1)])
    cache.close()
    cache = HiCache(cfg, rank, group, mode="l1+l2+l3")
    if rank == 1:
        run = cache.transfer.backend.copy

        def broken(job):
            if job.src is not None and job.src.medium == "staging":
                raise OSError("simulated restore failure")
            run(job)
        cache.transfer.backend.copy = broken
    emitted = []
    out = _outcome(lambda: Server(model, cache, group=group, chunk_tokens=16).run(
        [req("b", prompt, out=2)], on_done=lambda r: emitted.append(r.request_id)))
    steps = cache._stats.steps
    st = cache.stats()
    lk = leaks(cache)
    cache.close()
    return {"out": out, "steps": steps, "emitted": emitted, "leaks": lk,
            "l3_read": st["bytes"]["l3_read"], "failed": st["failed_copies"]["h2d"]}


CHECKS = {"layer_loop": _check_load_fails_in_layer_loop,
          "finish_abort": _check_finish_and_abort_after_failed_load,
          "issue": _check_issue_fails,
          "l3_write": _check_l3_write_fails,
          "restore": _check_restore_fails}


def _fault_group(rank, world, base):
    import torch.distributed as dist
    group = dist.group.WORLD
    out = {}
    for name, check in CHECKS.items():
        cfg = make_cfg(f"{base}/{name}", dcp=2, l1_pages=16, **WAIT)
        torch.manual_seed(0)
        model = MLAModel(model_config(cfg))
        out[name] = check(rank, group, cfg, model)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    # a 20 s process-group timeout: a rank left waiting in a collective fails the test quickly
    return launch(2, _fault_group, str(base), timeout_s=20)


def test_a_load_failing_under_wait_layer_stops_both_ranks_and_returns_nothing(fault_runs):
    r0, r1 = (r["layer_loop"] for r in fault_runs)
    assert "simulated H2D failure" in r1["out"]
    assert "another rank" in r0["out"]
    assert r0["steps"] == r1["steps"]  # the same step
    assert "b" not in r0["emitted"] and "b" not in r1["emitted"]
    assert r0["emitted"] == r1["emitted"]
    assert "stopped" in r0["after"] and "stopped" in r1["after"]
    assert r0["leaks"] == r1["leaks"] == {}


def test_finish_and_abort_after_a_failed_load_leak_nothing(fault_runs):
    r0, r1 = (r["finish_abort"] for r in fault_runs)
    assert r0["loads"] == r1["loads"] > 0
    assert "simulated H2D failure" in r1["out"] and "another rank" in r0["out"]
    assert r0["leaks"] == r1["leaks"] == {}


def test_a_copy_that_cannot_be_issued_on_one_rank_stops_both(fault_runs):
    r0, r1 = (r["issue"] for r in fault_runs)
    assert "out of memory" in r1["admit"] and "another rank" in r0["admit"]
    assert "out of memory" in r1["finish"] and "another rank" in r0["finish"]
    assert r0["emitted"] == r1["emitted"] == []
    assert r0["leaks"] == r1["leaks"] == [{}, {}]


def test_an_l3_write_error_on_one_rank_stops_both_at_the_same_step(fault_runs):
    r0, r1 = (r["l3_write"] for r in fault_runs)
    assert "No space left" in r1["out"] and "another rank" in r0["out"]
    assert r0["steps"] == r1["steps"]
    assert r0["close"] == r1["close"] == "ok"
    assert r0["leaks"] == r1["leaks"] == {}


def test_an_l3_restore_failing_on_one_rank_stops_both_at_the_same_step(fault_runs):
    r0, r1 = (r["restore"] for r in fault_runs)
    assert "simulated restore failure" in r1["out"] and "another rank" in r0["out"]
    assert r0["steps"] == r1["steps"]
    assert r0["l3_read"] > 0 and r1["l3_read"] > 0  # both read the hit; rank 1's copy failed
    assert (r0["failed"], r1["failed"]) == (0, 1)
    assert r0["emitted"] == r1["emitted"] == []
    assert r0["leaks"] == r1["leaks"] == {}
