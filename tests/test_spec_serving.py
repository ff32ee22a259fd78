"""Batched speculative decoding in the serving loop (``hicache.serving`` with
``hicache.serving.spec``): every running request drafts k tokens, the batch verifies in one
target step per round, each request accepts its own prefix.

One rank, the built-in model and a draft close to it (the target plus seeded noise): requests
whose draft KV is cold, an L1 hit, an L2 hit, an L3 hit after a restart, and a hit on pages
written without speculation (the draft recomputes the absent part) all decode plain greedy
decoding's tokens, several requests verify in one target step, and each request's source is
the tier its draft KV came from. Draft pages damaged in L1 keep the tokens (lossless) but
their requests accept less than cold ones: the bench's alarm flags that source.
"""

import numpy as np
import pytest
import torch

from helpers import make_cfg
from test_spec_cache import noisy

from hicache import HiCache
from hicache.commands.bench_spec import spec_summary
from hicache.checkpoints.drafter import draft_spec
from hicache.engine.model import MLAModel
from hicache.serving import Server, model_config
from hicache.serving.spec import SpecServing
from hicache.workloads import Request

K, NEW = 3, 13


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory.mktemp("m") / "l3")
    model = MLAModel(model_config(cfg))
    return model, noisy(model, 3, scale=0.1)


def toks(seed, n):
    return np.random.default_rng(seed).integers(0, 128, n).astype(np.int64)


def job(rid, tokens, out=NEW):
    return Request(rid, 0, tokens, out, 0)


def run_all(server, batches):
    return {r.request_id: r for b in batches for r in server.run(b)}


def check_plain(model, jobs, results):
    for j in jobs:
        assert results[j.request_id].output == model.generate(j.tokens.tolist(), j.output_len), \
            j.request_id


def test_batched_spec_serving_is_plain_decoding_with_each_draft_source(models, tmp_path):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", l1_pages=40, l2_ratio=4.0, write="write_through")
    shared = toks(1, 40)
    a = job("A", np.concatenate([shared, toks(2, 6)]))
    b = job("B", np.concatenate([shared, toks(3, 6)]))
    c = job("C", toks(4, 30))
    z = job("Z", toks(5, 120))  # evicts the others' pages from L1 (their L2 copies stay)
    a2 = job("A2", a.tokens.copy())
    spec = SpecServing(draft, K)
    with HiCache(cfg, mode="l1+l2+l3", draft=draft_spec(draft, cfg.page_tokens)) as cache:
        server = Server(model, cache, chunk_tokens=16, max_running=2, spec=spec)
        got = run_all(server, [[a], [b, c], [z], [a2]])
        batched = server.rounds
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        cache.drain()
    # a restart: empty L1 and L2, the same store; then a prefix written without speculation
    a3 = job("A3", a.tokens.copy())
    g = job("G", np.concatenate([toks(6, 36), toks(7, 4)]))
    h = job("H", np.concatenate([g.tokens[:36], toks(8, 4)]))
    with HiCache(cfg, mode="l1+l2+l3", draft=draft_spec(draft, cfg.page_tokens)) as cache:
        got.update(run_all(Server(model, cache, chunk_tokens=16, spec=spec), [[a3]]))
        got.update(run_all(Server(model, cache, chunk_tokens=16), [[g]]))  # no draft KV
        got.update(run_all(Server(model, cache, chunk_tokens=16, spec=spec), [[h]]))
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
    check_plain(model, [a, b, c, z, a2, a3, g, h], got)
    src = {k: r.spec["source"] for k, r in got.items() if r.spec}
    assert src == {"A": "cold", "B": "l1", "C": "cold", "Z": "cold", "A2": "l2", "A3": "l3",
                   "H": "recomputed"}
    assert got["A2"].hit["l2"] == 44 and got["A3"].hit["l3"] == 44
    assert got["H"].spec["draft_recomputed_tokens"] == got["H"].hit["l1"] == 36
    assert all(got[k].spec["draft_recomputed_tokens"] == 0 for k in src if k != "H")
    # B and C verified together: fewer batched target steps than the requests' own rounds
    steps = {k: r.spec["target_steps"] for k, r in got.items() if k in "ABCZ" or k == "A2"}
    assert batched < sum(steps.values())
    s = spec_summary([r.spec for r in got.values() if r.spec])
    assert s["requests"] == 7 and s["tokens_per_target_step"] > 1.5
    assert set(s["by_source"]) == {"cold", "l1", "l2", "l3", "recomputed"}
    assert s["flagged"] == [] and all(b["accepted"] > 0 for b in s["by_source"].values())


def test_damaged_draft_pages_keep_the_tokens_and_are_flagged(models, tmp_path):
    """Draft KV restored wrong (here: the L1 draft rows of a cached prefix overwritten with
    noise) cannot change a token, but its requests accept less than cold ones: flagged."""
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", l1_pages=64)
    shared = toks(11, 40)
    first = job("P", np.concatenate([shared, toks(12, 4)]))
    hits = [job(f"H{i}", np.concatenate([shared, toks(20 + i, 4)])) for i in range(3)]
    colds = [job(f"C{i}", toks(30 + i, 44)) for i in range(3)]
    with HiCache(cfg, mode="l1", draft=draft_spec(draft, cfg.page_tokens)) as cache:
        server = Server(model, cache, chunk_tokens=16, max_running=2,
                        spec=SpecServing(draft, K))
        got = run_all(server, [[first]])
        pool = cache.draft.l1
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # every draft row in L1 (P's pages among them) becomes noise
            pool.kv.copy_(torch.randn(pool.kv.shape, generator=g) * 3)
        got.update(run_all(server, [hits + colds]))
    check_plain(model, [first] + hits + colds, got)
    assert {got[j.request_id].spec["source"] for j in hits} == {"l1"}
    s = spec_summary([got[j.request_id].spec for j in hits + colds])
    assert s["by_source"]["l1"]["acceptance_rate"] < s["by_source"]["cold"]["acceptance_rate"]
    assert s["flagged"] == ["l1"]


