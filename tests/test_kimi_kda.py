"""KDA math: the chunked form equals the token loop; the short convolution carries its window."""

import pytest
import torch

from hicache.engine import kda


def inputs(t, heads=3, dk=5, dv=4, seed=0, strong=False):
    g = torch.Generator().manual_seed(seed)
    q = kda.l2norm(torch.randn(t, heads, dk, generator=g)) * dk ** -0.5
    k = kda.l2norm(torch.randn(t, heads, dk, generator=g))
    v = torch.randn(t, heads, dv, generator=g)
    # log-decays: mild, or strong enough that e^(-sum g) over a chunk would overflow fp32
    raw = torch.randn(t, heads, dk, generator=g) * (3.0 if strong else 1.0)
    a_log = torch.rand(heads, generator=g) * (3.0 if strong else 1.0)
    gate = kda.forget_gate(raw, a_log, torch.zeros(heads * dk))
    beta = torch.sigmoid(torch.randn(t, heads, generator=g))
    s0 = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("t, chunk, strong", [(1, 32, False), (37, 8, False), (64, 32, True),
                                              (70, 16, True)])
def test_chunked_equals_the_token_loop(t, chunk, strong):
    q, k, v, g, beta, s0 = inputs(t, strong=strong, seed=t)
    if strong:
        assert float(-g.sum(0).max()) > 100  # e^(that) overflows fp32: differences only
    o1, s1 = kda.kda_recurrent(q, k, v, g, beta, s0)
    o2, s2 = kda.kda_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert torch.allclose(o1, o2, atol=1e-5, rtol=1e-4)
    assert torch.allclose(s1, s2, atol=1e-5, rtol=1e-4)
    # splitting the tokens anywhere and carrying the state gives the same result
    cut = t // 3
    oa, sa = kda.kda_chunked(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], s0, chunk=chunk)
    ob, sb = kda.kda_recurrent(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], sa)
    assert torch.allclose(torch.cat([oa, ob]), o1, atol=1e-5, rtol=1e-4)
    assert torch.allclose(sb, s1, atol=1e-5, rtol=1e-4)


def test_short_conv_carries_its_window():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    zero = torch.zeros(6, 3)
    y, st = kda.short_conv(x, w, zero)
    # the definition: y[t] = silu(sum_j w[:, j] * x[t - 3 + j]) with zeros before the start
    pad = torch.cat([zero.T, x])
    want = torch.stack([torch.nn.functional.silu((w.T * pad[t:t + 4]).sum(0))
                        for t in range(9)])
    assert torch.allclose(y, want, atol=1e-6)
    assert torch.equal(st, x[-3:].T)
    ya, sa = kda.short_conv(x[:2], w, zero)  # fewer tokens than the window
    yb, sb = kda.short_conv(x[2:], w, sa)
    assert torch.allclose(torch.cat([ya, yb]), y, atol=1e-6) and torch.equal(sb, st)


def test_state_pool_grows_reuses_and_snapshots():
    import gc
    from hicache.engine.kimi import HybridConfig
    from hicache.engine.runner import RequestState
    from hicache.engine.state_pool import KDAStatePool
    from hicache.errors import UsageError
    hyb = HybridConfig(("linear_attention", "full_attention", "linear_attention"),
                       ("dense",) * 3, kda_heads=2, kda_head_dim=3, conv_kernel=4)
    pool = KDAStatePool(hyb, torch.float32, "cpu", slots=1)
    a, b = RequestState(), RequestState()
    sa, sb = pool.slot_for(a), pool.slot_for(b)  # the second one doubles the pool
    assert sa != sb and pool.slots == 2 and pool.used == 2
    upd = [(torch.full((18, 3), float(j)), torch.full((2, 3, 3), j + 0.5)) for j in range(2)]
    pool.commit(sa, upd, 5)
    a.length = 5
    snap = pool.snapshot(a)
    assert snap.length == 5 and snap.nbytes == hyb.snapshot_bytes(4)
    assert torch.equal(snap.rec[1], upd[1][1])
    with pytest.raises(UsageError, match="KDA state holds 5 tokens"):
        a.length = 4
        pool.slot_for(a)
    c = RequestState(length=5)
    with pytest.raises(UsageError, match="no KDA state"):
        pool.slot_for(c)
    pool.restore(c, snap)  # a copy: later writes to a do not reach c
    pool.commit(sa, [(x * 0, y * 0) for x, y in upd], 5)
    sc = pool.slot_for(c)
    assert torch.equal(pool.rec[:, sc], snap.rec) and not torch.equal(pool.rec[:, sa], snap.rec)
    del a, b
    gc.collect()
    assert pool.used == 1  # only c still holds a slot
    d = RequestState()
    assert pool.slot_for(d) in (sa, sb) and float(pool.rec[:, pool.slot_for(d)].abs().sum()) == 0
