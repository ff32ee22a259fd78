"""Hugging Face DeepSeek-V2/V3 checkpoints in the engine, checked against transformers itself.

Tiny random checkpoints are built with transformers' own ``DeepseekV2Config`` /
``DeepseekV3Config`` and ``save_pretrained`` (q LoRA on and off, YaRN on and off, MoE with grouped
routing and dense, tied and untied heads, interleaved and half RoPE, one file and shards,
``rope_parameters`` and published ``rope_scaling`` layouts). The engine must give transformers'
greedy tokens (``generate``, 8 new tokens) and its logits within ``TOL`` (fp32): through the
dense reference, DCP 1, 2 and 4 with both merge backends, KV restored from L1, L2 and L3 in the
serving loop, and PCP 2 prefill.

Tolerance: every logit within ``TOL * max(1, max |logit|)`` of transformers' (fp32 on both sides;
the engine's absorbed attention sums in another order, measured ~1e-5 relative).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_weights import seed_weights

from hicache.config import HiCacheConfig, loads
from hicache.distributed import launch
from hicache.checkpoints import hf
from hicache.checkpoints.hf import load_checkpoint, weights_signature
from hicache.engine.model import MLAModel
from hicache.errors import CheckpointError, ConfigError

TOL = 1e-4
NEW = 8
VOCAB = 96
CASES = {
    # name: make_checkpoint keyword arguments
    "v3_moe_qlora_yarn_shards": dict(arch="v3", q_lora=12, yarn=True, moe=True, shard=True),
    "v3_moe_halfrope_published": dict(arch="v3", q_lora=None, moe=True, interleave=False,
                                      published=True),
    "v2_moe_grouped_yarn_tied": dict(arch="v2", q_lora=12, yarn=True, moe=True, tie=True,
                                     published=True),
    "v2_dense": dict(arch="v2", q_lora=None, moe=False),
    # transformers reads a top-level original_max_position_embeddings before the RoPE dict's
    "v3_yarn_top_level_original_max": dict(arch="v3", q_lora=None, yarn=True, moe=False,
                                           top_orig=64),
}


def make_checkpoint(path, arch="v3", *, q_lora=12, yarn=False, moe=True, tie=False,
                    interleave=True, published=False, shard=False, seed=0, top_orig=None):
    """Save a tiny random DeepSeek checkpoint with transformers; return the transformers model.

    Weights are redrawn with a spread that makes routing and greedy tokens non-degenerate (the
    default init of 0.02 gives near-uniform logits); the V3 correction bias is random too.
    ``published`` rewrites config.json the way published checkpoints write it (``rope_scaling``
    with ``type``, ``rope_theta`` at the top, ``torch_dtype``)."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    layers = 2
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                  kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                  n_group=4, topk_group=2, first_k_dense_replace=1 if moe else layers,
                  max_position_embeddings=256, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    rope = {"rope_type": "default", "rope_theta": 500.0}
    if yarn:
        m = 0.707 if arch == "v2" else 1.0  # V2 published: 0.707 / 0.707; V3: 1.0 / 1.0
        rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 32,
                "beta_slow": 1, "original_max_position_embeddings": 16, "mscale": m,
                "mscale_all_dim": m}
    if arch == "v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **common, rope_parameters=rope, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_interleave=interleave))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, rope_parameters=rope, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5))
    g = torch.Generator().manual_seed(seed)
    seed_weights(model, g, embed_scale=0.5 if tie else 1.0)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "50GB")
    if published:
        f = Path(path) / "config.json"
        raw = json.loads(f.read_text())
        rp = raw.pop("rope_parameters")
        raw["rope_theta"] = rp.pop("rope_theta")
        kind = rp.pop("rope_type")
        raw["rope_scaling"] = None if kind == "default" else dict(rp, type=kind)
        raw["torch_dtype"] = raw.pop("dtype", None) or "float32"
        f.write_text(json.dumps(raw, indent=1))
    if top_orig is not None:  # the reference is what transformers loads from the file
        f = Path(path) / "config.json"
        raw = json.loads(f.read_text())
        raw["original_max_position_embeddings"] = top_orig
        f.write_text(json.dumps(raw, indent=1))
        model = type(model).from_pretrained(path).eval()
        assert model.config.rope_parameters["original_max_position_embeddings"] == top_orig
    return model


