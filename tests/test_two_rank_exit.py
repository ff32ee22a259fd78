"""The two-rank embedded-API sequence, run again and again (issue 34 point 7): divergent admits,
allocs and a finish on one rank make the agreement raise on both ranks; each run's ranks close
their caches, leave no hicache thread behind, and exit with their results (a rank lost to a
signal, e.g. SIGABRT from a joinable thread destroyed at exit, fails the run with RankError)."""

import threading

import pytest

from hicache.distributed import launch
from hicache.errors import DivergenceError

from helpers import make_cfg, write_kv_rows
from test_agreement_contents import CASES, PROMPT

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


# ---- every error path leaves no thread of ours behind ----------------------------------------
# With L3 on (its writer and prefetch threads, the L2 copy threads): a rank leaves a cache by a
# DivergenceError at a step then close(), by close(flush=False), by the exception leaving a
# ``with`` block (__exit__), and by an exception raised out of the rank's function (launch's
# error path: the rank reports, destroys its group and exits). Each path lists the live threads
# once the cache is gone.

def _live_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t is not threading.main_thread() and t.is_alive())


def _ready(cache, rid, tokens):
    cache.admit(rid, tokens)
    while not cache.prefix(rid).ready:  # the L3 lookup is agreed at a step
        cache.step()


def _l3_alloc_len(cache, rank):
    _ready(cache, "a", PROMPT)
    cache.alloc("a", 40 if rank else 17)


def _l3_finish_tokens(cache, rank):
    _ready(cache, "a", PROMPT)
    cache.alloc("a", 17)
    write_kv_rows(cache, "a", 17)
    cache.step()
    cache.finish("a", PROMPT[:9] if rank else PROMPT[:8])


def _l3_same(cache, rank):
    _ready(cache, "a", PROMPT)
    cache.alloc("a", 17)
    write_kv_rows(cache, "a", 17)
    cache.finish("a", PROMPT)


def _paths(rank, world, base):
    import json
    import os

    from hicache.errors import PeerError
    from hicache.service import HiCache

    def cache(name):
        return HiCache(make_cfg(f"{base}/{name}", dcp=2, l1_pages=16), rank, mode="l1+l2+l3")

    out = {}
    c = cache("step")  # DivergenceError at the step, then the ordinary close
    _l3_alloc_len(c, rank)
    try:
        c.step()
    except DivergenceError:
        out["step"] = "DivergenceError"
    c.close()
    out["step_threads"] = _live_threads()

    c = cache("noflush")  # the error close
    CASES["admit_rid"](c, rank)
    try:
        c.step()
    except DivergenceError:
        out["noflush"] = "DivergenceError"
    c.close(flush=False)
    out["noflush_threads"] = _live_threads()

    try:  # the exception leaves the block: __exit__
        with cache("with") as c:
            _l3_finish_tokens(c, rank)
            c.step()
    except DivergenceError:
        out["with"] = "DivergenceError"
    out["with_threads"] = _live_threads()

    try:  # one rank fails inside the block; the other closes normally and hears of it
        with cache("peer") as c:
            _l3_same(c, rank)
            c.step()
            if rank == 1:
                raise RuntimeError("rank 1 fails")
    except (RuntimeError, PeerError) as e:
        out["peer"] = type(e).__name__
    out["peer_threads"] = _live_threads()

    with open(os.path.join(base, f"paths-{rank}.json"), "w") as f:
        json.dump(out, f)
    try:  # the rank's function raises out: launch's error path
        c = cache("raise")
        _l3_same(c, rank)
        c.step()
        if rank == 1:
            raise RuntimeError("rank 1 leaves by an exception")
        try:
            c.close()
        except PeerError:
            pass
    finally:
        if rank == 1:
            c.close(flush=False)
        with open(os.path.join(base, f"raise-threads-{rank}.json"), "w") as f:
            json.dump(_live_threads(), f)
    return out


def test_every_error_path_joins_every_thread_we_start(tmp_path):
    import json

    import pytest

    from hicache.errors import RankError

    for i in range(2):
        base = tmp_path / f"run{i}"
        base.mkdir()
        with pytest.raises(RankError, match="rank 1 leaves by an exception"):
            launch(2, _paths, str(base), timeout_s=30)
        for rank in range(2):
            out = json.loads((base / f"paths-{rank}.json").read_text())
            assert {k: v for k, v in out.items() if k.endswith("_threads")} == {
                "step_threads": [], "noflush_threads": [], "with_threads": [],
                "peer_threads": []}, (i, rank, out)
            assert (out["step"], out["noflush"], out["with"]) == ("DivergenceError",) * 3
            assert out["peer"] == ("RuntimeError" if rank == 1 else "PeerError"), (i, rank, out)
            assert json.loads((base / f"raise-threads-{rank}.json").read_text()) == [], (i, rank)


# ---- a rank's script that ends by an uncaught error, its caches open -----------------------
# No launch, no close, no destroy_process_group: the interpreter exits with hicache's caches
# (L3 writer / prefetch / copy threads) and gloo's group alive, as an engine's script would.
# Each rank must exit 1 with the DivergenceError, never by a signal (SIGABRT: "terminate called
# without an active exception"). The cause, seen in a core dump: once Python finalizes, a
# thread that takes the GIL is ended by pthread_exit, which inside a C++ destructor calls
# std::terminate; gloo's worker thread takes it when it drops a finished collective's tensors
# (moments after the caller's wait returned: under load, after the caller began exiting), and
# our threads take it when a torch call returns. hicache.at_exit closes the open caches (our
# threads stop) and waits for the backend to let go of the tensors hicache lent it, before the
# interpreter finalizes. A hook registered before hicache is imported runs after hicache's:
# it lists the threads of ours still alive as finalization begins (none).
# tests/exit_abort_repro.py reproduces the abort on demand under gdb (and prints its stack).

