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
    import json
    path = tmp_path / "plain"
    make_mtp_checkpoint(path, with_mtp=False)
    target = load_model(path)
    with pytest.raises(CheckpointError, match=r"has no MTP modules \(config.json "
                                              r"num_nextn_predict_layers is 0 or absent\)"):
        load_mtp(path, target)
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1  # declared, but the tensors are not there
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"no MTP module 1 \(config.json "
                                              "num_nextn_predict_layers = 1"):
        load_mtp(path, target, index=1)
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


def _rms(x, w, eps):
    """RMSNorm as the DeepSeek-V3 report defines it: x / sqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def paper_mtp_logits(hf_model, main, added, tokens, prompt_len):
    """MTP depth 1 written from the DeepSeek-V3 technical report (section 2.2), independently of
    hicache's module:

        h_i        the main model's final representation of token i: ``main`` is transformers'
                   model of the checkpoint (N layers; transformers skips the MTP tensors),
                   its ``last_hidden_state`` comes after the final RMSNorm, what its output
                   head reads
        h'_i     = M [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]
        h^1_i    = TRM(h'_0 .. h'_i)            (transformers' decoder layer N, causal)
        P_{i+2}  = OutHead(h^1_i)               (shared_head: RMSNorm then the head)

    M is the checkpoint's ``eh_proj`` [hidden, 2 hidden]; its input columns hold the embedding
    half first (the order vLLM's and SGLang's loaders read), so the report's M splits as
    [M_h | M_e] = [W[:, hs:] | W[:, :hs]]. Returns (logits [T, vocab], h' [T, hidden])."""
    cfg = hf_model.config
    cfg._attn_implementation = "eager"
    hs, eps, p = cfg.hidden_size, cfg.rms_norm_eps, f"model.layers.{LAYERS}."
    ids = torch.tensor([tokens[:prompt_len]])
    h = main.model(ids).last_hidden_state[0].float()  # h_i, i < prompt_len
    emb = hf_model.model.embed_tokens.weight[torch.tensor(tokens[1:prompt_len + 1])].float()
    w = added[p + "eh_proj.weight"].float()
    m_e, m_h = w[:, :hs], w[:, hs:]
    x = _rms(h, added[p + "hnorm.weight"], eps) @ m_h.T + \
        _rms(emb, added[p + "enorm.weight"], eps) @ m_e.T
    t = x.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = hf_model.model.layers[LAYERS](x[None], attention_mask=mask, position_ids=pos,
                                        position_embeddings=hf_model.model.rotary_emb(x[None],
                                                                                      pos))
    out = (out[0] if isinstance(out, tuple) else out)[0]
    head = added.get(p + "shared_head.head.weight", hf_model.lm_head.weight).float()
    return _rms(out, added[p + "shared_head.norm.weight"], eps) @ head.T, h


def test_mtp_is_fed_the_final_normed_hidden_state(tmp_path):
    """On a checkpoint whose final-norm weights lie in [0.2, 4], the drafter's MTP logits at
    every prompt position equal the report's formulation fed the main model's final (normed)
    representation, and its proposal is that formulation's top-1. Fed the last layer's output
    before the final norm (what the drafter used to read), the same formulation moves by far
    more than the tolerance: the checkpoint tells the two apart."""
    from hicache.engine.runner import DCPRunner
    from hicache.engine.spec import MTPDrafter
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    path = tmp_path / "far_norm"
    from transformers import DeepseekV3ForCausalLM
    hf_model, added = make_mtp_checkpoint(path, seed=4, far_norm=True)
    main = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert len(main.model.layers) == LAYERS
    norm_w = main.model.norm.weight.detach()
    assert float(norm_w.min()) < 0.3 and float(norm_w.max()) > 3.5
    target = load_model(path)
    mtp = load_mtp(path, target)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    cfg, page = target.cfg, 4
    pool = DeviceKVPool(DCPLayout(1, 0, page), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, 8)
    runner = DCPRunner(target, pool, attn_backend="torch")
    st = RequestState()
    reserve(st, PageAllocator(8), len(prompt) + 4, page)
    last = runner.extend(st, prompt)[-1]
    seq = prompt + [int(last.argmax())]
    ref, h_final = paper_mtp_logits(hf_model, main, added, seq, len(prompt))
    drafter = MTPDrafter(replicated_runner(mtp, page, 8, "torch"), st.page_table)
    drafter.observe(runner.last_hidden, 0, st.length)
    got = drafter._run(seq, keep=0)
    assert close(got.numpy(), ref.numpy())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the same formulation fed the pre-norm output (h_final / w, up to the RMS scale that
    # hnorm removes) is far from it on this checkpoint
    pre = h_final / norm_w.float()
    x_pre = mtp.inputs(seq[1:], pre)
    x_fin = mtp.inputs(seq[1:], h_final)
    assert float((x_pre - x_fin).abs().max()) > 100 * TOL * float(x_fin.abs().max())
    # the proposal through the drafter's public path is the formulation's top-1
    fresh = MTPDrafter(replicated_runner(mtp, page, 8, "torch"), st.page_table)
    fresh.observe(runner.last_hidden, 0, st.length)
    assert fresh.propose(seq, 1) == [int(ref[-1].argmax())]


@torch.no_grad()
@pytest.mark.parametrize("caught_up", [False, True])
def test_mtp_modules_draft_in_one_batch(ckpts, caught_up):
    """``propose_batch`` for MTP drafters on one runner (the serving loop's): each proposes what
    it would alone, in k batched module steps (its pending positions first, then one chained
    token per step) instead of one per request and token, and each module ends at the position
    it would alone."""
    from hicache.engine.runner import DCPRunner
    from hicache.engine.spec import MTPDrafter, propose_batch
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    path = ckpts["dense"][0]
    target = load_model(path)
    mtp = load_mtp(path, target)
    cfg, page = target.cfg, 4
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 14, 6, 11)]
    ks = [3, 1, 2, 0]

    def drafters():
        pool = DeviceKVPool(DCPLayout(1, 0, page), cfg.num_layers, cfg.kv_dim, cfg.torch_dtype,
                            32)
        runner = DCPRunner(target, pool, attn_backend="torch")
        alloc = PageAllocator(32)
        module = replicated_runner(mtp, page, 32, "torch")
        out, seqs = [], []
        for p in prompts:
            st = RequestState()
            reserve(st, alloc, len(p) + 8, page)
            last = runner.extend(st, p)[-1]
            d = MTPDrafter(module, st.page_table)
            d.observe(runner.last_hidden, 0, len(p))
            seq = p + [int(last.argmax())]
            if caught_up:  # the module already ran all but the last position
                d.catch_up(seq)
            out.append(d)
            seqs.append(seq)
        return module, out, seqs

    _, ds, seqs = drafters()
    alone = [d.propose(s, k) if k else [] for d, s, k in zip(ds, seqs, ks)]
    lengths = [d.state.length for d in ds]
    assert all(len(a) == k for a, k in zip(alone, ks))
    module, ds, seqs = drafters()
    calls = []
    extend = module.extend_batch
    module.extend_batch = lambda *a, **kw: calls.append(len(a[0])) or extend(*a, **kw)
    assert propose_batch(ds, seqs, ks) == alone
    assert calls == [3, 2, 1]  # k steps, each over the requests still drafting
    assert [d.state.length for d in ds] == lengths
