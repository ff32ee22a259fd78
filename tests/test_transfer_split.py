"""Big CPU jobs split across copy threads (``TransferEngine.copy_threads``, jobs of at least
``split_bytes``): the same bytes as one thread for every layout, direction and page pattern,
loads still arriving layer by layer in order (a layer once every piece of it landed), one
failing piece failing the whole job only after every piece stopped, and no thread left behind
at close. ``split_bytes = 0`` splits the tiny jobs of these tests."""

import threading

import numpy as np
import pytest
import torch

from hicache.errors import TransferError, UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2 import copy_cpu
from hicache.l2.blocks import split_runs
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import COPY_THREADS, DONE, FAILED, PENDING, TransferEngine
from hicache.layout import DCPLayout

L, P, D = 5, 4, 8
PAGES = 48


def pools(kind, dtype=torch.bfloat16):
    lay = DCPLayout(1, 0, P)
    return (DeviceKVPool(lay, L, D, dtype, PAGES),
            HostKVPool(lay, L, D, dtype, PAGES, layout_kind=kind))


def dev_page(d, p):
    return d.kv[:, p * P:(p + 1) * P]


PATTERNS = {
    "contiguous": (list(range(PAGES)), list(range(PAGES))),       # one run: page runs
    "few_runs": ([9, 3, 4, 5, 17, 30, 31], [0, 1, 2, 3, 4, 40, 41]),  # page runs, cut by pieces
    "scattered": (np.random.default_rng(0).permutation(PAGES).tolist(),  # block plans
                  list(range(PAGES))),
}


def split_engine(d, h, threads=2):
    eng = TransferEngine(d, h, copy_threads=threads)
    eng.split_bytes = 0  # split every job, however small
    eng.inline_bytes = 0  # through the copy threads
    return eng


def test_default_copy_threads_and_limits():
    d, h = pools("page_first")
    with TransferEngine(d, h) as eng:
        assert eng.copy_threads == COPY_THREADS == 2 and eng.split_bytes == 8 << 20
    for bad in (0, 17, 2.0, True):
        with pytest.raises(UsageError, match="copy_threads"):
            TransferEngine(d, h, copy_threads=bad)


