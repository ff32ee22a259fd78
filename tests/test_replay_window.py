"""A production trace's first requests through the model (hicache-bench --trace --max-requests,
--verify) hit exactly what ``hicache replay`` says on the same window and capacities."""

import json

from hicache.commands import bench as bench_cli
from hicache.replay import command as replay_command
from hicache.commands import cli

from helpers import policy_toml


def bailian_lines(n: int = 14) -> list[dict]:
    """Conversations over 16-token blocks: a shared system block, turns extending their
    parent's chain, and one-off requests between them."""
    lines, nxt, t = [], 100, 0.0
    chains: dict[int, list[int]] = {}
    for i in range(n):
        if i % 3 == 2 and chains:  # a later turn of an earlier chat
            parent = sorted(chains)[(i // 3) % len(chains)]
            ids = chains[parent] + [nxt, nxt + 1]
            nxt += 2
            rec = {"chat_id": i, "parent_chat_id": parent, "turn": 2}
        else:
            ids = [1] + list(range(nxt, nxt + 3 + i % 2))
            nxt += 4
            rec = {"chat_id": i, "parent_chat_id": -1, "turn": 1}
        chains[i] = ids
        rec.update(timestamp=t, input_length=16 * len(ids) - 5, output_length=4,
                   type="text", hash_ids=ids)
        lines.append(rec)
        t += 100.0  # far apart: one request at a time, as --max-running 1 serves them
    return lines


def test_model_window_hits_equal_the_replay(tmp_path, capsys):
    trace = tmp_path / "bailian.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in bailian_lines()) + "\n")
    cfg = tmp_path / "policy.toml"
    l1_pages = 20
    cfg.write_text(policy_toml(None, page_size=8, l1_pages=l1_pages, l2_ratio=1.0))
    out = tmp_path / "bench.json"
    window = 12
    rc = bench_cli.main(["--config", str(cfg), "--trace", str(trace), "--trace-format",
                         "bailian", "--block-tokens", "8", "--max-requests", str(window),
                         "--modes", "l1,l1+l2", "--max-running", "1", "--max-output", "8",
                         "--verify", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["workloads"][0]["verify"]["equal"] is True
    modes = {m["name"]: m for m in report["modes"]}
    for mode, l2 in (("l1", 0), ("l1+l2", l1_pages * 8)):
        args = cli.build_parser().parse_args(
            ["replay", str(trace), "--trace-format", "bailian", "--block-tokens", "8",
             "--page-tokens", "8", "--l1", str(l1_pages * 8), "--l2", str(l2),
             "--max-requests", str(window), "--no-progress"])
        rep = replay_command.run(args)
        bench = modes[mode]
        assert rep["requests"] == window
        assert rep["prompt_tokens"] == bench["prompt_tokens"]
        assert rep["evictions"]["l1_pages"] > 0  # the window overflows L1: eviction matters
        for tier in ("l1", "l2", "l3"):
            assert rep["tiers"][tier]["hit_tokens"] == bench["hit_tokens"][tier], (mode, tier)
        assert rep["hit_ratio"] == bench["hit_ratio"]
    assert modes["l1+l2"]["hit_tokens"]["l2"] > 0
