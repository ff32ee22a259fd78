"""The tiny MLA model and latent attention: absorption is exact, causality, files, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.engine.attention import attend_latent
from hicache.kernels.merge import merge_attn_states
from hicache.engine.model import MLAModel, ModelConfig, rms_norm
from hicache.errors import CheckpointError, ConfigError, UsageError


CFG = ModelConfig(num_layers=2)


@pytest.fixture(scope="module")
def model():
    return MLAModel(CFG)


def naive_mla_attention(layer, h, pos):
    """Un-absorbed MLA: expand c_kv to per-head keys and values, causal softmax, o_proj."""
    cfg = layer.cfg
    dn = cfg.qk_nope_head_dim
    rows = layer.kv_rows(h, pos).float()
    c, k_pe = rows[:, :cfg.kv_lora_rank], rows[:, cfg.kv_lora_rank:]
    x = rms_norm(h, layer.attn_norm, cfg.rms_eps)
    q = (x @ layer.wq.float().T).view(h.shape[0], cfg.num_heads, -1)
    q_nope = q[..., :dn]
    _, q_pe = layer.query(h, pos)
    k_nope = torch.einsum("nr,hdr->nhd", c, layer.w_uk.float())
    v = torch.einsum("nr,hvr->nhv", c, layer.w_uv.float())
    s = torch.einsum("thd,nhd->thn", q_nope, k_nope) + torch.einsum("thd,nd->thn", q_pe, k_pe)
    s = s * cfg.softmax_scale
    mask = pos[None, :] <= pos[:, None]
    s = s.masked_fill(~mask[:, None, :], -math.inf)
    out = torch.einsum("thn,nhv->thv", torch.softmax(s, -1), v)
    return out.reshape(h.shape[0], -1) @ layer.wo.float().T


def test_absorbed_attention_equals_naive_mla(model):
    g = torch.Generator().manual_seed(3)
    h = model.embed(torch.randint(0, CFG.vocab_size, (11,), generator=g))
    pos = torch.arange(11)
    layer = model.layers[0]
    q_lat, q_pe = layer.query(h, pos)
    o, lse = attend_latent(q_lat, q_pe, layer.kv_rows(h, pos), pos, pos, CFG.softmax_scale,
                           CFG.kv_lora_rank)
    assert o.shape == (11, CFG.num_heads, CFG.kv_lora_rank) and lse.shape == (11, CFG.num_heads)
    assert torch.allclose(layer.attn_out(o), naive_mla_attention(layer, h, pos), atol=1e-4)


def test_head_sharded_query_and_out_compose(model):
    h = model.embed([5, 9, 1, 4])
    pos = torch.arange(4)
    layer = model.layers[1]
    q_full, pe_full = layer.query(h, pos)
    q2, pe2 = layer.query(h, pos, slice(2, 6))
    assert torch.allclose(q2, q_full[:, 2:6]) and torch.allclose(pe2, pe_full[:, 2:6])
    o = torch.randn(4, CFG.num_heads, CFG.kv_lora_rank)
    parts = sum(layer.attn_out(o[:, s:s + 2], slice(s, s + 2)) for s in range(0, 8, 2))
    assert torch.allclose(parts, layer.attn_out(o), atol=1e-5)


def test_attn_out_and_output_accept_zero_tokens(model):
    layer = model.layers[0]
    empty = torch.empty(0, CFG.num_heads, CFG.kv_lora_rank)
    assert layer.attn_out(empty).shape == (0, CFG.hidden_size)
    assert layer.attn_out(empty[:, 2:4], slice(2, 4)).shape == (0, CFG.hidden_size)
    assert layer.output(empty, torch.empty(0, CFG.hidden_size)).shape == (0, CFG.hidden_size)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 20), t=st.integers(1, 4), c=st.integers(1, 4), seed=st.integers(0, 999))
def test_shards_with_global_positions_merge_to_dense(n, t, c, seed):
    """Any split of the keys by owner (p mod c), attended with global positions and merged,
    equals attention over all keys; queries with no allowed key give o = 0, lse = -inf."""
    g = torch.Generator().manual_seed(seed)
    r, dr, hh = 16, 4, 3
    q_lat, q_pe = torch.randn(t, hh, r, generator=g), torch.randn(t, hh, dr, generator=g)
    kv = torch.randn(n, r + dr, generator=g)
    kv_pos = torch.arange(n)
    q_pos = torch.randint(-1, n + 1, (t,), generator=g)
    o_ref, lse_ref = attend_latent(q_lat, q_pe, kv, q_pos, kv_pos, 0.5, r)
    parts = [attend_latent(q_lat, q_pe, kv[kv_pos % c == k], q_pos, kv_pos[kv_pos % c == k],
                           0.5, r) for k in range(c)]
    o, lse = merge_attn_states([p[0] for p in parts], [p[1] for p in parts])
    assert not torch.isnan(o).any()
    assert torch.allclose(o, o_ref, atol=1e-5)
    none = q_pos < 0
    assert torch.isneginf(lse[none]).all() and torch.equal(o[none], torch.zeros_like(o[none]))
    assert torch.allclose(lse[~none], lse_ref[~none], atol=1e-5)


def test_attention_input_errors():
    q, pe, kv, pos = torch.zeros(2, 3, 8), torch.zeros(2, 3, 4), torch.zeros(5, 12), torch.arange(5)
    with pytest.raises(UsageError, match="kv_lora_rank"):
        attend_latent(q, pe, kv, pos[:2], pos, 1.0, 7)
    with pytest.raises(UsageError, match=r"kv must be \[N, 12\]"):
        attend_latent(q, pe, torch.zeros(5, 10), pos[:2], pos, 1.0, 8)
    with pytest.raises(UsageError, match="q_pos"):
        attend_latent(q, pe, kv, pos[:3], pos, 1.0, 8)
    with pytest.raises(UsageError, match="backend"):
        attend_latent(q, pe, kv, pos[:2], pos, 1.0, 8, backend="cuda")


def test_forward_is_causal_and_deterministic(model):
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    full = model.forward(toks)
    assert full.shape == (8, CFG.vocab_size)
    assert torch.allclose(model.forward(toks[:5]), full[:5], atol=1e-5)  # future does not leak
    assert torch.equal(MLAModel(CFG).forward(toks), full)  # same seed, same weights
    assert not torch.equal(MLAModel(ModelConfig(num_layers=2, seed=1)).forward(toks), full)


def test_variants_run(tmp_path):
    for cfg in (ModelConfig(q_lora_rank=16, num_layers=1),
                ModelConfig(dtype="bfloat16", num_layers=1)):
        m = MLAModel(cfg)
        out = m.forward([1, 2, 3])
        assert out.shape == (3, cfg.vocab_size) and torch.isfinite(out).all()
        assert m.layers[0].kv_rows(m.embed([1]), torch.arange(1)).dtype == cfg.torch_dtype


def test_save_load_roundtrip_and_errors(model, tmp_path):
    path = tmp_path / "m.pt"
    model.save(path)
    loaded = MLAModel.load(path)
    assert loaded.cfg == model.cfg
    toks = [7, 7, 2, 200]
    assert torch.equal(loaded.forward(toks), model.forward(toks))
    q = MLAModel(ModelConfig(q_lora_rank=8, num_layers=1, dtype="bfloat16", seed=4))
    q.save(tmp_path / "q.pt")
    assert torch.equal(MLAModel.load(tmp_path / "q.pt").forward(toks), q.forward(toks))

    with pytest.raises(CheckpointError, match="not found"):
        MLAModel.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="cannot read"):
        MLAModel.load(tmp_path / "junk.pt")
    blob = torch.load(path, weights_only=True)
    blob["config"]["hidden_size"] = 32
    torch.save(blob, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="shape"):
        MLAModel.load(tmp_path / "bad.pt")
    blob = torch.load(path, weights_only=True)
    del blob["state"]["lm_head"]
    torch.save(blob, tmp_path / "miss.pt")
    with pytest.raises(CheckpointError, match="missing weights"):
        MLAModel.load(tmp_path / "miss.pt")


def test_config_errors():
    with pytest.raises(ConfigError, match="num_heads"):
        ModelConfig(num_heads=0)
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        ModelConfig(qk_rope_head_dim=3)
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig(dtype="int8")
    with pytest.raises(ConfigError, match="unknown"):
        ModelConfig.from_dict({"hidden": 3})
    assert ModelConfig().kv_dim == 40
    with pytest.raises(ValueError, match="token ids"):
        MLAModel(ModelConfig(num_layers=1)).embed([CFG.vocab_size])


def test_weights_signature_names_the_weights(model, tmp_path):
    from hicache.engine.model import file_digest
    same = MLAModel(model.cfg)  # the same seed: the same weights, the same signature
    assert same.weights_signature() == model.weights_signature()
    other = MLAModel(ModelConfig(**{**model.cfg.to_dict(), "seed": model.cfg.seed + 1}))
    assert other.weights_signature() != model.weights_signature()
    model.save(tmp_path / "a.pt")
    other.save(tmp_path / "b.pt")
    a, b = MLAModel.load(tmp_path / "a.pt"), MLAModel.load(tmp_path / "b.pt")
    assert a.weights_signature() == f"mla-file:{file_digest(tmp_path / 'a.pt')}"
    assert a.weights_signature() != b.weights_signature()