def test_split_runs_cover_every_page_once_in_order():
    runs = [(9, 0, 1), (3, 1, 3), (17, 4, 1), (30, 40, 2)]
    for parts in (1, 2, 3, 7, 20):
        pieces = split_runs(runs, parts)
        assert 1 <= len(pieces) <= parts and all(pieces)
        flat = [(s + i, t + i) for piece in pieces for s, t, n in piece for i in range(n)]
        assert flat == [(s + i, t + i) for s, t, n in runs for i in range(n)]
        sizes = [sum(n for *_, n in piece) for piece in pieces]
        assert max(sizes) - min(sizes) <= -(-7 // parts)
    assert split_runs([(0, 0, 1)], 4) == [[(0, 0, 1)]]


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("threads", [2, 3])
def test_split_jobs_are_bit_exact_both_ways(monkeypatch, kind, pattern, threads):
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", 3 * P * D * 2)  # chunks of ~3 page-layers
    d, h = pools(kind)
    d.kv.normal_()
    ref = d.kv.clone()
    dev_pages, host_pages = PATTERNS[pattern]
    with split_engine(d, h, threads) as eng:
        back = eng.backup(dev_pages, host_pages)
        assert (type(back.prepared) is list) == (pattern != "scattered")
        back.wait(timeout=30)
        assert back.status() == DONE
        for s, t in zip(dev_pages, host_pages):
            assert torch.equal(h.page_view(t), ref[:, s * P:(s + 1) * P])
        d.kv.zero_()
        targets = list(reversed(dev_pages))  # back into other device pages
        load = eng.load(host_pages, targets)
        for layer in range(L):
            load.wait_layer(layer, timeout=30)
            for s, t in zip(dev_pages, targets):  # layer `layer` whole on every target
                assert torch.equal(d.kv[layer, t * P:(t + 1) * P], ref[layer, s * P:(s + 1) * P])
        load.wait(timeout=30)
        assert load.status() == DONE and load._pieces > 1  # pieces of each layer
        for p in set(range(PAGES)) - set(targets):
            assert not dev_page(d, p).any()  # nothing written outside the job
        staging = torch.randn(3, L, P, D).to(torch.bfloat16)
        eng.restore(staging, [7, 0, 44]).wait(timeout=30)
        for i, t in enumerate([7, 0, 44]):
            assert torch.equal(dev_page(d, t), staging[i])
        assert eng.stats.jobs_d2h == 1 and eng.stats.jobs_h2d == 2
        assert eng.stats.bytes_d2h == len(dev_pages) * d.bytes_per_page


@pytest.mark.parametrize("block_plan", [False, True])
def test_a_split_load_arrives_layer_by_layer_only_once_every_piece_landed(monkeypatch,
                                                                          block_plan):
    """The thread running the job is held in its first chunk (piece 0 of layer 0) while the
    helper copies every other chunk: no layer may arrive; released, layers arrive in order,
    each whole."""
    d, h = pools("page_first")
    d.kv.normal_()
    ref = d.kv.clone()
    monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 1)  # page runs: one layer a group
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 // 3)  # 3 pieces a layer
    name = "run_block_plan" if block_plan else "run_page_runs"
    real = getattr(copy_cpu, name)
    gate, helper_calls = threading.Event(), []

    def gated(*args):
        if threading.current_thread().name.startswith("hicache-copy"):
            helper_calls.append(1)
        else:
            gate.wait(30)
        real(*args)
    pages = PATTERNS["scattered" if block_plan else "contiguous"][0]
    with split_engine(d, h) as eng:
        eng.backup(pages, list(range(PAGES))).wait(timeout=30)
        d.kv.zero_()
        monkeypatch.setattr(copy_cpu, name, gated)
        job = eng.load(list(range(PAGES)), pages)
        arrivals = []
        real_landed = job._layers_landed

        def landed(first, end):
            real_landed(first, end)
            arrivals.append(job._arrived)
        job._layers_landed = landed
        for _ in range(3000):  # the helper lands every piece but the held one
            if int(sum(job._landed)) == 3 * L - 1:
                break
            threading.Event().wait(0.01)
        assert job._pieces == 3 and len(helper_calls) == 3 * L - 1
        assert list(job._landed) == [2] + [3] * (L - 1)
        assert job._arrived == 0 and job.status() == PENDING
        with pytest.raises(TransferError, match="layer 0 .* did not arrive"):
            job.wait_layer(0, timeout=0.05)
        gate.set()
        for layer in range(L):
            job.wait_layer(layer, timeout=30)
            assert torch.equal(d.kv[layer], ref[layer])  # whole once it arrived
        job.wait(timeout=30)
    assert arrivals == sorted(arrivals) and arrivals[-1] == L
    assert torch.equal(d.kv, ref)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("block_plan", [False, True])
def test_one_failing_chunk_fails_the_job_after_every_chunk_stopped(monkeypatch, direction,
                                                                   block_plan):
    """The second chunk fails while the first is still copying: the job fails only once the
    first has finished, no chunk is taken after the failure, and the engine goes on."""
    d, h = pools("page_first")
    name = "run_block_plan" if block_plan else "run_page_runs"
    real = getattr(copy_cpu, name)
    failed, copied, late, order = threading.Event(), [], [], []
    job_box = []
    lock = threading.Lock()

    def broken(*args):
        if job_box and job_box[0].status() != PENDING:
            late.append(1)  # a copy after the job was marked failed: must never happen
        with lock:
            i = len(order)
            order.append(i)
        if i == 1:
            failed.set()
            raise OSError("chunk broke")
        if i == 0:
            failed.wait(5)  # held until the other chunk failed (or copies on alone)
        real(*args)
        copied.append(i)
    pages = PATTERNS["scattered" if block_plan else "contiguous"][0]
    with split_engine(d, h) as eng:
        monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 1)
        monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 // 2)
        monkeypatch.setattr(copy_cpu, name, broken)
        submit = eng.backup if direction == "d2h" else eng.load
        job_box.append(submit(pages, list(range(PAGES))))
        job = job_box[0]
        with pytest.raises(TransferError, match="chunk broke"):
            job.wait(timeout=30)
        assert job.status() == FAILED and job.failed
        with pytest.raises(TransferError, match="chunk broke"):
            job.wait_layer(L - 1, timeout=30)
        assert eng.stats.jobs_d2h + eng.stats.jobs_h2d == 0  # a failed job is not counted
        assert copied == [0]  # the chunk in flight finished; none was taken after the failure
        assert order == [0, 1] and not late
        monkeypatch.setattr(copy_cpu, name, real)
        eng.backup([0], [0]).wait(timeout=30)  # the engine still works