OPEN_AT_EXIT = r"""
import atexit, datetime, faulthandler, json, sys, threading
faulthandler.enable()
atexit.register(lambda: print("ours at finalize:", json.dumps(sorted(
    t.name for t in threading.enumerate() if t.name.startswith("hicache")))))
sys.path[:0] = [sys.argv[4], sys.argv[5]]
import torch.distributed as dist
rank, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                        timeout=datetime.timedelta(seconds=30))
from hicache.service import HiCache
from helpers import make_cfg
import test_two_rank_exit as t
kept = []
for name in ("a", "b"):
    kept.append(HiCache(make_cfg(f"{base}/{name}", dcp=2, l1_pages=16), rank, mode="l1+l2+l3"))
    t._l3_same(kept[-1], rank)
    kept[-1].step()
c = HiCache(make_cfg(f"{base}/x", dcp=2, l1_pages=16), rank, mode="l1+l2+l3")
t._l3_alloc_len(c, rank)
c.step()
"""


def _pairs(script: str, n: int, args) -> list[list[tuple[int, str]]]:
    """Run ``n`` two-rank pairs of ``script`` at once (``args(pair, rank)``: its argv after the
    rank and port); every process's (exit status, output), pair by pair."""
    import subprocess
    import sys

    from hicache.distributed import free_port

    procs = []
    for i in range(n):
        port = str(free_port())
        procs.append([subprocess.Popen([sys.executable, "-c", script, str(r), port, *args(i, r)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True) for r in range(2)])
    return [[_finished(p) for p in pair] for pair in procs]


def _finished(p) -> tuple[int, str]:
    out = p.communicate(timeout=180)[0]
    return p.returncode, out


def _open_at_exit_runs(tmp_path, n: int) -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    runs = _pairs(OPEN_AT_EXIT, n,
                  lambda i, r: (str(tmp_path / f"run{i}"), os.path.dirname(here), here))
    for i, pair in enumerate(runs):
        for rank, (code, out) in enumerate(pair):
            assert "terminate called" not in out, (i, rank, out[-3000:])
            assert code == 1 and "DivergenceError" in out, (i, rank, code, out[-3000:])
            assert "ours at finalize: []" in out, (i, rank, out[-3000:])


def test_a_script_ending_by_an_error_with_caches_open_exits_without_a_signal(tmp_path):
    _open_at_exit_runs(tmp_path / "one", 1)


def test_that_script_run_three_times_at_once_exits_without_a_signal(tmp_path):
    # six ranks on a small box: the load under which the abort was first seen
    _open_at_exit_runs(tmp_path / "three", 3)


# ---- a collective the backend still holds when the interpreter exits -----------------------
# Made deterministic: rank 1 leaves by an error while its collective is still in the backend
# (an async all-reduce that rank 0 joins only once rank 1 is exiting), and its last exit hook
# holds the GIL in C for 2 s (as a loaded scheduler would keep the backend's thread off the
# GIL) until the interpreter finalizes. With the tensor lent (hicache.at_exit.lend) the exit
# waits for the backend to let go first; lent or not, rank 1 must exit 1 by its error. The same
# script with the tensor not lent is the control: on CPython < 3.14 it dies by SIGABRT.

LATE_COLLECTIVE = r"""
import atexit, ctypes, datetime, os, sys, time
rank, port, marker, lent = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if rank == 1:  # registered first, the last hook to run: 2 s in C holding the GIL (PyDLL)
    atexit.register(ctypes.PyDLL(None).usleep, 2_000_000)
sys.path.insert(0, sys.argv[5])
import torch, torch.distributed as dist
from hicache.at_exit import lend
if rank == 1:  # registered last: the first hook to run, then hicache's
    atexit.register(lambda: open(marker, "w").close())
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                        timeout=datetime.timedelta(seconds=30))
t = torch.tensor([rank, 1], dtype=torch.int64)
if rank == 0:
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.2)  # rank 1 is past its first hook
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    os._exit(0)
dist.all_reduce(lend(t) if lent else t, op=dist.ReduceOp.MIN, async_op=True)
class Late:  # Python code run while finalizing: a thread waiting for the GIL gets it then
    def __del__(self):
        time.sleep(0.1)
late = Late()
raise RuntimeError("rank 1 ends by an error")
"""


def test_a_collective_the_backend_still_holds_at_exit_is_waited_for(tmp_path):
    import os
    import signal
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = _pairs(LATE_COLLECTIVE, 2,
                  lambda i, r: (str(tmp_path / f"marker{i}"), "1" if i == 0 else "0", root))
    (c0, o0), (c1, o1) = runs[0]
    assert c0 == 0, o0[-3000:]
    assert c1 == 1 and "rank 1 ends by an error" in o1, (c1, o1[-3000:])
    assert "terminate called" not in o1, o1[-3000:]
    (c0, o0), (c1, o1) = runs[1]  # the control: the same exit with the tensor not lent
    assert c0 == 0, o0[-3000:]
    if sys.version_info < (3, 14):  # 3.14 parks such threads instead of ending them
        assert c1 == -signal.SIGABRT and "terminate called" in o1, (c1, o1[-3000:])
