"""Kimi Linear (MLA + KDA) checkpoints in the engine, checked against transformers itself.

Tiny random checkpoints are built with transformers' ``KimiLinearConfig`` /
``KimiLinearForCausalLM`` and ``save_pretrained``: KDA first or MLA first, layer kinds from
``linear_attn_config`` lists or from ``layer_types``, a dense first layer then MoE, all dense,
q LoRA on and off. The engine must give transformers' greedy tokens (``generate``) and its
logits within ``TOL`` of the largest logit (fp32): the dense reference, DCP 1 in process, DCP 4
and DCP 2 in one spawned gloo group (MLA KV striped, KDA state replicated, no collective in a
KDA layer), chunked prefill equal to one-shot, batched requests equal to single ones, a failed
step leaving the KDA state as it was; ``hicache decode --model`` runs it and rejects bad
configs with one line.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_weights import seed_weights

from hicache.distributed import CollectiveCounter, launch
from hicache.checkpoints import hf
from hicache.errors import CheckpointError, UsageError

TOL = 1e-4
NEW = 6
VOCAB = 96
PROMPT_LEN = 11
CASES = {
    # name: make_checkpoint keyword arguments
    "kda_first_dense0_moe": dict(kda=[1, 2, 4], full=[3], first_dense=1, q_lora=None),
    "mla_first_dense_qlora_types": dict(kda=[2, 4], full=[1, 3], first_dense=4, q_lora=12,
                                        heads=2, head_dim=6, kernel=3, as_types=True),
}


def make_checkpoint(path, *, kda, full, first_dense=1, q_lora=None, heads=2, head_dim=8,
                    kernel=4, as_types=False, seed=0):
    """Save a tiny random Kimi Linear checkpoint with transformers; return the model.

    Weights are redrawn with a spread that makes routing and greedy tokens non-degenerate;
    ``A_log`` and ``dt_bias`` keep transformers' init (FLA's decay ranges). ``as_types``
    writes the layer kinds as ``layer_types`` instead of the 1-indexed lists."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    layers = len(kda) + len(full)
    lin = {"num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": kernel}
    extra = {}
    if as_types:
        extra["layer_types"] = ["linear_attention" if i + 1 in kda else "full_attention"
                                for i in range(layers)]
    else:
        lin.update(kda_layers=kda, full_attn_layers=full)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=12, num_experts=8, num_experts_per_token=3, num_shared_experts=1,
        num_expert_group=2, topk_group=1, first_k_dense_replace=first_dense,
        routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config=lin, **extra)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    seed_weights(model, g, skip=("A_log", "dt_bias"))
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_reference(model, prompt, new=NEW):
    """transformers' greedy tokens and its logits over prompt + tokens (fp32 numpy)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                         min_new_tokens=new)
    return out[0, len(prompt):].tolist(), model(out).logits[0, :-1].float().numpy()


def close(got, ref) -> bool:
    got, ref = np.asarray(got, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    return got.shape == ref.shape and float(np.abs(got - ref).max()) <= TOL * max(
        1.0, float(np.abs(ref).max()))


def prompt_of(seed, n=PROMPT_LEN):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (dir, prompt, hf tokens, hf logits)."""
    root = tmp_path_factory.mktemp("kimi")
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        d = root / name
        model = make_checkpoint(d, seed=i, **kw)
        prompt = prompt_of(i)
        out[name] = (str(d), prompt, *hf_reference(model, prompt))
    return out


# ---- the engine's runs (in-process or in each rank) --------------------------------------------
def make_runner(model, rank=0, world=1, group=None, pages=32, page_size=2, **kw):
    from hicache.engine.runner import DCPRunner
    from hicache.l1 import DeviceKVPool
    from hicache.layout import DCPLayout
    cfg = model.cfg
    layout = DCPLayout(world, rank, page_size)
    pool = DeviceKVPool(layout, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, pages)
    return DCPRunner(model, pool, backend="a2a", replicate_q=True, group=group,
                     attn_backend="torch", **kw)


def engine_decode(runner, prompt, chunks=None):
    """Prefill (in ``chunks`` when given) then greedy decode: (tokens, logits [P+NEW-1, V])."""
    from hicache.engine.runner import RequestState, reserve
    from hicache.pages import PageAllocator
    st = RequestState()
    reserve(st, PageAllocator(runner.kv.num_pages if hasattr(runner.kv, "num_pages") else 32),
            len(prompt) + NEW, runner.page_tokens)
    rows, s = [], 0
    for n in (chunks or [len(prompt)]):
        rows.append(runner.extend(st, prompt[s:s + n]))
        s += n
    tokens = []
    for _ in range(NEW):
        tokens.append(int(rows[-1][-1].argmax()))
        if len(tokens) < NEW:
            rows.append(runner.extend(st, [tokens[-1]]))
    return tokens, torch.cat(rows).numpy()