def test_a_split_backup_failing_in_one_piece_is_never_agreed(tmp_path, monkeypatch):
    """Through the service: the failure of a helper's piece is the job's failure, raised at the
    next step like any copy failure; the host copy is never made valid."""
    from helpers import admit_ready, make_cfg
    from hicache.service import HiCache
    from test_service import _fill

    cfg = make_cfg(tmp_path / "l3", l1_pages=8)
    tokens = np.random.default_rng(0).integers(0, 128, 8)
    cache = HiCache(cfg, mode="l1+l2")
    assert cache.transfer.copy_threads == COPY_THREADS
    cache.transfer.split_bytes = 0
    cache.transfer.inline_bytes = 0
    p = admit_ready(cache, "a", np.concatenate([tokens, [1]]))
    _fill(cache, p.page_table, 1.0)
    real, calls = copy_cpu.run_page_runs, []

    def broken(*args):  # the second chunk of the job fails
        calls.append(1)
        if len(calls) == 2:
            raise OSError("simulated piece failure")
        real(*args)
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", 1)  # a chunk a page
    monkeypatch.setattr(copy_cpu, "run_page_runs", broken)
    cache.finish("a", tokens)
    recs = list(cache.io.inflight.values())
    assert recs
    for rec in recs:
        with pytest.raises(TransferError):
            rec.job.wait(timeout=30)
    with pytest.raises(TransferError, match="simulated piece failure"):
        cache.step()
    node = next(n for n in cache.ctrl.iter_nodes() if n.parent is not None)
    assert not node.host_valid
    assert cache.stats()["failed_copies"]["d2h"] == 1 and len(calls) >= 2
    cache.close(flush=False)
    with HiCache(cfg.replace(io={"copy_threads": 1}), mode="l1+l2") as one:
        assert one.transfer.copy_threads == 1  # io.copy_threads reaches the engine


def test_no_copy_thread_outlives_close():
    before = set(threading.enumerate())
    for threads in (1, 2, 4):
        d, h = pools("page_first")
        eng = split_engine(d, h, threads)
        jobs = [eng.backup(list(range(PAGES)), list(range(PAGES))) for _ in range(3)]
        jobs += [eng.load(list(range(PAGES)), list(range(PAGES))) for _ in range(3)]
        eng.close()
        assert all(j.status() == DONE for j in jobs)  # close finished the queued jobs
        left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == [], left


def test_one_contiguous_copy_is_not_split(monkeypatch):
    """A backup contiguous on both sides (layer_first host, consecutive pages of every layer)
    stays one memmove, as fast as the memcpy it is (libc streams a big one); loads copied layer
    by layer, other layouts and parts of a layer are split."""
    monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 1)  # loads: one layer at a time
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 // 2)  # 2 pieces a layer
    calls = []
    real = copy_cpu.run_page_runs
    monkeypatch.setattr(copy_cpu, "run_page_runs", lambda *a: (calls.append(a[0]), real(*a)))
    for kind, whole in (("layer_first", True), ("page_first", False)):
        d, h = pools(kind)
        d.kv.normal_()
        with split_engine(d, h) as eng:
            calls.clear()
            job = eng.backup(list(range(PAGES)), list(range(PAGES)))
            job.wait(timeout=30)
            assert len(calls) == (1 if whole else 2 * L)  # one memmove, or chunks
            assert torch.equal(h.page_view(PAGES - 1), dev_page(d, PAGES - 1))
            calls.clear()
            eng.load(list(range(PAGES)), list(range(PAGES))).wait(timeout=30)
            assert len(calls) == 2 * L  # two pieces of each layer
            calls.clear()
            eng.backup(list(range(8)), list(range(8))).wait(timeout=30)  # part of each layer
            assert len(calls) == 2


