"""The exact LSE merge against oracles and a dense softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.kernels.merge import merge_attn_states, merge_weights
from hicache.errors import UsageError



def dense_attention(scores: torch.Tensor, values: torch.Tensor):
    """scores [Q, N] (-inf = masked), values [N, D] -> (o [Q, D], lse [Q]) in float64."""
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[:, None])
    return p @ values, lse


def split_attention(scores, values, bounds):
    os_, ls_ = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, lse = dense_attention(scores[:, a:b], values[a:b])
        os_.append(o)
        ls_.append(lse)
    return os_, ls_


def test_identity_single_part():
    o = torch.randn(3, 5, 8)
    lse = torch.randn(3, 5)
    mo, ml = merge_attn_states([o], [lse])
    assert torch.equal(mo, o)
    assert torch.allclose(ml, lse)


def test_equal_weights_average():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    lse = torch.full((4,), 1.5)
    mo, ml = merge_attn_states([a, b], [lse, lse])
    assert torch.allclose(mo, (a + b) / 2, atol=1e-6)
    assert torch.allclose(ml, lse + math.log(2.0))


def test_one_dominant_part():
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    mo, ml = merge_attn_states([a, b], [torch.tensor([200.0, 200.0]), torch.tensor([0.0, 0.0])])
    assert torch.allclose(mo, a, atol=1e-6)
    assert torch.allclose(ml, torch.tensor([200.0, 200.0]))


def test_empty_part_is_exact_and_never_nan():
    a = torch.randn(3, 4)
    garbage = torch.full((3, 4), float("nan"))  # an empty shard's o is undefined
    lse_a = torch.randn(3)
    mo, ml = merge_attn_states([a, garbage], [lse_a, torch.full((3,), -math.inf)])
    assert torch.equal(mo, a)
    assert torch.equal(ml, lse_a)
    # every part empty: o = 0 and lse = -inf
    mo, ml = merge_attn_states([garbage, garbage], [torch.full((3,), -math.inf)] * 2)
    assert torch.equal(mo, torch.zeros(3, 4))
    assert torch.isneginf(ml).all()


def test_nan_and_posinf_lse_are_sanitised():
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    lse = torch.tensor([0.3, -1.0])
    for bad in (float("nan"), float("inf")):
        mo, ml = merge_attn_states([a, b], [lse, torch.full((2,), bad)])
        assert torch.equal(mo, a) and torch.equal(ml, lse)


def test_exact_two_part_case_and_returned_lse():
    torch.manual_seed(0)
    scores = torch.randn(5, 12, dtype=torch.float64)
    values = torch.randn(12, 7, dtype=torch.float64)
    o_ref, lse_ref = dense_attention(scores, values)
    os_, ls_ = split_attention(scores, values, [0, 5, 12])
    mo, ml = merge_attn_states(os_, ls_)
    assert torch.allclose(mo, o_ref, atol=1e-6)
    assert torch.allclose(ml.double(), lse_ref, atol=1e-5)


def test_base2_matches_base_e():
    torch.manual_seed(1)
    o = torch.randn(3, 4, 6)
    lse_e = torch.randn(3, 4) * 3
    oe, le = merge_attn_states(o, lse_e, base="e")
    o2, l2 = merge_attn_states(o, lse_e / math.log(2.0), base="2")
    assert torch.allclose(oe, o2, atol=1e-6)
    assert torch.allclose(l2 * math.log(2.0), le, atol=1e-5)


def test_weights_sum_to_one_or_zero():
    lse = torch.tensor([[0.0, -math.inf], [1.0, -math.inf]])  # [R=2, 2]
    w, out = merge_weights(lse)
    assert torch.allclose(w.sum(0), torch.tensor([1.0, 0.0]))
    assert torch.isneginf(out[1])


def test_bad_input_is_a_clear_error():
    with pytest.raises(UsageError, match="base"):
        merge_attn_states([torch.zeros(2, 3)], [torch.zeros(2)], base="10")
    with pytest.raises(UsageError, match="disagree"):
        merge_attn_states([torch.zeros(2, 3)], [torch.zeros(3)])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), parts=st.integers(1, 5), q=st.integers(1, 4),
       seed=st.integers(0, 10_000), mask_p=st.floats(0.0, 0.9))
def test_property_any_split_equals_dense(n, parts, q, seed, mask_p):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(q, n, generator=g, dtype=torch.float64) * 4
    scores[torch.rand(q, n, generator=g) < mask_p] = -math.inf  # masked keys, maybe whole rows
    values = torch.randn(n, 5, generator=g, dtype=torch.float64)
    cuts = sorted(torch.randint(0, n + 1, (parts - 1,), generator=g).tolist())
    bounds = [0] + cuts + [n]  # empty parts allowed
    o_ref, lse_ref = dense_attention(scores, values)
    os_, ls_ = split_attention(scores, values, bounds)
    mo, ml = merge_attn_states(os_, ls_)
    assert not torch.isnan(mo).any()
    ok = torch.isfinite(lse_ref)
    assert torch.allclose(mo[ok], o_ref[ok], atol=1e-6)
    assert torch.equal(mo[~ok], torch.zeros_like(mo[~ok]))
    assert torch.allclose(ml.double()[ok], lse_ref[ok], atol=1e-5)
    assert torch.isneginf(ml[~ok]).all()


def test_fp64_inputs_merge_in_fp64():
    # the wider of fp32 and the input dtype: fp64 parts merge to ~1e-15 (fp32 math gave ~1e-7)
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 40, generator=g, dtype=torch.float64) * 3
    values = torch.randn(40, 9, generator=g, dtype=torch.float64)
    o_ref, lse_ref = dense_attention(scores, values)
    os_, ls_ = split_attention(scores, values, [0, 7, 19, 33, 40])
    mo, ml = merge_attn_states(os_, ls_)
    assert mo.dtype == torch.float64 and ml.dtype == torch.float64
    assert (mo - o_ref).abs().max() < 1e-12
    assert (ml - lse_ref).abs().max() < 1e-12
    w, lse = merge_weights(torch.stack(ls_))
    assert w.dtype == torch.float64 and (w.sum(0) - 1).abs().max() < 1e-14
    # fp32 and narrower inputs keep fp32 arithmetic and return fp32 LSEs
    _, ml32 = merge_attn_states([o.float() for o in os_], [x.float() for x in ls_])
    assert ml32.dtype == torch.float32
    ob, lb = merge_attn_states([o.bfloat16() for o in os_], [x.float() for x in ls_])
    assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float32
