"""The ``learned`` eviction order: its return model (rates, gaps, index), the classes and
returns the controller feeds it, the order it yields, and a trace where it beats LRU."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import HiCacheConfig
from hicache.controller import CacheController
from hicache.controller.learned_order import LearnedOrder
from hicache.controller.order import EvictionOrder
from hicache.controller.returns import (CLASSES, DECODED_EDGES, EDGES, ReturnModel, age_bin,
                                        class_turn, hit_density, request_class)
from hicache.errors import UsageError
from hicache.controller.tree import Node
from hicache.replay import ReplaySettings, replay
from hicache.workloads import traces

PT = 4


def test_request_classes_and_age_bins():
    d = len(DECODED_EDGES) + 1  # decoded-token classes within each new-page class
    assert request_class(0, 0) == 0 and request_class(0, 2) == d and request_class(0, 40) == 5 * d
    assert [request_class(0, 0, n) for n in (0, 63, 64, 10 ** 6)] == [0, 0, 1, 1]
    assert class_turn(request_class(2, 3, 300)) == 2 and class_turn(request_class(9, 0)) == 3
    assert request_class(9, 10 ** 6, 10 ** 6) == CLASSES - 1
    assert len({request_class(t, p, n) for t in range(4) for p in (0, 2, 4, 8, 16, 32, 64)
                for n in (0, 64)}) == CLASSES
    for age in (0, 1, 7, 100, 12345, 10 ** 9):
        b = age_bin(age)
        assert EDGES[b] <= age < EDGES[b + 1]
    assert age_bin(10 ** 15) == len(EDGES) - 2  # past the last edge: the last bin


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_hit_density_is_the_best_ratio_over_horizons(p):
    """Against a direct computation: per start bin, the best returns per tick of residency
    over every later edge."""
    rng = np.random.default_rng(1)
    k = 40
    cdf = np.concatenate([[0.0], np.cumsum(rng.random(k - 1))])
    cdf /= cdf[-1]                                 # F at the first k edges
    got = hit_density(p, cdf)
    for j in range(k - 1):
        best = 0.0
        for e in range(j + 1, k):
            life = sum((EDGES[i + 1] - EDGES[i]) * (1 - p * (cdf[i] + cdf[i + 1]) / 2)
                       for i in range(j, e))
            best = max(best, p * (cdf[e] - cdf[j]) / life)
        assert got[j] == pytest.approx(best, rel=1e-9)
    assert not got[k - 1:].any()                    # no return comes later: worth nothing
    assert (hit_density(min(p + 0.05, 1.0), cdf)[:k - 1] > got[:k - 1]).all()


def test_return_rates_are_learnt_while_returns_are_still_to_come():
    """Rates from returns over exposure (each insert weighted by the chance its return would be
    seen by now) match the truth although the newest chains have not returned yet; returns
    over inserts would read low."""
    rng = np.random.default_rng(0)
    m = ReturnModel(min_returns=1, refresh_every=10 ** 9)
    truth = {0: 0.2, 7: 0.6}
    pending = []
    now = 0
    for now in range(0, 40_000, 2):
        cls = 0 if (now // 2) % 2 else 7
        m.inserted(cls, now)
        if rng.random() < truth[cls]:
            pending.append((now + int(rng.integers(200, 4000)), cls, now))
        for item in [x for x in pending if x[0] <= now]:
            pending.remove(item)
            m.returned(item[1], item[0] - item[2])
    m.refresh(now)
    assert m.ready and pending                      # some returns still to come
    for cls, p in truth.items():
        assert m.rates[cls] == pytest.approx(p, abs=0.03)
    naive = m.returns[7] / (m.mature[7] + len(m._young[7]))
    assert m.rates[7] - naive > 0.01


def test_the_model_stays_bounded_when_nothing_returns(monkeypatch):
    from hicache.controller import returns
    monkeypatch.setattr(returns, "MAX_YOUNG", 100)
    m = ReturnModel()
    for now in range(5000):
        m.inserted(now % 3, now)
    assert not m.ready and max(len(q) for q in m._young) == 100
    assert m.mature[:3].sum() + sum(len(q) for q in m._young) == 5000


def _node(nid, cls, t):
    n = Node(nid, None, b"", 1)
    n.rclass, n.last_access = cls, t
    return n


def test_order_is_lru_until_ready_then_lowest_index_first():
    m = ReturnModel(min_returns=10 ** 9)
    o = LearnedOrder(m)
    nodes = [_node(i + 1, c, t + 1) for t, (i, c) in enumerate(
        enumerate([2, 0, 1, 1, 0, 2, 2, 0, 1, 0]))]
    for n in nodes:  # in the order of their last use, as the controller adds and touches them
        o.add(n)
    assert [n.last_access for n in o] == sorted(n.last_access for n in nodes)
    # a class whose index rises then falls with age (young and old are both low), one that
    # falls, one flat: the order must be exactly by value
    bins = len(EDGES) - 1
    age = np.arange(bins, dtype=np.float64)
    rows = np.zeros((CLASSES, bins))
    rows[0] = -(age - 3.0) ** 2
    rows[1] = -age * 0.5
    rows[2] = -4.0
    m.rows, m.ready = rows.tolist(), True
    got = list(o)  # by value; ties: least recently added or touched first
    assert sorted(got, key=lambda n: (m.value(n.rclass, 10 - n.last_access),
                                      n.last_access)) == got
    assert len(got) == len(nodes) == len(o)
    nodes[0].rclass = 2                              # reclassed: touched into its new list
    nodes[0].last_access = 11
    o.touch(nodes[0])
    o.remove(nodes[1])
    got = list(o)
    assert nodes[1] not in o and len(got) == 9 and len(set(got)) == 9
    assert sorted(got, key=lambda n: (m.value(n.rclass, 11 - n.last_access),
                                      n.last_access)) == got


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "touch", "remove"]), st.integers(0, 7),
                          st.integers(0, CLASSES - 1)), max_size=60))
def test_before_it_is_ready_the_order_is_exactly_lru(ops):
    lru, learned = EvictionOrder(), LearnedOrder(ReturnModel())
    nodes = [_node(i + 1, 0, 0) for i in range(8)]
    for clock, (op, i, cls) in enumerate(ops):
        n = nodes[i]
        n.last_access, n.rclass = clock, cls
        if op == "add":
            lru.add(n), learned.add(n)
        elif n in lru:
            getattr(lru, op)(n), getattr(learned, op)(n)
        assert list(learned) == list(lru) and len(learned) == len(lru)


def _serve(c, toks):
    m = c.match(toks, lock=True)
    pages = np.concatenate([m.device_pages, c.alloc_device(len(toks) // PT
                                                           - len(m.device_pages))])
    c.insert(toks, pages.astype(np.int64), after=m.lock)
    return m.device_len


def test_continuations_and_evicted_chains_count_as_returns():
    c = CacheController(PT, 16, 0, eviction="learned")
    model = c._learner.model
    turn1 = np.arange(2 * PT)
    _serve(c, turn1)
    first = c.match(turn1).last_node.rclass
    assert class_turn(first) == 0 and model.seen == 0
    turn2 = np.concatenate([turn1, 100 + np.arange(PT)])
    assert _serve(c, turn2) == 2 * PT
    assert model.seen == 1 and model.returns[first] == 1
    second = c.match(turn2).last_node.rclass
    assert class_turn(second) == 1 and second == request_class(1, 1)
    assert all(n.rclass == second for n in c.match(turn2).device_nodes)
    _serve(c, 1000 + np.arange(16 * PT))           # a one-off prompt evicts the conversation
    assert c.match(turn2).device_len == 0 and c._learner.ghosts
    turn3 = np.concatenate([turn2, 200 + np.arange(PT)])
    assert _serve(c, turn3) == 0                    # regrown: a return all the same (a ghost)
    assert model.seen == 2 and model.returns[second] == 1
    third = c.match(turn3).last_node.rclass
    assert third == request_class(2, 1)             # its own page only, not the regrown ones
    other = 5000 + np.arange(3 * PT)                # a first request: no return
    _serve(c, other)
    assert model.seen == 2 and class_turn(c.match(other).last_node.rclass) == 0
    c.check()


def test_an_insert_is_classed_by_the_tokens_it_decoded():
    c = CacheController(PT, 64, 0, eviction="learned")
    classes = []
    for i, decoded in enumerate((0, 40, 300, np.int64(300))):
        toks = 100 * i + np.arange(3 * PT)
        c.insert(toks, c.alloc_device(3), decoded=decoded)
        classes.append(c.match(toks).last_node.rclass)
    assert classes == [request_class(0, 3, n) for n in (0, 40, 300, 300)]
    assert len(set(classes)) == 2
    toks = 900 + np.arange(2 * PT)
    pages = c.alloc_device(2)
    for bad, what in ((-1, ">= 0"), (1.5, "float"), (True, "bool"), ("7", "str")):
        with pytest.raises(UsageError, match=f"decoded=.*{what}"):
            c.insert(toks, pages, decoded=bad)
    assert c.match(toks).device_len == 0            # refused: nothing cached, pages still held
    c.insert(toks, pages, decoded=5)
    assert c.match(toks).device_len == 2 * PT
    c.check()


def test_the_service_tells_the_controller_what_a_request_decoded(tmp_path):
    from hicache.service import HiCache
    from helpers import make_cfg, write_kv_rows
    cfg = make_cfg(tmp_path / "l3", eviction="learned")
    prompt = np.arange(2 * PT, dtype=np.int64)
    out = 1000 + np.arange(16 * PT + 1, dtype=np.int64)  # 65 decoded: 16 more whole pages
    with HiCache(cfg, mode="l1") as cache:
        cache.admit("a", prompt)
        cache.alloc("a", len(prompt) + len(out))
        write_kv_rows(cache, "a", len(prompt) + len(out))
        cache.finish("a", np.concatenate([prompt, out]))
        node = cache.ctrl.match(np.concatenate([prompt, out])).last_node
        assert node.rclass == request_class(0, 18, len(out)) != request_class(0, 18, 0)


def test_tenants_equal_pages_are_two_ghosts():
    """Two scopes' chains with equal tokens under one public page (which other tenants keep
    branching): the first tenant's evicted chain is not the second tenant's return."""
    from hicache.scope import Scope, scope_tag
    c = CacheController(PT, 32, 0, eviction="learned")
    model = c._learner.model
    sc = {n: Scope(scope_tag(n), 1) for n in (b"a", b"b", b"c", b"d")}
    toks = np.arange(4 * PT)                        # a public page, then 3 scoped ones

    def serve(t, name):
        s = sc.get(name)
        m = c.match(t, lock=True, scope=s)
        pages = np.concatenate([m.device_pages,
                                c.alloc_device(len(t) // PT - len(m.device_pages))])
        c.insert(t, pages.astype(np.int64), after=m.lock, scope=s)
    serve(toks, b"a")
    serve(np.concatenate([toks[:PT], 500 + np.arange(3 * PT)]), b"c")
    serve(np.concatenate([toks[:PT], 600 + np.arange(3 * PT)]), b"d")
    c.free_device(c.alloc_device(25))              # evicts tenant a's scoped pages only
    assert c.match(toks, scope=sc[b"a"]).device_len == PT and c._learner.ghosts
    seen = model.seen
    serve(toks, b"b")                               # the same tokens, another tenant
    assert model.seen == seen
    serve(np.concatenate([toks, 99 + np.arange(PT)]), b"a")  # tenant a comes back: counted
    assert model.seen == seen + 1
    c.check()


def _fresh_ids():
    """``ids(n)``: the next ``n`` hash ids never used before (from 1)."""
    nxt = itertools.count(1)
    return lambda n: [next(nxt) for _ in range(n)]


def _two_kinds_trace(path, steps=420):
    """Mooncake lines: each step a long one-off prompt (never continued) and, every third
    step, a new short chat; each chat comes back twice, 30 and 60 steps later, each time one
    block longer. Under LRU the one-offs push every chat out before it returns."""
    lines, ids, chats = [], _fresh_ids(), {}
    for s in range(steps):
        lines.append(ids(20))
        if s % 3 == 0:
            chats[s] = ids(2)
            lines.append(chats[s])
        for back in (30, 60):
            if s - back in chats:
                chats[s - back] = chats[s - back] + ids(1)
                lines.append(chats[s - back])
    out = []
    t = 0
    for h in lines:
        t += 500
        out.append({"timestamp": t, "input_length": 512 * len(h) - 100, "output_length": 64,
                    "hash_ids": h})
    path.write_text("\n".join(json.dumps(x) for x in out) + "\n")
    return path


def test_learned_beats_lru_when_some_requests_come_back_and_others_never(tmp_path):
    t = traces.load(_two_kinds_trace(tmp_path / "two.jsonl"), "mooncake", 16)
    got = {}
    for policy in ("lru", "learned"):
        got[policy] = replay(t, ReplaySettings(16, 300, eviction=policy), check=True)
    lru, learned = got["lru"].hit_tokens["l1"], got["learned"].hit_tokens["l1"]
    # 140 chats: a second turn hits 1 whole page, a third 2 (of 16 tokens); the order learns
    # the two kinds from its first 64 returns, so the chats before that are lost like LRU's
    most = 140 * 3 * 16
    assert lru < 0.1 * most and learned > 0.5 * most, (lru, learned)
    assert got["learned"].evictions["l1_pages"] > 0


def _answer_length_trace(path, steps=900):
    """Mooncake lines: each step a one-off prompt that is answered at length (never continued)
    and, every third step, a document answered in a few tokens, asked again 15 steps later
    (one block longer). Both first requests cache as many pages on their first turn (the
    one-off's answer fills its pages): only the length of the answer tells them apart."""
    lines, ids, docs = [], _fresh_ids(), {}
    for s in range(steps):
        lines.append((ids(6), 400))                 # (hash ids, output tokens at 16 a block)
        if s % 3 == 0:
            docs[s] = ids(31)
            lines.append((docs[s], 8))
        if s - 15 in docs:
            lines.append((docs.pop(s - 15) + ids(1), 8))
    path.write_text("".join(json.dumps({"timestamp": 10000 * i,
                                        "input_length": 512 * len(h) - 100,
                                        "output_length": 32 * n, "hash_ids": h}) + "\n"
                            for i, (h, n) in enumerate(lines)))
    return path


def test_learned_tells_requests_apart_by_the_length_of_their_answers(tmp_path):
    t = traces.load(_answer_length_trace(tmp_path / "answers.jsonl"), "mooncake", 16)
    got = {p: replay(t, ReplaySettings(16, 300, eviction=p), check=True).hit_tokens["l1"]
           for p in ("lru", "learned")}
    most = 300 * 30 * 16  # 300 documents asked again, 30 whole pages of 16 tokens each
    assert got["lru"] < 0.05 * most and got["learned"] > 0.5 * most, got


def test_the_replay_counts_decoded_tokens_as_finish_does(tmp_path):
    """A request answered in 64 tokens hands finish its prompt and the 63 it fed back (the
    last one never has KV): the replay classes it by 63, as HiCache.finish would."""
    from hicache.replay.sim import _Replay
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps({"timestamp": 0, "input_length": 512 * 3 - 100,
                             "output_length": 32 * 64, "hash_ids": [1, 2, 3]}) + "\n")
    t = traces.load(f, "mooncake", 16)
    rp = _Replay(t, ReplaySettings(16, 64, eviction="learned"))
    rp.admit(t.requests[0])
    rp.finish_until(float("inf"))
    prompt = t.requests[0].tokens()
    assert len(prompt) == 45 and t.requests[0].output_len == 64
    node = rp.ctrl.match(prompt).last_node
    assert node.rclass == request_class(0, (45 + 63) // 16, 63) != request_class(0, 6, 64)


def test_the_policy_file_names_learned():
    assert HiCacheConfig.from_dict({"policy": {"eviction": "learned"}}).policy.eviction \
        == "learned"


def test_decisions_do_not_depend_on_the_process_hash_seed(tmp_path):
    """Every DCP rank runs its own controller and must evict alike: two processes with
    different hash seeds replay the same trace to the same hits and evictions."""
    import os
    import subprocess
    import sys
    f = _two_kinds_trace(tmp_path / "two.jsonl", steps=200)
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "replay", str(f),
                            "--trace-format", "mooncake", "--block-tokens", "16",
                            "--page-tokens", "16", "--l1", str(300 * 16), "--eviction",
                            "learned", "--json", "--no-progress"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        outs.append((out["tiers"], out["evictions"]))
    assert outs[0] == outs[1] and outs[0][1]["l1_pages"] > 0