def rank_checks(model, prompt, rank, world, group):
    """One rank's runs of one checkpoint: one-shot, chunked, and what the collectives were."""
    runner = make_runner(model, rank, world, group)
    with CollectiveCounter.measure() as m:
        one = engine_decode(runner, prompt)
    chunked = engine_decode(make_runner(model, rank, world, group), prompt, chunks=[4, 1, 6])
    st = runner.stats
    return {"one": one, "chunked": chunked, "collectives": m["n"],
            "counted": st.dcp_collectives + st.tp_collectives, "layers_run": st.layers_run,
            "kv_rows": runner.kv.layout.local_length(PROMPT_LEN + NEW - 1),
            "state_slots_used": runner.states.used}


def group_worker(rank, world, cases):
    """c = 4 on the world group, then c = 2 on subgroups {0,1}, {2,3}: every case in each."""
    import torch.distributed as dist
    out = {}
    subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for c, group in ((4, None), (2, subgroups[rank // 2])):
        out[c] = {name: rank_checks(hf.load_model(path), prompt, rank % c, c, group)
                  for name, (path, prompt) in cases.items()}
    return out


# ---- tests ----------------------------------------------------------------------------------------
def test_dense_reference_and_dcp1_match_transformers(ckpts):
    for name, (path, prompt, ref_tokens, ref_logits) in ckpts.items():
        model = hf.load_model(path)
        assert type(model).__name__ == "KimiLinearModel"
        seq = prompt + ref_tokens
        assert close(model.forward(seq[:-1]).numpy(), ref_logits), name
        assert model.generate(prompt, NEW) == ref_tokens, name
        runner = make_runner(model)
        assert type(runner).__name__ == "HybridRunner"
        tokens, logits = engine_decode(runner, prompt)
        assert tokens == ref_tokens and close(logits, ref_logits), name
        c_tokens, c_logits = engine_decode(make_runner(model), prompt, chunks=[3, 3, 5])
        assert c_tokens == tokens and close(c_logits, ref_logits), name
        # the KV pool holds the MLA layers only
        assert runner.kv.num_layers == len(model.hybrid.mla_layers) < model.hybrid.num_layers


def test_dcp_4_and_2_match_transformers_in_one_group(ckpts):
    cases = {name: (path, prompt) for name, (path, prompt, _, _) in ckpts.items()}
    results = launch(4, group_worker, cases, backend="gloo", timeout_s=600)
    for c in (4, 2):
        for name, (path, prompt, ref_tokens, ref_logits) in ckpts.items():
            hyb = hf.load_model(path).hybrid
            mla = len(hyb.mla_layers)
            rows = []
            for rank in range(4):
                r = results[rank][c][name]
                for mode in ("one", "chunked"):
                    tokens, logits = r[mode]
                    assert tokens == ref_tokens and close(logits, ref_logits), (c, name, mode)
                # every collective of a step belongs to an MLA layer (KDA runs none)
                assert r["collectives"] == r["counted"] > 0, (c, name)
                assert r["layers_run"] == mla * NEW, (c, name)
                # the finished request's state slot came back when its state was dropped
                assert r["state_slots_used"] == 0
                rows.append(r["kv_rows"])
            # MLA KV striped: a group's ranks hold disjoint shares of every position
            for start in range(0, 4, c):
                assert sum(rows[start:start + c]) == PROMPT_LEN + NEW - 1


def test_batch_equals_single_and_failed_step_keeps_state(ckpts):
    from hicache.engine.runner import RequestState, reserve
    from hicache.pages import PageAllocator
    path, prompt, ref_tokens, ref_logits = ckpts["kda_first_dense0_moe"]
    model = hf.load_model(path)
    other = prompt_of(7, 5)
    single = model.forward(other).numpy()
    fail = {"on": False}

    def hook(j):
        if fail["on"]:
            raise RuntimeError("injected fault in KV layer %d" % j)

    runner = make_runner(model, layer_hook=hook)
    alloc = PageAllocator(32)
    a, b = RequestState(), RequestState()
    reserve(a, alloc, len(prompt) + 2, runner.page_tokens)
    reserve(b, alloc, len(other), runner.page_tokens)
    la, lb = runner.extend_batch([a, b], [prompt[:4], other[:2]])
    la2, lb2 = runner.extend_batch([a, b], [prompt[4:], other[2:]])
    assert close(torch.cat([la, la2]).numpy(), ref_logits[:len(prompt)])
    assert close(torch.cat([lb, lb2]).numpy(), single)
    assert runner.states.used == 2
    # a step that fails after its KDA layers ran leaves every state where it was
    fail["on"] = True
    with pytest.raises(RuntimeError, match="injected"):
        runner.extend(a, [ref_tokens[0]])
    assert a.length == len(prompt)
    fail["on"] = False
    nxt = runner.extend(a, [ref_tokens[0]])
    assert close(nxt.numpy(), ref_logits[len(prompt):len(prompt) + 1])
    # a request whose KV position has no KDA state behind it is refused, not run on zeros
    c = RequestState(page_table=list(b.page_table), length=3)
    with pytest.raises(UsageError, match="no KDA state"):
        runner.extend(c, [5])
    runner.release(b)
    del c
    assert runner.states.used == 1


def test_snapshots_inside_a_step_restore_a_prefix_hit(ckpts):
    """The KDA state kept at positions inside a prefill step, restored into a new request over
    the same cached MLA KV pages, continues exactly (the engine half of a hybrid prefix hit)."""
    from hicache.engine.runner import RequestState, reserve
    from hicache.pages import PageAllocator
    path, prompt, ref_tokens, ref_logits = ckpts["kda_first_dense0_moe"]
    model = hf.load_model(path)
    runner = make_runner(model)
    alloc = PageAllocator(32)
    a = RequestState()
    reserve(a, alloc, len(prompt), runner.page_tokens)
    logits, snaps = runner.extend_snapshots(a, prompt, at=[4, 8, len(prompt)])
    assert close(logits.numpy(), ref_logits[:len(prompt)])
    assert [s.length for s in snaps] == [4, 8, len(prompt)]
    assert torch.equal(snaps[-1].rec, runner.states.snapshot(a).rec)
    other = prompt_of(9, 3)
    for snap in snaps[:2]:
        p = snap.length
        # a request over a's first p positions of KV (shared pages) and the snapshot
        b = RequestState(page_table=a.page_table[:p // runner.page_tokens], length=p)
        reserve(b, alloc, len(prompt), runner.page_tokens)
        runner.states.restore(b, snap)
        got = runner.extend(b, prompt[p:])
        assert close(got.numpy(), ref_logits[p:len(prompt)]), p
        # the same state as extending exactly p tokens from scratch
        c = RequestState()
        reserve(c, alloc, p + len(other), runner.page_tokens)
        runner.extend(c, prompt[:p])
        assert torch.allclose(runner.states.snapshot(c).rec, snap.rec, atol=1e-5)
        # and a continuation that differs right after the snapshot position
        d = RequestState(page_table=a.page_table[:p // runner.page_tokens], length=p)
        reserve(d, alloc, p + len(other), runner.page_tokens)
        runner.states.restore(d, snap)
        assert close(runner.extend(d, other).numpy(),
                     model.forward(prompt[:p] + other).numpy()[p:]), p
        for st in (b, c, d):
            runner.release(st)
    with pytest.raises(UsageError, match="outside this step"):
        runner.extend_snapshots(a, [3], at=[0])


def test_decode_cli_runs_kimi_at_dcp2_and_rejects_bad_configs(ckpts, tmp_path, capsys):
    from hicache.commands import decode as cli
    path, prompt, ref_tokens, _ = ckpts["kda_first_dense0_moe"]
    rc = cli.main(["decode", "--model", path, "--dcp", "2", "--prompt-ids",
                   ",".join(map(str, prompt)), "--new-tokens", str(NEW), "--json", "--verify"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["tokens"] == ref_tokens and out["verified"]
    assert sum(out["kv_rows_per_rank"]) == len(prompt) + NEW
    raw = json.loads((Path(path) / "config.json").read_text())
    bad = {
        "unknown_type": (dict(raw, layer_types=["linear_attention", "linear_attention",
                                                "sliding_window", "linear_attention"]),
                         "layer_types[2] 'sliding_window' is not a known layer type"),
        "kda_count": (dict(raw, layer_types=None, linear_attn_config=dict(
            raw["linear_attn_config"], kda_layers=[1, 2, 3], full_attn_layers=[4])),
            "config.json has 3 KDA layers [1, 2, 3] (1-indexed) but the tensors hold 3 "
            "([1, 2, 4]"),
        "kda_lists_disagree": (dict(raw, linear_attn_config=dict(
            raw["linear_attn_config"], kda_layers=[1, 2], full_attn_layers=[3, 4])),
            "layer_types[3] is 'linear_attention' but linear_attn_config lists layer 4 as "
            "'full_attention'"),
    }
    for name, (cfg, needle) in bad.items():
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").symlink_to(Path(path) / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
        assert cli.main(["decode", "--model", str(d), "--prompt-ids", "3,4,5"]) == 2, name
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (name, err)
        with pytest.raises(CheckpointError):
            hf.load_model(d)
    assert cli.main(["decode", "--model", path, "--pcp", "2", "--prompt-ids", "3,4,5"]) == 2
    assert "hybrid" in capsys.readouterr().err


def test_deepseek_checkpoints_get_the_plain_engine(tmp_path):
    """A DeepSeek checkpoint loads as MLAModel and runs on DCPRunner itself: no state pool."""
    from test_hf_checkpoint import make_checkpoint as deepseek_checkpoint
    from hicache.checkpoints.hf_config import kv_shape
    from hicache.engine.model import MLAModel
    deepseek_checkpoint(tmp_path / "ds", arch="v3", q_lora=None, moe=True)
    model = hf.load_model(tmp_path / "ds")
    assert type(model) is MLAModel and getattr(model, "hybrid", None) is None
    runner = make_runner(model)
    assert type(runner).__name__ == "DCPRunner" and not hasattr(runner, "states")
    assert kv_shape(tmp_path / "ds")["num_layers"] == 2
