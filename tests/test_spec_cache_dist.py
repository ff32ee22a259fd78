"""The cache holds both, on two real gloo ranks (issue 25 points 3 and 4): a speculative
request's draft pages are replicated on both ranks, stored in L3 ONCE for the group (rank 0
writes, both read), and a warm restart hits L3 for both the target's and the draft's pages with
plain decoding's tokens, with a draft model and with the checkpoint's MTP module. A draft read
that fails on one rank only is agreed away on both (the draft is recomputed alike, the target
hit stays). One spawned group runs every check."""

import copy

import numpy as np
import torch

from helpers import make_cfg
from spec_cache_loop import spec_request

from hicache import HiCache
from hicache.checkpoints.drafter import draft_spec
from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.serving import model_config

K, NEW = 3, 13


def _models(cfg):
    model = MLAModel(model_config(cfg))  # seeded: the same weights on every rank
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=g))
    return model, draft


def _prompts(seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 128, 40)
    return [np.concatenate([shared, rng.integers(0, 128, 6)]) for _ in range(3)]


def _cache(cfg, draft):
    import torch.distributed as dist
    return HiCache(cfg, rank=dist.get_rank(), draft=draft_spec(draft, cfg.page_tokens))


def _flush_l3(cache):
    cache.drain()  # backups agreed, L3 writes flushed (draft pages: written at once)


def _warm_restart(rank, cfg, model, draft) -> dict:
    a, b, c = _prompts(0)
    with _cache(cfg, draft) as cache:
        out_a, _, sa, _ = spec_request(cache, model, draft, "a", a, K, NEW)
        out_b, pb, sb, _ = spec_request(cache, model, draft, "b", b, K, NEW)  # L1 hit
        _flush_l3(cache)
        written = cache.draft.stats.pages["l3_write"]
    with _cache(cfg, draft) as cache:  # warm restart: L1 and L2 empty, L3 holds both
        out_c, pc, sc, _ = spec_request(cache, model, draft, "c", c, K, NEW)
        read = cache.draft.stats.pages["l3_read"]
    return {"outs": [out_a, out_b, out_c], "prompts": [a.tolist(), b.tolist(), c.tolist()],
            "b": (pb.device_len, pb.draft_len, sb.draft_recomputed_tokens),
            "c": (pc.storage_len, pc.draft_len, sc.draft_recomputed_tokens),
            "accepted": [sa.accepted, sb.accepted, sc.accepted],
            "proposed": [sa.proposed, sb.proposed, sc.proposed],
            "written": written, "read": read}


def _one_rank_fails_its_draft_read(rank, cfg, model, draft) -> dict:
    a, b, _ = _prompts(1)
    with _cache(cfg, draft) as cache:
        spec_request(cache, model, draft, "a", a, K, NEW)
        _flush_l3(cache)
    with _cache(cfg, draft) as cache:
        if rank == 1:  # this rank's draft read fails: the MIN agreement says 0 pages
            cache.draft.read_l3 = lambda chains, next_tokens=None: None
        out, p, st, _ = spec_request(cache, model, draft, "b", b, K, NEW)
    return {"out": out, "prompt": b.tolist(),
            "b": (p.storage_len, p.draft_len, st.draft_recomputed_tokens)}


def _mtp_warm_restart(rank, root) -> dict:
    from hicache.checkpoints.drafter import load_draft
    from hicache.checkpoints.hf import load_model
    from hicache.engine.spec import SpecSettings
    from test_spec_cache_mtp import cfg_of
    target = load_model(f"{root}/mtp")
    mtp = load_draft(SpecSettings("mtp"), target, f"{root}/mtp")
    cfg = cfg_of(f"{root}/mtp", f"{root}/l3m").replace(parallel={"tp": 2, "dcp": 2})
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 96, 44)  # the hit is 40 tokens; token 40 is shared too
    a, b = (np.concatenate([shared, rng.integers(0, 96, 2)]) for _ in range(2))
    with _cache(cfg, mtp) as cache:
        spec_request(cache, target, mtp, "a", a, K, 9)
        _flush_l3(cache)
    with _cache(cfg, mtp) as cache:
        out, p, st, _ = spec_request(cache, target, mtp, "b", b, K, 9)
    return {"out": out, "prompt": b.tolist(), "b": (p.storage_len, p.draft_len),
            "proposed": st.proposed}


def _worker(rank, world, root):
    cfg = make_cfg(f"{root}/l3", dcp=world, prefetch="wait_complete")
    model, draft = _models(cfg)
    warm = _warm_restart(rank, cfg, model, draft)
    cfg2 = make_cfg(f"{root}/l3b", dcp=world, prefetch="wait_complete")
    fail = _one_rank_fails_its_draft_read(rank, cfg2, model, draft)
    return {"warm": warm, "fail": fail, "mtp": _mtp_warm_restart(rank, root)}


def test_two_ranks_cache_the_draft_once_and_restart_warm(tmp_path):
    from spec_ckpt import make_mtp_checkpoint
    make_mtp_checkpoint(tmp_path / "mtp", seed=1)
    res = launch(2, _worker, str(tmp_path), backend="gloo", timeout_s=600)
    model, _ = _models(make_cfg(tmp_path / "x", dcp=2))
    w0, w1 = res[0]["warm"], res[1]["warm"]
    for prompt, out in zip(w0["prompts"], w0["outs"]):
        assert out == model.generate(prompt, NEW)  # lossless: plain greedy decoding's tokens
    assert w1["outs"] == w0["outs"]
    for w in (w0, w1):
        assert w["b"] == (40, 40, 0)  # L1 hit, draft pages too, nothing recomputed
        assert w["c"] == (40, 40, 0)  # warm restart: L3 hit for the target and the draft
        assert w["accepted"] == w0["accepted"] and 0 < sum(w["accepted"]) < sum(w["proposed"])
        assert w["read"] >= 5  # the 5 draft pages (8 tokens) of the hit, read by EVERY rank
    assert w0["written"] > 0 and w1["written"] == 0  # one copy for the group: rank 0 writes
    f0, f1 = res[0]["fail"], res[1]["fail"]
    assert f0["out"] == f1["out"] == model.generate(f0["prompt"], NEW)
    assert f0["b"] == f1["b"] == (40, 0, 40)  # agreed: no rank restores the draft, both redo it
    from hicache.checkpoints.hf import load_model
    m0, m1 = res[0]["mtp"], res[1]["mtp"]
    assert m0["out"] == m1["out"] == load_model(tmp_path / "mtp").generate(m0["prompt"], 9)
    assert m0["b"] == m1["b"] == (40, 40) and m0["proposed"] > 0  # MTP rows from L3
