"""Batched speculative serving of a hybrid target (Kimi Linear, MLA + KDA) with a hybrid draft
(a perturbed copy of the target), through the cache: KDA state rolled back at every rejection
(``HybridRunner.verify_batch`` / ``rewind``), snapshots taken at committed positions only.

In process (DCP 1; also with a DeepSeek-shaped draft, whose cached draft KV hits restore) and
on 2 gloo ranks (DCP 2, one spawned group for the built-in model and the Kimi target): a cold
request, L1 hits verified in one batch, an L2 hit (its pages evicted by a long request, written
through), and an L3 hit after a restart all decode plain greedy decoding's tokens. In process,
the KDA snapshots the cache holds after the speculative run equal those of a run without
speculation.
"""

import numpy as np
import pytest
import torch

from spec_ckpt import perturbed_copy
from test_kimi_cache import kimi, toks  # noqa: F401  (the module's checkpoint fixture)
from test_kimi_cache_l3 import cfg_of

from hicache.distributed import launch
from hicache.serving import Server
from hicache.service import HiCache
from hicache.workloads import Request

K = 3


@pytest.fixture(scope="module")
def kimi_draft(kimi, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("kimi_draft") / "ckpt"
    perturbed_copy(kimi, d, scale=0.6, seed=5)
    return str(d)


@pytest.fixture(scope="module")
def ds_draft(tmp_path_factory):
    """A DeepSeek-shaped draft of the Kimi checkpoint's vocabulary (MLA only: its cached
    draft KV is all it needs, so hits restore it)."""
    from spec_ckpt import make_mtp_checkpoint
    d = tmp_path_factory.mktemp("ds_draft") / "ckpt"
    make_mtp_checkpoint(d, seed=6, with_mtp=False)
    return str(d)


def jobs():
    base = toks(1, 16)
    a = np.concatenate([base, toks(2, 5)])
    b = np.concatenate([base, toks(3, 5)])
    return [[Request("A", 0, a, 8, 0)], [Request("A2", 0, a.copy(), 8, 1),
                                          Request("B", 0, b, 8, 2)],
            [Request("Z", 0, toks(4, 116), 4, 3)], [Request("A3", 0, a.copy(), 8, 4)]], \
        [[Request("A4", 0, a.copy(), 8, 5)]]


def snapshots(cache) -> dict:
    """Position -> (conv, rec) of every snapshot the cache holds."""
    out, tier = {}, cache.companion("hybrid").tier
    for s in cache.ctrl.snaps.all():
        (conv, rec), _ = tier.get(s.l1, s.l2)
        out[s.pages * cache.page_tokens] = (conv.float().clone(), rec.float().clone())
    return out


def serve(path, draft_path, l3_dir, rank=0, group=None, spec=True):
    """Both runs (before and after a restart): {id: (output, hit, source)}, snapshots after
    the first."""
    from hicache.checkpoints.drafter import draft_spec
    from hicache.checkpoints.hf import load_model
    from hicache.serving.spec import SpecServing
    model = load_model(path)
    draft = load_model(draft_path) if spec else None
    cfg = cfg_of(path, l3_dir, 1 if group is None else 2).replace(
        policy={"write": "write_through"})
    out, snaps = {}, None
    for run in jobs():
        with HiCache(cfg, rank, group, mode="l1+l2+l3",
                     draft=draft_spec(draft, cfg.page_tokens) if spec else None) as cache:
            server = Server(model, cache, group=group, chunk_tokens=6, max_running=2,
                            spec=SpecServing(draft, K) if spec else None)
            for batch in run:
                for r in server.run(batch):
                    out[r.request_id] = (r.output, r.hit, r.spec["source"] if r.spec else None,
                                         r.spec)
            assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
            cache.drain()
            if snaps is None:
                snaps = snapshots(cache)
    return out, snaps


def plain_tokens(path):
    from hicache.checkpoints.hf import load_model
    model = load_model(path)
    return {j.request_id: model.generate(j.tokens.tolist(), j.output_len)
            for runs in jobs() for batch in runs for j in batch}


def check(out, want, hybrid_draft=True):
    """Plain tokens; target hits from L1, L2 and L3; each request's draft KV source (a hybrid
    draft recomputes every hit: its KDA state is not cached)."""
    assert {k: v[0] for k, v in out.items()} == want
    src = {k: v[2] for k, v in out.items()}
    hit = "recomputed" if hybrid_draft else None
    assert src == {"A": "cold", "A2": hit or "l1", "B": hit or "l1", "Z": "cold",
                   "A3": hit or "l2", "A4": hit or "l3"}
    # (snapshots every 8 tokens and at A's fed end, 28: the hits end at the one at 16)
    assert out["B"][1]["l1"] == 16 and out["A3"][1]["l2"] > 0 and out["A4"][1]["l3"] == 16
    sp = [v[3] for v in out.values()]
    assert sum(s["proposed"] for s in sp) > sum(s["accepted"] for s in sp)  # rollbacks
    if hybrid_draft:
        assert sum(s["accepted"] for s in sp) > 0


@pytest.mark.parametrize("hybrid_draft", [True, False], ids=["kimi_draft", "deepseek_draft"])
def test_kimi_target_serves_speculatively_with_each_hit(kimi, kimi_draft, ds_draft,  # noqa: F811
                                                        tmp_path, hybrid_draft):
    draft = kimi_draft if hybrid_draft else ds_draft
    out, snaps = serve(kimi, draft, tmp_path / "spec")
    check(out, plain_tokens(kimi), hybrid_draft)
    ref, ref_snaps = serve(kimi, draft, tmp_path / "plain", spec=False)
    assert {k: v[:2] for k, v in out.items()} == {k: v[:2] for k, v in ref.items()}
    assert snaps.keys() == ref_snaps.keys() and snaps
    for p, (conv, rec) in snaps.items():
        assert torch.allclose(conv, ref_snaps[p][0], atol=1e-5), p
        assert torch.allclose(rec, ref_snaps[p][1], atol=1e-5), p


def _dist_worker(rank, world, kimi_path, draft_path, l3_dir, builtin):
    import torch.distributed as dist
    group = dist.group.WORLD
    out = {"kimi": serve(kimi_path, draft_path, f"{l3_dir}/kimi", rank, group)[0]}
    out["builtin"] = builtin_run(rank, group, f"{l3_dir}/builtin", *builtin)
    return out


def builtin_run(rank, group, l3_dir, draft_file, runs):
    """The built-in model with a draft file: each run a fresh cache over the same store (the
    second a restart), each run a list of batches; {id: (output, source)}."""
    from helpers import make_cfg
    from hicache.checkpoints.drafter import draft_spec
    from hicache.engine.model import MLAModel
    from hicache.serving import model_config
    from hicache.serving.spec import SpecServing
    cfg = make_cfg(l3_dir, dcp=2, l1_pages=64)
    model = MLAModel(model_config(cfg))
    draft = MLAModel.load(draft_file)
    res = {}
    for run in runs:
        with HiCache(cfg, rank, group, mode="l1+l2+l3",
                     draft=draft_spec(draft, cfg.page_tokens)) as cache:
            server = Server(model, cache, group=group, chunk_tokens=16, max_running=3,
                            spec=SpecServing(draft, K))
            for batch in run:
                res.update({r.request_id: (r.output, r.spec["source"])
                            for r in server.run(batch)})
            assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
            cache.drain()
    return res


def test_dcp2_spec_serving_builtin_and_kimi(kimi, kimi_draft, tmp_path):  # noqa: F811
    from helpers import make_cfg
    from test_spec_cache import noisy
    from hicache.engine.model import MLAModel
    from hicache.serving import model_config
    model = MLAModel(model_config(make_cfg(tmp_path / "x", dcp=2)))
    draft_file = tmp_path / "draft.pt"
    noisy(model, 3, scale=0.1).save(draft_file)
    shared = toks(9, 40)
    a, b, c = (np.concatenate([shared, toks(10 + i, 6)]) for i in range(3))
    runs = [[[Request("a", 0, a, 9, 0)],
             [Request("b", 0, b, 9, 1), Request("c", 0, c, 9, 2),
              Request("d", 0, toks(14, 30), 9, 3)]],
            [[Request("a2", 0, a.copy(), 9, 4)]]]
    ranks = launch(2, _dist_worker, kimi, kimi_draft, str(tmp_path / "l3"),
                   (str(draft_file), runs), timeout_s=600)
    assert ranks[0] == ranks[1]
    check(ranks[0]["kimi"], plain_tokens(kimi))
    got = ranks[0]["builtin"]
    for run in runs:
        for batch in run:
            for j in batch:
                assert got[j.request_id][0] == model.generate(j.tokens.tolist(), j.output_len)
    assert {k: v[1] for k, v in got.items()} == {"a": "cold", "b": "l1", "c": "l1",
                                                  "d": "cold", "a2": "l3"}
