"""Every companion's per-request length is in the step's content digest (issue 33 point 5), on
ONE real 2-rank gloo group with a 20 s collective timeout (a hang fails the test, never stalls).

The issue's case: two ranks finish the same request, but rank 0 keeps 16 draft tokens and rank
1 keeps none. Before, ``finish(draft_len=)`` was in no agreement: the ranks' draft state
differed unnoticed, and the group waited out the gloo timeout once their proposals differed.
Now the next ``step`` raises ``DivergenceError`` on BOTH ranks naming the finish, the caches stop
alike and leak nothing, and the group still carries a collective. The same for a hybrid model's
snapshot positions (rank 1 hands over no KDA state). Ranks that agree pay one collective.
"""

import numpy as np
import pytest
import torch

from hicache.distributed import CollectiveCounter, launch
from hicache.errors import DivergenceError

from helpers import make_cfg, write_kv_rows

PROMPT = np.random.default_rng(0).integers(0, 128, 17)


def _draft_spec(cfg):
    from hicache.companions.draft import DraftSpec
    from hicache.page_format import PageFormat
    fmt = PageFormat.replicated(2, cfg.cache.page_size, cfg.parallel.dcp, 40, torch.float32)
    return DraftSpec(fmt, "draft-test")


def write_draft_rows(cache, rid, end: int) -> None:
    """Draft KV rows at every draft layer for positions [0, end), through the checked port."""
    from hicache.kvport import RowWrite
    kv, table = cache.draft.kv, cache.prefix(rid).page_table
    w = RowWrite.for_positions(kv.layout, torch.tensor(table), table, 0, end)
    for layer in range(kv.num_layers):
        kv.write(layer, w, torch.full((end, kv.kv_dim), float(layer + 1)))


def _draft_case(kept):
    def run(base, rank):
        from hicache.service import HiCache
        cfg = make_cfg(base, dcp=2, l1_pages=16)
        cache = HiCache(cfg, rank, mode="l1", draft=_draft_spec(cfg))
        cache.admit("a", PROMPT)
        cache.alloc("a", 17)
        write_kv_rows(cache, "a", 17)
        write_draft_rows(cache, "a", 16)
        cache.finish("a", PROMPT, draft_len=kept[rank])
        return cache
    return run


def _snapshot_case(kimi):
    def run(base, rank):
        from hicache.service import HiCache
        from test_kimi_cache_l3 import cfg_of
        cfg = cfg_of(kimi, base, dcp=2).replace(l3={"enabled": False})
        cache = HiCache(cfg, rank, mode="l1")
        cache.admit("a", PROMPT)
        cache.alloc("a", 17)
        write_kv_rows(cache, "a", 17)
        fmt, conv = cfg.state_format, _conv(cfg)
        state = (torch.zeros(fmt.layers, conv), torch.zeros(fmt.layers, fmt.row_width - conv))
        cache.finish("a", PROMPT, {16: state} if rank == 0 else {})
        return cache
    return run


def _conv(cfg):
    from hicache.companions.snapshot_format import conv_elems
    return conv_elems(cfg)


def _group(rank, world, base, kimi):
    from test_faults import leaks
    cases = {"draft_16_vs_0": _draft_case((16, 0)), "draft_same": _draft_case((16, 16)),
             "snapshots_differ": _snapshot_case(kimi)}
    out = {}
    for name, fn in cases.items():
        cache = fn(f"{base}/{name}", rank)
        with CollectiveCounter.measure() as n:
            try:
                res = "ok", cache.step()
            except DivergenceError as e:
                res = "DivergenceError", str(e)
        out[name] = {"res": res, "collectives": n["n"], "leaks": leaks(cache),
                     "stopped": cache._failed is not None,
                     "draft_pages": (cache.stats().get("draft") or {}).get("l1_pages_present")}
        cache.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_kimi_engine import make_checkpoint
    d = tmp_path_factory.mktemp("kimi_agree") / "ckpt"
    make_checkpoint(d, kda=[1, 2, 4], full=[3], first_dense=1, seed=3)
    return launch(2, _group, str(tmp_path_factory.mktemp("agree")), str(d), timeout_s=120)


@pytest.mark.parametrize("case", ["draft_16_vs_0", "snapshots_differ"])
def test_a_companion_length_that_differs_raises_on_both_ranks_at_that_step(runs, case):
    for rank in (0, 1):
        r = runs[rank][case]
        kind, msg = r["res"]
        assert kind == "DivergenceError", (rank, r["res"])
        assert "step 0" in msg and "finish('a'" in msg, msg  # names the finish that differs
        assert r["stopped"] and r["leaks"] == {} and r["collectives"] >= 1


def test_the_draft_length_differing_is_named_in_the_message(runs):
    msg = runs[0]["draft_16_vs_0"]["res"][1]
    assert ", 16)" in msg and ", 0)" in msg, msg


def test_ranks_that_keep_the_same_draft_pay_one_collective(runs):
    for rank in (0, 1):
        r = runs[rank]["draft_same"]
        assert r["res"] == ("ok", []) and r["collectives"] == 1 and not r["stopped"]
        assert r["draft_pages"] == 2  # the 2 whole pages (16 tokens) below draft_len