@torch.no_grad()
def hf_reference(model, prompt, new=NEW):
    """transformers' greedy tokens and its logits over prompt + tokens (fp32 numpy)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    tokens = out[0, len(prompt):].tolist()
    logits = model(out).logits[0, :-1].float().numpy()  # [P + new - 1, V]
    return tokens, logits


def close(got, ref) -> bool:
    got, ref = np.asarray(got, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    return got.shape == ref.shape and float(np.abs(got - ref).max()) <= TOL * max(
        1.0, float(np.abs(ref).max()))


def prompt_of(seed, n=19):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (dir, prompt, hf tokens, hf logits)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        d = root / name
        model = make_checkpoint(d, seed=i, **kw)
        prompt = prompt_of(i)
        tokens, logits = hf_reference(model, prompt)
        out[name] = (str(d), prompt, tokens, logits)
    return out


# ---- the engine's runs (in-process or in each rank) --------------------------------------------
def engine_decode(model, prompt, backend, replicate_q, group=None, rank=0, world=1):
    """Prefill then greedy decode through DCPRunner: (tokens, logits [P + NEW - 1, V])."""
    from hicache.engine.runner import DCPRunner, RequestState, reserve
    from hicache.l1 import DeviceKVPool
    from hicache.pages import PageAllocator
    from hicache.layout import DCPLayout
    cfg = model.cfg
    layout = DCPLayout(world, rank, 2)
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, 32)
    runner = DCPRunner(model, pool, backend=backend, replicate_q=replicate_q, group=group,
                       attn_backend="torch")
    st = RequestState()
    reserve(st, PageAllocator(32), len(prompt) + NEW, layout.page_tokens)
    rows = [runner.extend(st, prompt)]
    tokens = []
    for _ in range(NEW):
        tokens.append(int(rows[-1][-1].argmax()))
        if len(tokens) < NEW:
            rows.append(runner.extend(st, [tokens[-1]]))
    return tokens, torch.cat(rows).numpy()


def policy(path, l3, dcp, l1_pages=10, l2_ratio=2.0):
    return HiCacheConfig.from_dict({
        "model": {"path": str(path)},
        "parallel": {"tp": dcp, "dcp": dcp},
        "cache": {"page_size": 4},
        "l1": {"num_pages": l1_pages},
        "l2": {"ratio": l2_ratio},
        "l3": {"enabled": True, "lmdb": {"path": str(l3), "size_bytes": 64 << 20}},
        # every L3 hit is loaded, however slow the store is next to the prefill on a loaded
        # machine: the tests count L3 hits
        "policy": {"prefetch": "wait_complete", "l3_cost_model": False},
    })


def tier_jobs(seed):
    """4 sessions sharing a 16-token prefix, each visited twice round robin: the shared prefix
    hits L1, second visits come back from L2 or (with L2 as small as L1) L3."""
    from hicache.workloads import Request
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 16)
    prompts = [np.concatenate([shared, rng.integers(0, VOCAB, 17)]) for _ in range(4)]
    return [Request(i, s, prompts[s], NEW, i) for i, s in enumerate(list(range(4)) * 2)]


def serve_modes(path, l3_root, dcp, jobs, rank=0, group=None):
    """Every mode of the serving loop on the checkpoint: mode -> (outputs by id, hit tokens)."""
    from helpers import l3_writes_land_at_once
    from hicache.serving import Server
    from hicache.service import HiCache, CACHE_MODES
    model = hf.load_model(path)
    out = {}
    for mode in CACHE_MODES:
        # L1 holds two running requests (6 pages each): later ones find the prefixes of the
        # finished ones in L1
        cfg = policy(path, Path(l3_root) / mode.replace("+", "_"), dcp, l1_pages=12,
                     l2_ratio=1.0 if "l3" in mode else 3.0)
        with l3_writes_land_at_once(), HiCache(cfg, rank, group, mode=mode,
                                               weights_signature=model.weights_signature()) \
                as cache:
            res = Server(model, cache, group=group, chunk_tokens=16, max_running=2).run(jobs)
            hits = cache.stats()["hit_tokens"]
        out[mode] = ({r.request_id: r.output for r in res}, hits)
    return out


def two_rank_worker(rank, world, cases, tier_cases, pcp_cases, l3_root):
    """DCP 2 (both backends), the serving loop over every tier, PCP 2 prefill: one group."""
    import torch.distributed as dist
    from hicache.commands.decode import DecodeSpec, decode_worker
    group = dist.group.WORLD
    out = {}
    for name, (path, prompt) in cases.items():
        model = load_checkpoint(path)
        out[name] = {b: engine_decode(model, prompt, b, rq, group, rank, world)
                     for b, rq in (("a2a", False), ("ag_rs", True))}
    for name, (path, jobs) in tier_cases.items():
        out["tiers", name] = serve_modes(path, Path(l3_root) / f"{name}-{world}", world, jobs,
                                         rank, group)
    for name, (path, prompt) in pcp_cases.items():
        spec = DecodeSpec(dcp=2, pcp=2, model_path=path, prompt_ids=tuple(prompt), new_tokens=NEW,
                          page_size=2, attn_backend="torch")
        out["pcp", name] = decode_worker(rank, world, spec)["tokens"]
    return out


def four_rank_worker(rank, world, path, prompt):
    import torch.distributed as dist
    model = load_checkpoint(path)
    return {b: engine_decode(model, prompt, b, rq, dist.group.WORLD, rank, world)
            for b, rq in (("a2a", False), ("ag_rs", True))}


# ---- tests -------------------------------------------------------------------------------------
def test_dense_reference_and_dcp1_match_transformers(ckpts):
    for name, (path, prompt, ref_tokens, ref_logits) in ckpts.items():
        model = load_checkpoint(path)
        assert close(model.forward(prompt + ref_tokens[:-1]), ref_logits), name
        assert model.generate(prompt, NEW) == ref_tokens, name
        for backend in ("a2a", "ag_rs"):
            tokens, logits = engine_decode(model, prompt, backend, False)
            assert tokens == ref_tokens and close(logits, ref_logits), (name, backend)
    # the checks have teeth: the tokens vary, and a model that drops YaRN is caught
    path, prompt, ref_tokens, ref_logits = ckpts["v3_moe_qlora_yarn_shards"]
    assert len(set(ref_tokens)) > 2
    from dataclasses import replace
    good = load_checkpoint(path)
    wrong = MLAModel(replace(good.cfg, yarn=None), init=False)
    wrong.load_state_dict(good.state_dict(), assign=True)
    assert not close(wrong.forward(prompt + ref_tokens[:-1]), ref_logits)


def test_config_shapes_and_kv_shape_come_from_the_checkpoint(ckpts):
    path = ckpts["v3_moe_qlora_yarn_shards"][0]
    assert (Path(path) / "model.safetensors.index.json").is_file()  # really sharded
    model = load_checkpoint(path)
    cfg = model.cfg
    assert cfg.q_lora_rank == 12 and cfg.yarn.factor == 4.0 and cfg.rope_interleave
    assert cfg.moe.topk_method == "noaux_tc" and cfg.moe.n_group == 4
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert not hasattr(model.layers[0], "moe") and len(model.layers[1].moe.experts) == 8
    pol = loads(f'[model]\npath = "{path}"\n')
    assert (pol.model.num_layers, pol.model.kv_dim, pol.model.dtype) == (2, 16 + 8, "float32")
    assert pol.model.vocab_size == VOCAB and pol.model.num_heads == 4
    assert pol.replace(l3={"path": "elsewhere"}).model == pol.model  # round trip
    with pytest.raises(ConfigError, match="model.num_layers: 3 conflicts with model.path"):
        loads(f'[model]\npath = "{path}"\nnum_layers = 3\n')
    with pytest.raises(ConfigError, match="model.path: .*not a directory"):
        loads('[model]\npath = "/nonexistent/ckpt"\n')
    tied = load_checkpoint(ckpts["v2_moe_grouped_yarn_tied"][0])
    assert tied.cfg.tie_word_embeddings and not hasattr(tied, "lm_head")
    assert tied.cfg.moe.scoring_func == "softmax" and tied.cfg.yarn.mscale_all_dim == 0.707


def test_dcp2_tiers_and_pcp2_match_transformers(ckpts, tmp_path):
    cases = {n: (p, pr) for n, (p, pr, _, _) in ckpts.items()}
    tier_names = ("v3_moe_qlora_yarn_shards", "v2_moe_grouped_yarn_tied")
    tier_cases = {n: (ckpts[n][0], tier_jobs(i)) for i, n in enumerate(tier_names)}
    pcp_cases = {n: cases[n] for n in ("v3_moe_qlora_yarn_shards", "v2_dense")}
    per_rank = launch(2, two_rank_worker, cases, tier_cases, pcp_cases, str(tmp_path),
                      timeout_s=600)
    for rank, out in enumerate(per_rank):
        for name, (_, _, ref_tokens, ref_logits) in ckpts.items():
            for backend, (tokens, logits) in out[name].items():
                assert tokens == ref_tokens, (rank, name, backend)
                assert close(logits, ref_logits), (rank, name, backend)
        for name in pcp_cases:
            assert out["pcp", name] == ckpts[name][2], (rank, name)
    for name, (path, jobs) in tier_cases.items():
        hf_model = _hf_model(path)
        want = {j.request_id: hf_reference(hf_model, j.tokens.tolist())[0] for j in jobs}
        modes = per_rank[0]["tiers", name]
        assert per_rank[1]["tiers", name] == modes  # replicated control, same tokens
        for mode, (outputs, hits) in modes.items():
            assert outputs == want, (name, mode)
        assert modes["l1"][1]["l1"] > 0
        assert modes["l1+l2"][1]["l2"] > 0
        assert modes["l1+l2+l3"][1]["l3"] > 0


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_dcp4_matches_transformers(ckpts):
    path, prompt, ref_tokens, ref_logits = ckpts["v3_moe_qlora_yarn_shards"]
    for rank, out in enumerate(launch(4, four_rank_worker, path, prompt, timeout_s=600)):
        for backend, (tokens, logits) in out.items():
            assert tokens == ref_tokens and close(logits, ref_logits), (rank, backend)


def test_decode_cli_runs_a_checkpoint_on_explicit_prompt_ids(ckpts, capsys):
    from hicache.commands import decode as cli
    path, prompt, ref_tokens, _ = ckpts["v2_moe_grouped_yarn_tied"]
    rc = cli.main(["decode", "--model", path, "--prompt-ids", ",".join(map(str, prompt)),
                   "--new-tokens", str(NEW), "--json", "--verify"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["prompt"] == prompt and out["tokens"] == ref_tokens
    assert out["verified"]
    for argv, needle in (
            (["--model", path, "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated"),
            (["--model", path, "--prompt-ids", f"1,{VOCAB}"], f"{VOCAB} is not a token id"),
            (["--model", str(Path(path).parent)], "no config.json")):
        assert cli.main(["decode", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_bench_runs_a_checkpoint(ckpts, tmp_path, capsys):
    from hicache.commands import bench as bench_cli
    path = ckpts["v3_moe_halfrope_published"][0]
    policy_file = tmp_path / "p.toml"
    policy_file.write_text('[model]\nnum_layers = 7\n[cache]\npage_size = 4\n[l1]\nnum_pages = 64\n'
                           f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path / "l3"}"\n')
    out = tmp_path / "b.json"
    rc = bench_cli.main(["--config", str(policy_file), "--model", path, "--workload", "chat",
                         "--scale", "0.01", "--max-output", "2", "--modes", "recompute,l1+l2+l3",
                         "--no-progress", "--verify", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["config"]["model"]["path"] == path
    assert report["config"]["model"]["num_layers"] == 2  # from the checkpoint, not the file
    assert report["workloads"][0]["verify"]["equal"]
    model = load_checkpoint(path)
    for rid, toks in report["modes"][0]["outputs"].items():
        assert all(0 <= t < model.cfg.vocab_size for t in toks)
    assert bench_cli.main(["--config", str(policy_file), "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


# ---- clear errors before compute ---------------------------------------------------------------
def _edit_config(src, dst, **changes):
    import shutil
    shutil.copytree(src, dst)
    f = Path(dst) / "config.json"
    raw = json.loads(f.read_text())
    for k, v in changes.items():
        if v is _DROP:
            raw.pop(k, None)
        else:
            raw[k] = v
    f.write_text(json.dumps(raw))
    return dst


_DROP = object()


@pytest.mark.parametrize("changes, needle", [
    (dict(architectures=["LlamaForCausalLM"]),
     "architectures ['LlamaForCausalLM'] is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
     "type 'linear' is not supported"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config ('fp8')"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 is not supported"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported"),
    (dict(topk_method="greedy"), "topk_method 'greedy' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
    (dict(attention_bias=True), "attention_bias True is not supported"),
    (dict(dtype="float8_e4m3fn"), "dtype 'float8_e4m3fn' is not supported"),
    (dict(kv_lora_rank=12), "kv_a_proj_with_mqa.weight (model-0000"),  # shape mismatch
    (dict(num_hidden_layers=3), "num_hidden_layers is 3 but the checkpoint stores 2 layers"),
    (dict(n_routed_experts=1 << 20), "n_routed_experts is 1048576 but the checkpoint stores 8"),
    (dict(vocab_size=VOCAB * 1000), f"vocab_size is {VOCAB * 1000} but model.embed_tokens"),
    (dict(tie_word_embeddings=True), "unexpected tensors lm_head.weight"),
])
def test_bad_checkpoints_are_clear_errors(ckpts, tmp_path, changes, needle):
    bad = _edit_config(ckpts["v3_moe_qlora_yarn_shards"][0], tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert needle in str(e.value), str(e.value)


def test_missing_weight_files_and_v2_specific_values(ckpts, tmp_path):
    v2 = ckpts["v2_dense"][0]
    bad = _edit_config(v2, tmp_path / "norm", first_k_dense_replace=0, n_routed_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, topk_method="greedy")
    with pytest.raises(CheckpointError, match="norm_topk_prob true is not supported"):
        load_checkpoint(bad)
    gone = _edit_config(v2, tmp_path / "gone")
    (Path(gone) / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index"):
        load_checkpoint(gone)
    shards = _edit_config(ckpts["v3_moe_qlora_yarn_shards"][0], tmp_path / "shards")
    next(Path(shards).glob("model-0000*-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="which is missing"):
        load_checkpoint(shards)


def test_weights_signature_names_the_weights_by_content_not_path(ckpts, tmp_path, monkeypatch):
    """Same weights at another path: one signature; other weights (another model, a fine-tune
    of the same shapes, one changed sampled byte, another config): another. Nothing is
    written anywhere (no cache: a checkpoint is signed in well under a second)."""
    import shutil

    from hicache.checkpoints import signature
    from safetensors.numpy import load_file, save_file
    a = shutil.copytree(ckpts["v2_dense"][0], tmp_path / "a")
    b = shutil.copytree(ckpts["v3_moe_halfrope_published"][0], tmp_path / "b")
    elsewhere = shutil.copytree(a, tmp_path / "mnt" / "other-node" / "weights")
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    files = sorted(p.name for p in Path(a).iterdir())
    sig = weights_signature(a)
    assert sig.startswith("xxh3-128:") and sig != weights_signature(b)
    assert weights_signature(elsewhere) == sig  # another path, same weights
    assert not (tmp_path / "cache").exists()
    assert sorted(p.name for p in Path(a).iterdir()) == files  # nothing written there
    f = Path(a) / "model.safetensors"
    tuned = {k: (v + np.ones_like(v)).astype(v.dtype) for k, v in load_file(str(f)).items()}
    save_file(tuned, str(f))  # a fine-tune: same names, dtypes and shapes, other bytes
    changed = weights_signature(a)
    assert changed != sig
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # one bit of the last weight (a sampled chunk), same size
    f.write_bytes(bytes(data))
    assert weights_signature(a) not in (sig, changed)
    cfg = json.loads((Path(elsewhere) / "config.json").read_text())
    (Path(elsewhere) / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.5e4}))
    assert weights_signature(elsewhere) != sig  # the config defines the weights too
    # The engine hands this digest to HiCache: the L3 namespace follows the checkpoint's bytes.
    assert hf.load_model(a).weights_signature() == f"mla-file:{weights_signature(a)}"
    # what is read: the header and SAMPLES chunks per file, whatever its size
    assert signature.sample_offsets(100, 100 + (1 << 30))[:2] == [100, 100 + ((1 << 30)
                                                                           - 4096) // 63]
    assert len(signature.sample_offsets(100, 100 + (1 << 30))) == signature.SAMPLES
    assert signature.sample_offsets(8, 8 + 10_000) == [8, 4104, 8200]  # small: all of it


def test_hicache_signs_a_policy_checkpoint_by_content(ckpts, tmp_path):
    """With L3 on and no [model] signature, HiCache names the weights of [model] path by
    content: another mount of the same weights shares the namespace, other weights do not."""
    import shutil

    from hicache.facade.lifecycle import check_args
    a = ckpts["v2_dense"][0]
    b = shutil.copytree(a, tmp_path / "mnt" / "copy")
    other = ckpts["v3_moe_halfrope_published"][0]
    sig = {name: check_args(policy(p, tmp_path / "l3", 1), 1, None, (0, 1), None)[1]
           for name, p in (("a", a), ("b", b), ("other", other))}
    assert sig["a"] == sig["b"] == hf.load_model(a).weights_signature()
    assert sig["other"] != sig["a"] and str(tmp_path) not in sig["a"]
    assert check_args(policy(a, tmp_path / "l3", 1), 1, None, (0, 1), "rev-7")[1] == \
        "rev-7"


def test_a_top_level_original_max_position_embeddings_is_read_first(ckpts):
    """transformers takes it before the RoPE dict's (16 there, 64 at the top): so does the
    loader, and a model built from the dict's value is caught by the comparison."""
    from dataclasses import replace
    path, prompt, ref_tokens, ref_logits = ckpts["v3_yarn_top_level_original_max"]
    good = load_checkpoint(path)
    assert good.cfg.yarn.original_max_position_embeddings == 64
    wrong = MLAModel(replace(good.cfg, yarn=replace(good.cfg.yarn,
                                                    original_max_position_embeddings=16)),
                     init=False)
    wrong.load_state_dict(good.state_dict(), assign=True)
    assert close(good.forward(prompt + ref_tokens[:-1]), ref_logits)
    assert not close(wrong.forward(prompt + ref_tokens[:-1]), ref_logits)


def test_a_config_that_claims_a_million_layers_is_one_line_without_building_them(ckpts,
                                                                                tmp_path):
    import tracemalloc
    bad = _edit_config(ckpts["v3_moe_qlora_yarn_shards"][0], tmp_path / "big",
                       num_hidden_layers=1_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert "\n" not in msg and "num_hidden_layers is 1000000" in msg, msg
    assert peak < 32 << 20, peak  # the names of a million layers would be gigabytes


def test_a_checkpoint_with_non_finite_weights_is_refused_naming_the_tensor(ckpts, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    d = shutil.copytree(ckpts["v2_dense"][0], tmp_path / "nan")
    f = Path(d) / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[name][3, 2] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} \(model.safetensors\) has 1 "
                                              r"non-finite values"):
        load_checkpoint(d)
    tensors[name][3, 2] = float("inf")
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="non-finite"):
        load_checkpoint(d)
    assert load_checkpoint(d, check_finite=False).cfg.num_layers == 2  # the opt-out loads
