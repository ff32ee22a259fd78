"""MTP draft pages in the cache, and the page boundary (issue 25 point 4 with an MTP module).

An MTP row at position i is computed from (embed(t_{i+1}), the target's hidden state at i):
the LAST row of a page depends on the token after the page, which the page's chain does not
name. So a cached MTP page counts for a prefix only when its last row was computed with the
token that follows the page in THIS prompt (L1/L2: kept per page; L3: the key names it). When
the hit's pages all qualify, the module goes on from the hit with the cached rows (the same rows
and drafts as an uncached run); otherwise the module starts at the hit's end in the request's
own pages (the shared pages' draft rows are never written) and the tokens are still plain
greedy decoding's."""

import numpy as np
import pytest
import torch

from helpers import l3_writes_land_at_once, tiny_sections
from spec_cache_loop import draft_rows, spec_request
from spec_ckpt import make_mtp_checkpoint

from hicache import HiCache
from hicache.checkpoints.drafter import draft_spec, load_draft
from hicache.checkpoints.hf import load_model
from hicache.config import HiCacheConfig
from hicache.engine.spec import SpecSettings

K, NEW = 3, 9


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtpcache")
    make_mtp_checkpoint(root / "target", seed=1)
    target = load_model(root / "target")
    mtp = load_draft(SpecSettings("mtp"), target, str(root / "target"))
    return str(root / "target"), target, mtp


def cfg_of(path, l3):
    d = tiny_sections(l3, l3={"size_bytes": 64 << 20},
                      policy={"l3_cost_model": False, "prefetch": "wait_complete"})
    d["model"] = {"path": path, "signature": "mtp-test"}  # the checkpoint's KV shape
    return HiCacheConfig.from_dict(d)


def pair(shared, seed):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 96, shared)
    return [np.concatenate([s, rng.integers(0, 96, 46 - shared)]) for _ in range(2)]


def reference(cfg, target, mtp, prompt, tmp):
    with HiCache(cfg.replace(l3={"path": str(tmp)}), mode="l1",
                 draft=draft_spec(mtp, cfg.page_tokens)) as cache:
        out, p, st, _ = spec_request(cache, target, mtp, "ref", prompt, K, NEW)
        return out, draft_rows(cache, p.page_table, len(prompt) - 1), st


def test_a_hit_whose_next_token_matches_reuses_the_mtp_rows(tmp_path, ck):
    path, target, mtp = ck
    cfg = cfg_of(path, tmp_path / "l3")
    a, b = pair(42, 0)  # the hit is 40 tokens; token 40 is shared too
    with HiCache(cfg, mode="l1", draft=draft_spec(mtp, cfg.page_tokens)) as cache:
        spec_request(cache, target, mtp, "a", a, K, NEW)
        out, p, st, _ = spec_request(cache, target, mtp, "b", b, K, NEW)
        assert p.device_len == 40 and p.draft_len == 40
        rows = draft_rows(cache, p.page_table, len(b) - 1)
    ref_out, ref_rows, ref_st = reference(cfg, target, mtp, b, tmp_path / "r")
    assert out == ref_out == target.generate(b.tolist(), NEW)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=1e-5)
    assert st.to_dict() == ref_st.to_dict() and st.proposed > 0


def test_a_hit_whose_next_token_differs_starts_the_module_at_the_hit(tmp_path, ck):
    path, target, mtp = ck
    cfg = cfg_of(path, tmp_path / "l3")
    a, b = pair(40, 1)  # the hit is 40 tokens and token 40 differs
    assert a[40] != b[40]
    with HiCache(cfg, mode="l1", draft=draft_spec(mtp, cfg.page_tokens)) as cache:
        _, pa, _, _ = spec_request(cache, target, mtp, "a", a, K, NEW)
        before = draft_rows(cache, pa.page_table, 40).clone()
        out, p, st, _ = spec_request(cache, target, mtp, "b", b, K, NEW)
        # pages 0..8 qualify; page 9's last row was computed with a's token 40, not b's
        assert p.device_len == 40 and p.draft_len == 36
        assert st.proposed > 0  # the module drafted from the hit's end on
        assert torch.equal(draft_rows(cache, p.page_table, 40), before)  # shared rows intact
    assert out == target.generate(b.tolist(), NEW)


def test_mtp_pages_through_l3_name_the_next_token(tmp_path, ck):
    path, target, mtp = ck
    cfg = cfg_of(path, tmp_path / "l3")
    a, b = pair(42, 2)
    c = np.concatenate([a[:40], (a[40:] + 1) % 96])  # c[40] != a[40]
    with l3_writes_land_at_once():
        with HiCache(cfg, draft=draft_spec(mtp, cfg.page_tokens)) as cache:
            spec_request(cache, target, mtp, "a", a, K, NEW)
        with HiCache(cfg, draft=draft_spec(mtp, cfg.page_tokens)) as cache:
            out_b, pb, sb, _ = spec_request(cache, target, mtp, "b", b, K, NEW)
            assert pb.storage_len == 40 and pb.draft_len == 40
            rows = draft_rows(cache, pb.page_table, len(b) - 1)
        with HiCache(cfg, draft=draft_spec(mtp, cfg.page_tokens)) as cache:
            out_c, pc, _, _ = spec_request(cache, target, mtp, "c", c, K, NEW)
            assert pc.storage_len == 40 and pc.draft_len == 36  # the last key names a[40]
    ref_out, ref_rows, ref_st = reference(cfg, target, mtp, b, tmp_path / "r")
    assert out_b == ref_out == target.generate(b.tolist(), NEW)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=1e-5)
    assert sb.to_dict() == ref_st.to_dict()
    assert out_c == target.generate(c.tolist(), NEW)


def test_restored_mtp_rows_without_prefill_hidden_states(tmp_path, ck):
    # a PCP prefill gives no hidden states: the restored rows cannot be gone on from, so the
    # module starts at the first decoded position, past the hit's shared pages
    path, target, mtp = ck
    cfg = cfg_of(path, tmp_path / "l3")
    a, b = pair(42, 3)
    with HiCache(cfg, mode="l1", draft=draft_spec(mtp, cfg.page_tokens)) as cache:
        _, pa, _, _ = spec_request(cache, target, mtp, "a", a, K, NEW)
        before = draft_rows(cache, pa.page_table, 40).clone()
        out, p, st, d = spec_request(cache, target, mtp, "b", b, K, NEW, hidden=False)
        assert p.draft_len == 40 and st.proposed > 0 and d.valid_len() == 0
        assert torch.equal(draft_rows(cache, p.page_table, 40), before)
    assert out == target.generate(b.tolist(), NEW)
