"""Speculative decoding's interface points (issue 25 point 5): ``hicache-bench --spec`` rows side
by side, ``hicache plan --spec``, and ``check-config`` / the node memory check counting the
draft's replicated KV bytes."""

import json

import pytest
import torch

from helpers import policy_toml

from hicache import preflight
from hicache.commands import bench as bench_cli, cli
from hicache.config import loads
from hicache.engine.model import MLAModel, ModelConfig
from hicache.errors import ConfigError
from hicache.companions.draft_format import draft_format


def run(main, argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_counts_the_replicated_draft(capsys):
    rc, out, _ = run(cli.main, ["plan", "--model", "deepseek-r1", "--tp", "8", "--memory", "40",
                                "--spec", "mtp", "--json"], capsys)
    assert rc == 0
    rows = json.loads(out)["rows"]
    # one MTP layer of (512 + 64) bf16 on EVERY rank: the same for every DCP size
    assert {r["draft_kv_bytes_per_token_per_rank"] for r in rows} == {576 * 2}
    for r in rows:
        both = r["kv_bytes_per_token_per_rank"] + 1152
        assert r["kv_bytes_per_token_per_rank_with_draft"] == both
        assert r["tokens_in_budget_with_draft"] == int(40 * (1 << 30) // both)
        assert r["tokens_in_budget_with_draft"] < r["tokens_in_budget"]
    rc, out, _ = run(cli.main, ["plan", "--model", "deepseek-r1", "--tp", "8", "--spec",
                                "draft", "--draft-shape", "mla:4:512:64:4", "--json"], capsys)
    assert rc == 0 and json.loads(out)["rows"][0]["draft_kv_bytes_per_token_per_rank"] == \
        4 * 576 * 4


@pytest.mark.parametrize("argv, line", [
    (["--spec", "draft"], "--spec draft needs --draft-shape"),
    (["--draft-shape", "mla:1:2:2"], "--draft-shape needs --spec draft"),
    (["--spec", "draft", "--draft-shape", "gqa:2:8:64"], "the draft must be MLA"),
])
def test_plan_spec_bad_input(capsys, argv, line):
    rc, _, err = run(cli.main, ["plan", "--model", "deepseek-r1", "--tp", "8"] + argv, capsys)
    assert rc == 2 and line in err and err.count("\n") == 1


def test_check_config_and_memory_count_the_draft(tmp_path, capsys):
    plain = tmp_path / "plain.toml"
    mtp = tmp_path / "mtp.toml"
    plain.write_text(policy_toml())
    mtp.write_text(policy_toml() + '[spec]\nmethod = "mtp"\n')
    a, b = (json.loads(run(cli.main, ["check-config", str(p), "--json"], capsys)[1])
            for p in (plain, mtp))
    cfg = loads(mtp.read_text())
    d = draft_format(cfg)
    assert d.rows == cfg.page_tokens and d.layers == 1 and d.row_width == cfg.model.kv_dim
    assert b["page_bytes_per_rank"] == a["page_bytes_per_rank"] + d.page_bytes
    assert any(line.startswith("draft: replicated") for line in b["page_formats"])
    base = loads(plain.read_text())
    need, need0 = preflight.memory_need(cfg, 2), preflight.memory_need(base, 2)
    assert need.l1_per_rank == need0.l1_per_rank + cfg.l1.num_pages * d.page_bytes


def test_draft_format_reads_the_draft_model_file(tmp_path):
    f = tmp_path / "d.pt"
    MLAModel(ModelConfig(num_layers=3, kv_lora_rank=16, qk_rope_head_dim=8)).save(f)
    cfg = loads(policy_toml(dcp=2) + f'[spec]\nmethod = "draft"\ndraft_model = "{f}"\n')
    d = draft_format(cfg)
    assert (d.layers, d.rows, d.row_width, d.dtype) == (3, 8, 24, torch.float32)
    with pytest.raises(ConfigError, match="spec.draft_model: .* neither"):
        loads(policy_toml() + '[spec]\nmethod = "draft"\ndraft_model = "/nonexistent"\n'
              ).formats


@pytest.fixture(scope="module")
def draft_file(tmp_path_factory):
    from hicache import load_config
    from hicache.serving import model_config
    path = tmp_path_factory.mktemp("benchspec") / "draft.pt"
    MLAModel(model_config(load_config(bench_cli.EXAMPLE))).save(path)  # draft = target
    return str(path)


def test_bench_spec_serves_the_chat_workload_batched(draft_file, tmp_path, capsys):
    """``hicache-bench --spec none,draft`` serves the chat workload through the batched loop:
    per row the ``speculative`` object (requests, tokens per target step, acceptance, by
    draft KV source), TPOT against the none row, and --verify: every request's tokens equal
    plain decoding's."""
    out = tmp_path / "spec.json"
    rc, text, _ = run(bench_cli.main, ["--spec", "none,draft", "--draft-model", draft_file,
                                       "--dcp", "1", "--workload", "chat", "--scale", "0.01",
                                       "--max-output", "9", "--num-draft-tokens", "2",
                                       "--l3-path", str(tmp_path / "l3"), "--verify",
                                       "--no-progress", "--out", str(out)], capsys)
    assert rc == 0
    head = next(x for x in text.splitlines() if x.startswith("mode"))
    for col in ("TPOT ms", "x none", "tok/step", "accept", "accept by source", "tokens ok"):
        assert col in head
    (entry,) = json.loads(out.read_text())["workloads"]
    rows = entry["rows"]
    assert [(r["mode"], r["spec"]) for r in rows] == [("l1+l2+l3", "none"),
                                                     ("l1+l2+l3", "draft")]
    assert rows[0]["speculative"] is None and rows[0]["tpot_ratio"] == 1.0
    sp = rows[1]["speculative"]
    assert sp["requests"] == rows[1]["requests"] > 1
    # draft = target: every proposal accepted (a round proposes fewer near a request's end)
    assert sp["acceptance_rate"] == 1.0 and sp["tokens_per_target_step"] > 1.5
    assert sum(b["requests"] for b in sp["by_source"].values()) == sp["requests"]
    assert {"cold", "l1"} <= set(sp["by_source"]) and sp["flagged"] == []
    assert all(r["tokens_match"] for r in rows)


@pytest.mark.parametrize("argv, line", [
    (["--spec", "none,mtpp"], "--spec: unknown method 'mtpp'"),
    (["--spec", "none,mtp"], "--spec mtp needs --model DIR"),
    (["--spec", "draft"], "--spec draft needs --draft-model DIR"),
    (["--spec", "none", "--draft-model", "x"], "--draft-model is given but --spec has no"),
    (["--draft-model", "x"], "--draft-model / --num-draft-tokens need --spec"),
    (["--spec", "none", "--num-draft-tokens", "9"], "num_draft_tokens must be an int in [1, 8]"),
])
def test_bench_spec_bad_input(capsys, argv, line):
    rc, _, err = run(bench_cli.main, argv, capsys)
    assert rc == 2 and line in err and err.count("\n") == 1


def test_bench_spec_cache_figures(capsys):
    # bench/spec.py --cache: the draft's pages restored from L1 and from L3 after a restart
    # (nothing recomputed), recomputed for a prefix written without speculation; tokens ok
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "spec.py"
    spec = importlib.util.spec_from_file_location("bench_spec_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--dcp", "1", "--k", "2", "--cache", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["cache"]
    rows = {r["request"]: r for r in out["rows"]}
    assert rows["l1 hit"]["draft_restored"] == 64 and rows["l1 hit"]["hit"]["l1"] == 64
    assert rows["l3 hit (restart)"]["hit"]["l3"] == 64
    assert rows["l3 hit (restart)"]["draft_restored"] == 64
    assert rows["l1 hit, no draft"]["draft_recomputed_tokens"] == 64
    assert all(r["tokens_ok"] for r in out["rows"])
    assert out["draft_bytes_by_tier"]["l3_write"] == out["draft_bytes_l3_read_after_restart"]
