import pytest

from hicache.errors import TopologyError
from hicache import topology
from hicache.topology import kv_duplication, validate


def test_containment_example():
    validate(64, 16, 1, attn_dp_size=4)
    with pytest.raises(TopologyError, match="containment"):
        validate(64, 32, 1, attn_dp_size=4)


def test_deepseek_r1_duplication():
    r1 = topology.get_model("deepseek-r1")
    assert kv_duplication(8, r1.num_kv_heads) == 8
    assert kv_duplication(8, r1.num_kv_heads, 8) == 1
    validate(8, 8, 1)


def test_qwen3_gqa():
    q = topology.get_model("Qwen3-235B-A22B")
    assert kv_duplication(8, q.num_kv_heads) == 2
    assert kv_duplication(8, q.num_kv_heads, 2) == 1
    validate(8, 2, q.num_kv_heads)
    with pytest.raises(TopologyError, match="adds no GPUs"):
        validate(8, 4, q.num_kv_heads)


def test_kimi_k2_half_duplication():
    k = topology.get_model("kimi-k2")
    assert kv_duplication(16, k.num_kv_heads) == 16
    assert kv_duplication(16, k.num_kv_heads, 8) == 2
    validate(16, 8, 1)
    validate(16, 16, 1)


def test_other_rules():
    with pytest.raises(TopologyError, match="tp % attn_dp"):
        validate(6, 1, 1, attn_dp_size=4)
    with pytest.raises(TopologyError, match="dcp_size must be a positive"):
        validate(8, 0, 1)
    with pytest.raises(TopologyError, match="unknown model"):
        topology.get_model("gpt-9")


def test_kv_bytes_per_token_and_plan():
    r1 = topology.get_model("deepseek-r1")
    full = 61 * 576 * 2
    assert r1.bytes_per_token == full
    assert topology.kv_bytes_per_token(r1, 8, 1) == full  # every TP rank holds all of it
    assert topology.kv_bytes_per_token(r1, 8, 8) == full / 8
    llama = topology.get_model("llama-3-70b")
    assert topology.kv_bytes_per_token(llama, 8) == 80 * 2 * 128 * 2  # one kv head per rank
    rows = topology.plan(r1, 8, memory_bytes=full * 1000)
    assert [r.dcp for r in rows] == [1, 2, 4, 8]
    assert rows[0].tokens_per_rank_budget == 1000 and rows[-1].tokens_per_rank_budget == 8000
    for c in (1, 2, 4, 8):  # capacity: per-rank KV is 1/c of the total
        assert topology.kv_bytes_per_token(r1, 8, c) * c == full
