"""DeepSeek-V3 MTP modules: the engine's module against one composed from transformers' own parts.

A tiny checkpoint with MTP tensors is made with transformers (``spec_ckpt``). The reference is
``h = layer(eh_proj(cat(enorm(embed(t)), hnorm(h_prev))))``, ``logits = head(norm(h))`` built
from transformers' ``DeepseekV3DecoderLayer`` (the N + 1 layer model's layer N, MoE as the config
says), ``DeepseekV3RMSNorm`` and ``nn.Linear`` loaded with the file's tensors, fp32; the engine's
logits must be within 1e-4 of the largest logit, through its dense reference and through a
replicated ``DCPRunner`` (prefill then one position at a time, as the drafter runs it).
"""

import numpy as np
import pytest
import torch

from spec_ckpt import LAYERS, VOCAB, make_mtp_checkpoint

from hicache.checkpoints.hf import load_model
from hicache.checkpoints.mtp import load_mtp, mtp_tensors
from hicache.engine.runner import RequestState, reserve
from hicache.engine.spec import replicated_runner
from hicache.errors import CheckpointError
from hicache.pages import PageAllocator

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, kw in (("moe_shared_head", dict(seed=1)), ("moe_own_head", dict(seed=2,
                                                                              own_head=True)),
                     ("dense", dict(seed=3, moe=False))):
        out[name] = (root / name, *make_mtp_checkpoint(root / name, **kw))
    return out


@torch.no_grad()
def reference(hf_model, added, tokens, h_prev):
    """MTP logits from transformers' own DeepseekV3 modules."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    cfg = hf_model.config
    cfg._attn_implementation = "eager"
    hs, p = cfg.hidden_size, f"model.layers.{LAYERS}."

    def norm(name):
        m = DeepseekV3RMSNorm(hs, eps=cfg.rms_norm_eps)
        m.weight.copy_(added[p + name])
        return m

    eh = torch.nn.Linear(2 * hs, hs, bias=False)
    eh.weight.copy_(added[p + "eh_proj.weight"])
    if p + "shared_head.head.weight" in added:
        head = torch.nn.Linear(hs, VOCAB, bias=False)
        head.weight.copy_(added[p + "shared_head.head.weight"])
    else:
        head = hf_model.lm_head
    layer = hf_model.model.layers[LAYERS]
    assert layer.self_attn.layer_idx == LAYERS
    ids = torch.tensor([tokens])
    x = eh(torch.cat([norm("enorm.weight")(hf_model.model.embed_tokens(ids)),
                      norm("hnorm.weight")(h_prev[None])], -1))
    t = len(tokens)
    pos = torch.arange(t)[None]
    cos_sin = hf_model.model.rotary_emb(x, pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    return head(norm("shared_head.norm.weight")(out))[0]


def close(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return got.shape == ref.shape and float(np.abs(got - ref).max()) <= TOL * max(
        1.0, float(np.abs(ref).max()))


@pytest.mark.parametrize("name", ["moe_shared_head", "moe_own_head", "dense"])
def test_mtp_logits_match_transformers(ckpts, name):
    path, hf_model, added = ckpts[name]
    target = load_model(path)
    mtp = load_mtp(path, target)
    assert (mtp.head is target.lm_head) == (name != "moe_own_head")
    assert mtp.embed_tokens is target.embed_tokens
    assert hasattr(mtp.layers[0], "moe") == (name != "dense")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (11,), generator=g).tolist()
    h_prev = torch.randn(11, 32, generator=g) * 2
    ref = reference(hf_model, added, tokens, h_prev).numpy()
    assert close(mtp(tokens, h_prev).numpy(), ref)
    # through the engine (replicated pool, widened pages of 8): 7 positions, then one at a time
    runner = replicated_runner(mtp, 8, 4, attn_backend="torch")
    st = RequestState()
    reserve(st, PageAllocator(4), 11, 8)
    rows = [runner.extend_batch([st], [tokens[:7]], inputs=mtp.inputs(tokens[:7], h_prev[:7]))[0]]
    for i in range(7, 11):
        rows.append(runner.extend_batch([st], [[tokens[i]]],
                                        inputs=mtp.inputs([tokens[i]], h_prev[i:i + 1]))[0])
    assert close(torch.cat(rows).numpy(), ref)
    assert runner.stats.dcp_collectives == 0  # replicated: no DCP collective


def test_mtp_missing_tensors_name_the_first(tmp_path):
    path = tmp_path / "plain"
    make_mtp_checkpoint(path, with_mtp=False)
    target = load_model(path)
    with pytest.raises(CheckpointError, match=rf"tensor model\.layers\.{LAYERS}\.enorm\.weight "
                                              "is missing"):
        load_mtp(path, target)
    # the decoder layer's tensors are checked too, in order
    want = list(mtp_tensors(target.cfg))
    assert want[:4] == [f"model.layers.{LAYERS}.{n}" for n in
                        ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                         "shared_head.norm.weight")]
    assert f"model.layers.{LAYERS}.mlp.experts.7.down_proj.weight" in want


@pytest.mark.parametrize("name", ["moe_shared_head", "dense"])
def test_mtp_draft_kv_is_the_recompute(ckpts, name):
    """After speculative rounds (drafts chained on the module's own hidden state, most of them
    rejected), the MTP rows of every committed position are those of a recompute from the
    target's hidden states: chained rows were rolled back and rewritten, nothing stale stays.
    The tokens are plain decoding's."""
    from hicache.engine.spec import MTPDrafter, SpecStats, speculative_generate
    from hicache.engine.runner import DCPRunner
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    path = ckpts[name][0]
    target = load_model(path)
    mtp = load_mtp(path, target)
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(8)).tolist()
    new, k, page = 12, 3, 4
    cfg = target.cfg
    pool = DeviceKVPool(DCPLayout(1, 0, page), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, 16)
    runner = DCPRunner(target, pool, attn_backend="torch")
    st = RequestState()
    alloc = PageAllocator(16)
    reserve(st, alloc, len(prompt) + new, page)
    last = runner.extend(st, prompt)[-1]
    drafter = MTPDrafter(replicated_runner(mtp, page, 16, "torch"), st.page_table)
    stats = SpecStats()
    toks = speculative_generate(runner, st, prompt, last, drafter, k, new, runner.last_hidden,
                                stats)
    assert toks == target.generate(prompt, new)
    assert stats.proposed > stats.accepted  # rejections happened: rollback was exercised
    seq = prompt + toks
    # the target's hidden states over the committed positions, recomputed in one prefill
    fresh = RequestState()
    reserve(fresh, alloc, len(seq), page)
    runner.extend(fresh, seq[:st.length])
    hidden = runner.last_hidden
    m = drafter.state.length
    # the module lags the target by what the last rounds committed (not drafted from since)
    assert drafter.offset == 0 and len(prompt) < m < st.length
    x = mtp.inputs(seq[1:m + 1], hidden[:m])
    want = mtp.layers[0].kv_rows(x, torch.arange(m))
    _, got = drafter.runner.kv.read(0, drafter.state.slots(0, m, page))
    assert torch.allclose(got, want, atol=1e-5)