def test_transfer_bench_times_memcpy_pieces():
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "transfer.py"), "--memcpy-pieces",
                        "--json", "--tokens", "2048", "--dcp", "2", "--reps", "1"],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["memcpy_pieces"]
    nbytes = 2048 // 2 * 8 * 576 * 2  # 1024 rows of 8 layers of kv_dim 576, bf16
    assert [x["way"] for x in rows] == ["one memmove", "pieces of 1.2 MB", "pieces of 2.4 MB",
                                        "pieces of 4.7 MB",
                                        "2 threads, pieces of half a layer"]
    assert all(x["bytes"] == nbytes and x["gbps"] > 0 and x["dcp"] == 2 for x in rows)


def _lone_runner(eng):
    """No helper thread: the thread running a split job copies alone unless a waiter helps."""
    eng.backend._stop_helpers()
    return eng


@pytest.mark.parametrize("block_plan", [False, True])
def test_a_waiter_copies_the_chunks_of_a_running_job_instead_of_sleeping(monkeypatch,
                                                                         block_plan):
    """The copy thread is held in its first chunk and no helper runs: ``wait()`` copies every
    other chunk on the waiting thread, then returns once the held chunk landed too."""
    d, h = pools("page_first")
    d.kv.normal_()
    ref = d.kv.clone()
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 * L // 6)  # 6 chunks
    name = "run_block_plan" if block_plan else "run_page_runs"
    real = getattr(copy_cpu, name)
    gate, mine, theirs = threading.Event(), [], []
    pages = PATTERNS["scattered" if block_plan else "contiguous"][0]

    def gated(*args):
        if threading.current_thread() is threading.main_thread():
            mine.append(1)
        else:
            theirs.append(1)
            assert gate.wait(30)  # held until the waiter copied the rest
        real(*args)
        if len(mine) == 5:
            gate.set()
    with _lone_runner(split_engine(d, h)) as eng:
        monkeypatch.setattr(copy_cpu, name, gated)
        job = eng.backup(pages, list(range(PAGES)))
        for _ in range(3000):  # the copy thread took its first chunk
            if theirs:
                break
            threading.Event().wait(0.01)
        job.wait(timeout=30)
        assert job.status() == DONE and len(theirs) == 1 and len(mine) == 5
        for s, t in enumerate(pages):
            assert torch.equal(h.page_view(s), ref[:, t * P:(t + 1) * P])


@pytest.mark.parametrize("block_plan", [False, True])
def test_a_layer_waiter_copies_only_what_its_layer_needs(monkeypatch, block_plan):
    """``wait_layer(1)`` on a split load whose copy thread is held in the first piece of layer
    0: the waiter copies the other pieces of layers 0 and 1 and no later one; the job then
    completes on the copy thread, every layer whole."""
    d, h = pools("page_first")
    d.kv.normal_()
    ref = d.kv.clone()
    monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 1)  # page runs: one layer a group
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 // 3)  # 3 pieces a layer
    name = "run_block_plan" if block_plan else "run_page_runs"
    real = getattr(copy_cpu, name)
    gate, mine, theirs = threading.Event(), [], []
    pages = PATTERNS["scattered" if block_plan else "contiguous"][0]
    with _lone_runner(split_engine(d, h)) as eng:
        eng.backup(pages, list(range(PAGES))).wait(timeout=30)
        d.kv.zero_()

        def gated(*args):
            if threading.current_thread() is threading.main_thread():
                mine.append(1)
            else:
                theirs.append(1)
                if len(theirs) == 1:
                    assert gate.wait(30)
            real(*args)
            if len(mine) == 5:  # pieces 1-2 of layer 0, 0-2 of layer 1
                gate.set()
        monkeypatch.setattr(copy_cpu, name, gated)
        job = eng.load(list(range(PAGES)), pages)
        for _ in range(3000):
            if theirs:
                break
            threading.Event().wait(0.01)
        job.wait_layer(1, timeout=30)
        assert len(mine) == 5 and torch.equal(d.kv[:2], ref[:2])
        job.wait(timeout=30)
        assert len(mine) + len(theirs) == 3 * L and job.status() == DONE
        assert torch.equal(d.kv, ref)


