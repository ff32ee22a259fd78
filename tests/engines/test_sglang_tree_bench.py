"""``bench/sglang_tree.py`` (SGLang's compiled tree core and its Python ``RadixCache`` on the
controller bench's traces) answers the bench's protocol with real SGLang: the same hit tokens as
ours, replayed in its process."""

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="module")
def replayer():
    sys.path.insert(0, BENCH)
    import controller as bench_controller
    r = bench_controller.SGLangReplayer(sys.executable)
    yield r
    r.close()


@pytest.mark.parametrize("tree", ["rust", "python"])
@pytest.mark.parametrize("page,budget", [(16, None), (16, 0.3), (64, None)])
def test_sglang_replay_hits_equal_ours_in_its_process_and_in_the_bench(replayer, page, budget,
                                                                      tree):
    import numpy as np

    import controller as bench_controller
    from hicache.workloads import chat_trace
    reqs = chat_trace(0, 0.05)
    uniq = bench_controller.unique_pages(reqs, page)
    l1_pages = uniq + 64 if budget is None else max(
        int(uniq * budget), 4 * max(len(r.tokens) for r in reqs) // page)  # as the bench sizes
    case = {"workload": "chat", "scale": 0.05, "seed": 0, "page": page, "l1_pages": l1_pages,
            "inflight": 4, "reps": 2, "ours": True, "tree": tree}
    got = replayer.replay(case)
    assert got["backend"] == tree and got["us_per_request"] > 0 and got["ours_us_per_request"] > 0
    arrays = [r.tokens.astype(np.int32) for r in reqs]
    hits, _ = bench_controller.replay_controller(arrays, page, l1_pages, 0, 4)
    ours = hits["l1"] + hits["l2"]
    assert ours > 0
    assert got["hit_tokens"] == got["ours_hit_tokens"] == ours


def test_bench_refs_sglang_compares_with_sglang_alone(tmp_path):
    """``bench/controller.py --refs sglang`` (what a production trace's full scale fits): no
    in-process Python reference, SGLang's two trees against ours, hits compared with theirs."""
    import json
    import subprocess
    r = subprocess.run([sys.executable, os.path.join(BENCH, "controller.py"), "--quick",
                        "--json", "--refs", "sglang", "--sglang", sys.executable,
                        "--workloads", "chat", "--pages", "16", "--capacities", "ample"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (row,) = out["rows"]
    assert "ref_us_per_request" not in row and "speedup" not in row
    assert out["min_speedup"] is None and out["min_page_speedup"] is None
    assert row["sglang_us_per_request"] > 0 and row["sglang_python_us_per_request"] > 0
    assert row["sglang_hit_tokens"] == row["hit_tokens"] == row["sglang_python_hit_tokens"] > 0
    assert row["identical_hits"] and out["hits_identical"]
