"""Production trace formats (Mooncake, Bailian, hicache) and ``hicache replay``."""

import json

import numpy as np
import pytest

from hicache.commands import cli
from hicache.workloads import traces
from hicache.controller import CacheController
from hicache.errors import ConfigError
from hicache.replay import ReplaySettings, replay
from hicache.replay.offline import ideal_hits, reference_hits


def write(path, lines):
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    return path


def mooncake(tmp_path, n=8, ascending=False):
    lines = []
    for i in range(n):  # a shared system block; every other request continues the one before
        ids = [0, 10 * i + 1, 10 * i + 2] if i % 2 == 0 else [0, 10 * (i - 1) + 1,
                                                              10 * (i - 1) + 2, 10 * i + 3]
        lines.append({"timestamp": 1000 * (i if ascending else n - i), "input_length": 512 * len(ids) - 7,
                      "output_length": 20, "hash_ids": ids})
    return write(tmp_path / "mooncake.jsonl", lines)


def test_tokens_follow_hash_chains_in_every_format(tmp_path):
    t = traces.load(mooncake(tmp_path), "mooncake")
    assert t.block_tokens == 512 and len(t.requests) == 8
    assert [r.arrival_s for r in t.requests] == sorted(r.arrival_s for r in t.requests)
    assert t.requests[0].arrival_s == 1.0  # milliseconds
    for vocab in (None, 97):
        a, b = t.requests[-1].tokens(vocab), t.requests[-2].tokens(vocab)  # b continues a
        assert len(a) == 3 * 512 - 7 and len(b) == 4 * 512 - 7
        assert np.array_equal(a[:3 * 512 - 7], b[:3 * 512 - 7])
        c = t.requests[-3].tokens(vocab)  # another chain: the system block, then differs
        assert np.array_equal(c[:512], a[:512]) and (c[512:1024] != a[512:1024]).any()
        assert (c[512:514] != a[512:514]).any()  # a block's first tokens spell its id
        if vocab:
            assert a.max() < vocab
    small = traces.load(tmp_path / "mooncake.jsonl", "mooncake", 4)
    assert small.requests[0].prompt_len == 4 * 4 and small.requests[0].output_len == 1
    bl = write(tmp_path / "b.jsonl", [
        {"chat_id": 7, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 30,
         "output_length": 9, "type": "text", "turn": 1, "hash_ids": [5, 6]},
        {"chat_id": 8, "parent_chat_id": 7, "timestamp": 3.0, "input_length": 40,
         "output_length": 9, "type": "text", "turn": 2, "hash_ids": [5, 6, 9]}])
    b = traces.load(bl, "bailian")
    assert b.block_tokens == 16 and b.requests[0].arrival_s == 2.5
    assert b.requests[0].session == b.requests[1].session
    assert np.array_equal(b.requests[1].tokens()[:30], b.requests[0].tokens())
    h = write(tmp_path / "h.jsonl", [{"tokens": [1, 2, 3, 4], "output_len": 2}])
    assert traces.load(h, "hicache").requests[0].tokens().tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("line, words", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     "does not fit 1 hash ids"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "'timestamp'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["x"]}',
     "'hash_ids'"),
    ('not json', "not valid JSON"),
])
def test_a_bad_record_is_one_line_naming_its_line(tmp_path, capsys, line, words):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    f = write(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(ConfigError, match=f"t.jsonl:2: .*{words}"):
        traces.load(f, "mooncake")
    assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.jsonl:2" in err[0]


def test_replay_counts_tiers_ideal_and_reference(tmp_path, capsys):
    f = mooncake(tmp_path, 12, ascending=True)
    t = traces.load(f, "mooncake")
    big = replay(t, ReplaySettings(512, 10_000), check=True)
    assert big.hit_tokens["l1"] == ideal_hits(big.keys)
    # the continuing requests hit their parent's 2 whole blocks (its third is partial), the
    # others the system block (but the first)
    assert big.hit_tokens["l1"] == 512 * (6 * 2 + 5 * 1)
    small = replay(t, ReplaySettings(512, 3), check=True)  # no request fits: none cached
    assert small.uncached_requests == 12 and small.hit_ratio == 0
    assert reference_hits(small.keys, 3) > 0 and reference_hits(small.keys, 0) == 0
    rc = cli.main(["replay", str(f), "--trace-format", "mooncake", "--l1", "2048",
                   "--l2", "0", "--l3", "100%", "--capacities", "2048,4096,100%", "--json",
                   "--no-progress", "--plot", str(tmp_path / "sweep.png")])
    assert rc == 0
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    out = json.loads(capsys.readouterr().out)
    assert {"requests", "prompt_tokens", "hit_ratio", "tiers", "ideal_hit_ratio",
            "reference_hit_ratio", "evictions", "wall_s"} <= set(out)
    assert out["requests"] == 12 and out["capacity_pages"]["l3"] == 19  # 100%: the 19 unique blocks
    assert out["l3_traffic"]["pages_written"] > 0 and out["ttft_saved_s"] > 0
    sweep = [r["hit_ratio"] for r in out["sweep"]]
    assert sweep == sorted(sweep) and len(sweep) == 3
    assert all(r["reference_hit_ratio"] >= r["hit_ratio"] - 1e-9 for r in out["sweep"])


def test_in_flight_requests_hold_their_pages(tmp_path):
    lines = [{"timestamp": 0, "input_length": 512 * 3, "output_length": 200,
              "hash_ids": [0, i + 1, i + 2]} for i in range(0, 8, 2)]
    t = traces.load(write(tmp_path / "m.jsonl", lines), "mooncake")
    res = replay(t, ReplaySettings(512, 8), check=True)  # all arrive at once: 4 x 4 pages
    assert res.uncached_requests == 2


@pytest.mark.parametrize("args, words", [
    (["--page-tokens", "0"], "--page-tokens must be in [1, 65536]"),
    (["--l1", "ten"], "--l1 'ten': expected a token count"),
    (["--l2", "5PB"], "unknown unit 'PB'"),
    (["--capacities", ","], "--capacities: give at least one size"),
    (["--max-requests", "0"], "--max-requests must be"),
    (["--block-tokens", "0"], "--block-tokens must be"),
    (["--model", "deepseek-v3", "--tp", "8", "--dcp", "3"], "dcp"),
    (["--plot", "x.png"], "--plot draws the --capacities sweep"),
    (["--compare", "lru,mru"], "--compare: unknown eviction order(s) ['mru']"),
    (["--compare", "lru"], "--compare takes two or more different eviction orders"),
    (["--compare", "lru,lru"], "--compare takes two or more different eviction orders"),
])
def test_bad_replay_flags_are_one_line_exit_2(tmp_path, capsys, args, words):
    f = mooncake(tmp_path)
    assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--no-progress",
                     *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_replay_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["replay", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--trace-format", "--block-tokens", "--page-tokens", "--l1", "--l2", "--l3",
                 "--eviction", "--capacities", "--compare", "--json", "(default 100%)"):
        assert flag in text, flag


def test_sizes_in_bytes_need_a_model(tmp_path, capsys):
    f = mooncake(tmp_path)
    assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--l1", "1GB",
                     "--no-progress"]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--l1", "100MB",
                     "--model", "deepseek-v3", "--tp", "8", "--dcp", "8", "--json",
                     "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    from hicache import topology
    bpt = topology.kv_bytes_per_token(topology.get_model("deepseek-v3"), 8, 8)
    assert out["capacity_pages"]["l1"] == int((100 << 20) // bpt) // 512


def test_reuse_eviction_keeps_a_prefix_that_came_back():
    """A prefix that keeps coming back outlives the one-off prompts between its uses under
    ``reuse``; LRU evicts it each time (they fill the cache in between)."""
    hits = {}
    for policy in ("lru", "reuse"):
        c = CacheController(4, 12, 0, eviction=policy)
        rng = np.random.default_rng(0)

        def run(toks):
            m = c.match(toks, lock=True)
            pages = list(m.device_pages) + c.alloc_device(len(toks) // 4 - len(m.device_pages))
            c.insert(toks, pages, after=m.lock)
            return m.device_len
        for _ in range(10):  # the order learns how long one-off prompts live
            run(rng.integers(1000, 2000, 8))
        hot = rng.integers(0, 1000, 16)
        run(hot), run(hot)
        hits[policy] = 0
        for _ in range(8):
            for _ in range(5):  # 10 pages of one-off prompts: more than LRU keeps beside it
                run(rng.integers(1000, 2000, 8))
            hits[policy] += run(hot)
        c.check()
    assert hits["lru"] == 0 and hits["reuse"] >= 6 * 16, hits


def test_replay_of_a_hicache_trace_and_bench_trace_errors(tmp_path, capsys):
    from hicache.commands import bench as bench_cli
    h = write(tmp_path / "h.jsonl", [{"length": 40, "prefix_id": "s", "prefix_len": 32,
                                      "output_len": 2} for _ in range(5)])
    assert cli.main(["replay", str(h), "--trace-format", "hicache", "--page-tokens", "8",
                     "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tiers"]["l1"]["hit_tokens"] == 4 * 32 and out["ideal_hit_ratio"] == 128 / 200
    assert cli.main(["replay", str(h), "--trace-format", "hicache", "--block-tokens", "8",
                     "--no-progress"]) == 2
    assert "--block-tokens applies to hash-id traces" in capsys.readouterr().err
    bad = write(tmp_path / "m.jsonl", ['{"timestamp": 0, "input_length": 5, "output_length": 1,'
                                       ' "hash_ids": [1]}', '{"timestamp": 0}'])
    assert bench_cli.main(["--trace", str(bad), "--trace-format", "mooncake",
                           "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "m.jsonl:2" in err[0] and "missing" in err[0]


def test_a_trace_whose_ids_overflow_int32_tokens_replays_as_with_small_ids(tmp_path):
    """The cache keeps token ids as int32: a trace whose ``id * block + position`` would not
    fit maps its blocks through the int32 vocabulary instead (the whole trace, so equal ids stay
    equal tokens), and replays to the same hits as the same trace with small ids; the decoded
    fillers are negative (never a prompt id), the same for the same prompt."""
    small = [json.loads(line) for line in mooncake(tmp_path, 12, ascending=True).read_text()
             .splitlines()]
    big = [dict(x, hash_ids=[traces.MAX_HASH_ID - h for h in x["hash_ids"]]) for x in small]
    f = write(tmp_path / "big.jsonl", big)
    t, s = traces.load(f, "mooncake"), traces.load(tmp_path / "mooncake.jsonl", "mooncake")
    assert all(r.vocab == traces.TOKEN_MAX for r in t.requests)
    assert all(r.vocab is None for r in s.requests)
    toks = [r.tokens() for r in t.requests]
    assert all(0 <= x.min() and x.max() <= traces.TOKEN_MAX for x in toks)
    assert np.array_equal(toks[1][:2 * 512], toks[0][:2 * 512])  # 1 continues 0
    assert (toks[2][512:1024] != toks[0][512:1024]).any()
    for cap in (10_000, 5):
        a = replay(t, ReplaySettings(512, cap), check=True)
        b = replay(s, ReplaySettings(512, cap), check=True)
        assert a.hit_tokens == b.hit_tokens and a.hit_tokens["l1"] > 0
    from hicache.replay.keys import Fillers
    fill = Fillers()
    p, q = toks[0], toks[2]
    one, again, other = (fill.tokens(p, [1, 2], 512, 40), fill.tokens(p, [1, 2], 512, 40),
                         fill.tokens(q, [3, 4], 512, 40))
    assert np.array_equal(one, again) and (one != other).all()
    assert one.max() < 0 and one.min() >= -(1 << 31)


def test_compare_replays_each_order_once_beside_the_others(tmp_path, capsys, monkeypatch):
    """``--compare lru,learned`` at each capacity: the same hit ratios as separate runs, one
    reference per capacity, and no (order, size) replayed twice."""
    from hicache.replay import command
    f = mooncake(tmp_path, 12, ascending=True)
    sizes = "2048,4096,100%"

    def report(*flags):
        assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--capacities", sizes,
                         "--json", "--no-progress", *flags]) == 0
        return json.loads(capsys.readouterr().out)
    alone = {e: report("--eviction", e)["sweep"] for e in ("lru", "learned")}
    calls = []
    real = command.replay
    monkeypatch.setattr(command, "replay", lambda t, s, **kw: calls.append(
        (s.eviction, s.l1_pages)) or real(t, s, **kw))
    out = report("--eviction", "learned", "--compare", "lru,learned",
                 "--plot", str(tmp_path / "cmp.png"))
    assert len(calls) == len(set(calls)) == 6  # learned at 100% (the default --l1) is one
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    assert [c["capacity_pages"] for c in out["compare"]] == [4, 8, 19]
    for i, c in enumerate(out["compare"]):
        assert c["hit_ratio"] == {e: alone[e][i]["hit_ratio"] for e in ("lru", "learned")}
        assert c["reference_hit_ratio"] == alone["lru"][i]["reference_hit_ratio"]
    def timeless(rows):  # wall times differ from run to run
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]
    assert timeless(out["sweep"]) == timeless(alone["learned"])
    assert cli.main(["replay", str(f), "--trace-format", "mooncake", "--l1", "4096",
                     "--compare", "learned,lru", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "lru vs learned" in text and text.count("\n") > 5