def test_a_failing_chunk_copied_by_the_waiter_fails_the_job(monkeypatch):
    """The waiter's first chunk fails while the copy thread is held in its own: the job fails
    only once that chunk finished, no chunk is taken after the failure, wait() raises."""
    d, h = pools("page_first")
    real = copy_cpu.run_block_plan
    gate, mine, theirs = threading.Event(), [], []
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 * L // 6)

    def broken(*args):
        if threading.current_thread() is threading.main_thread():
            mine.append(1)
            gate.set()
            raise OSError("waiter chunk broke")
        theirs.append(1)
        assert gate.wait(30)
        threading.Event().wait(0.05)  # still copying when the waiter's chunk failed
        real(*args)
    with _lone_runner(split_engine(d, h)) as eng:
        monkeypatch.setattr(copy_cpu, "run_block_plan", broken)
        job = eng.backup(PATTERNS["scattered"][0], list(range(PAGES)))
        for _ in range(3000):
            if theirs:
                break
            threading.Event().wait(0.01)
        with pytest.raises(TransferError, match="waiter chunk broke"):
            job.wait(timeout=30)
        assert job.status() == FAILED and mine == [1] and theirs == [1]
        assert eng.stats.jobs_d2h == 0
        monkeypatch.setattr(copy_cpu, "run_block_plan", real)
        eng.backup([0], [0]).wait(timeout=30)  # the engine still works


def test_a_layer_waiter_leaving_with_chunks_left_calls_a_helper_back(monkeypatch):
    """A helper that found every copy slot taken (the copy thread's and a ``wait_layer``
    waiter's) goes back to its queue; the waiter, leaving with chunks left, calls one back so
    its slot does not stay empty for the rest of the job."""
    d, h = pools("page_first")
    d.kv.normal_()
    ref = d.kv.clone()
    monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 1)
    monkeypatch.setattr(copy_cpu, "CHUNK_BYTES", PAGES * P * D * 2 // 3)  # 3 pieces a layer
    real = copy_cpu.run_page_runs
    first, second, hold = (threading.Event() for _ in range(3))
    mine, theirs = [], []

    class SpyQueue:  # the helpers' queue, counting what is posted to it
        def __init__(self, q):
            self.q, self.posted = q, []

        def put(self, work):
            self.posted.append(work)
            self.q.put(work)

        def get(self):
            return self.q.get()

    with split_engine(d, h) as eng:
        pages = list(range(PAGES))
        eng.backup(pages, pages).wait(timeout=30)
        d.kv.zero_()
        b = eng.backend
        for _ in b._helpers:  # every helper is busy until the end
            b._help_q.put(lambda: hold.wait(30))
        spy = b._help_q = SpyQueue(b._help_q)

        def gated(*args):
            if threading.current_thread() is threading.main_thread():
                mine.append(1)
            else:
                theirs.append(1)
                assert (first if len(theirs) == 1 else second).wait(30)
            real(*args)
            if len(mine) == 5:  # the waiter copied the rest of layers 0 and 1
                first.set()
        monkeypatch.setattr(copy_cpu, "run_page_runs", gated)
        job = eng.load(pages, pages)
        for _ in range(3000):
            if theirs:
                break
            threading.Event().wait(0.01)
        job.wait_layer(1, timeout=30)  # the copy thread is now held in its second chunk
        assert len(mine) == 5 and len(spy.posted) == 2  # the job's call, then the waiter's
        second.set()
        hold.set()
        job.wait(timeout=30)
        assert job.status() == DONE and torch.equal(d.kv, ref)