def test_mtp_drafts_in_the_serving_loop(tmp_path):
    """An MTP module drafts for every running request from the target's final hidden states
    (prefill chunks, then each round's accepted positions); an L1 hit whose pages' MTP rows
    came back goes on from them, one whose next token differs starts at the hit's end; the
    tokens are plain decoding's."""
    from spec_ckpt import make_mtp_checkpoint
    from hicache.checkpoints.hf import load_model
    from hicache.checkpoints.mtp import load_mtp
    from hicache.config import HiCacheConfig
    path = tmp_path / "ckpt"
    make_mtp_checkpoint(path, seed=1)
    target = load_model(path)
    mtp = load_mtp(path, target)
    cfg = HiCacheConfig.from_dict({"model": {"path": str(path)}, "cache": {"page_size": 4},
                                   "l1": {"num_pages": 48}, "policy": {"l3_cost_model": False}})
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 96, 24)
    a = job("A", np.concatenate([shared, rng.integers(0, 96, 5)]), 9)
    same = job("S", a.tokens.copy(), 9)  # the same prompt: every hit page's next token matches
    other = job("O", np.concatenate([shared, rng.integers(0, 96, 5)]), 9)
    with HiCache(cfg, mode="l1", draft=draft_spec(mtp, cfg.page_tokens)) as cache:
        server = Server(target, cache, chunk_tokens=7, max_running=2, spec=SpecServing(mtp, 2))
        got = run_all(server, [[a], [same, other]])
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
    check_plain(target, [a, same, other], got)
    assert got["S"].hit["l1"] == 28 and got["S"].spec["source"] == "l1"
    # O's hit: 24 shared tokens; the page ending at 24 was cached with A's token 24 after it
    assert got["O"].hit["l1"] == 24 and got["O"].spec["source"] == "recomputed"
    assert all(r.spec["proposed"] > 0 for r in got.values())


def test_rows_of_rejected_positions_never_reach_the_cache(models, tmp_path):
    """Pages written by speculating requests (where rows of rejected drafts were written, then
    overwritten) are served to later requests with exactly recompute's rows: every served
    page's rows and every first-token logit equal a recompute run's (``hicache.kvcheck``),
    the pages of A's generated tokens among them (a next turn's hit)."""
    from hicache.kvcheck import KVProbe, compare
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", l1_pages=64)
    shared = toks(41, 40)
    a = job("A", np.concatenate([shared, toks(42, 5)]), 17)
    gen = model.generate(a.tokens.tolist(), 17)
    turn2 = job("A+", np.concatenate([a.tokens, np.asarray(gen), toks(43, 7)]), 9)
    b = job("B", np.concatenate([shared, toks(44, 5)]), 9)
    probes, outs = {}, {}
    for mode in ("recompute", "l1"):
        spec = mode == "l1"
        with HiCache(cfg, mode=mode, draft=draft_spec(draft, cfg.page_tokens)) as cache:
            probe = KVProbe(cache.kv, cache.page_tokens, all_pages=not spec)
            server = Server(model, cache, chunk_tokens=16, max_running=2, probe=probe,
                            spec=SpecServing(draft, K) if spec else None)
            outs[mode] = run_all(server, [[a], [b, turn2]])
            probes[mode] = probe.result()
    assert {k: r.output for k, r in outs["l1"].items()} == \
        {k: r.output for k, r in outs["recompute"].items()}
    assert outs["l1"]["A"].output == gen and outs["l1"]["A"].spec["accepted"] < \
        outs["l1"]["A"].spec["proposed"]  # A rejected drafts: rows it wrote were rolled back
    assert outs["l1"]["A+"].hit["l1"] == 60  # A's prompt and generated tokens, whole pages
    cmp = compare(probes["recompute"], probes["l1"])
    assert cmp.ok and cmp.pages >= 15, cmp.line()


def test_draft_models_draft_in_one_batch(models):
    """``propose_batch``: draft-model drafters on one runner propose what each would alone,
    in k batched draft steps (one per chained token) instead of one per request and token."""
    from hicache.engine.runner import RequestState, reserve
    from hicache.engine.spec import DraftModelDrafter, propose_batch, replicated_runner
    from hicache.pages import PageAllocator
    _, draft = models
    seqs = [toks(50 + i, n).tolist() for i, n in enumerate((9, 14, 5))]
    ks = [3, 1, 2]

    def drafters():
        run = replicated_runner(draft, 4, 32, "torch")
        alloc = PageAllocator(32)
        out = []
        for s in seqs:
            st = RequestState()
            reserve(st, alloc, len(s) + 4, 4)
            d = DraftModelDrafter(run, st.page_table)
            d.catch_up(s[:-2])  # each at another position: catch-ups of 3 tokens
            out.append(d)
        return run, out

    alone = [d.propose(s, k) for d, s, k in zip(drafters()[1], seqs, ks)]
    run, ds = drafters()
    before = run.stats.layers_run
    assert propose_batch(ds, seqs, ks) == alone
    assert run.stats.layers_run - before == max(ks) * draft.cfg.num_layers  # k batched steps
