"""Seeded workload generators and the JSONL trace loader."""

import json
import os

import numpy as np
import pytest

from hicache.errors import ConfigError
from hicache.workloads import agentic_trace, chat_trace, load_trace, trace_summary


def _same(a, b):
    return len(a) == len(b) and all(
        x.session == y.session and x.output_len == y.output_len
        and np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))


def test_chat_is_seeded_and_grows_turn_by_turn():
    a, b, c = chat_trace(3, 0.1), chat_trace(3, 0.1), chat_trace(4, 0.1)
    assert _same(a, b) and not _same(a, c)
    assert [r.request_id for r in a] == list(range(len(a)))
    by_session = {}
    for r in a:
        by_session.setdefault(r.session, []).append(r)
    first = [s[0].tokens for s in by_session.values()]
    sys_len = min(len(t) for t in first)
    common = min(int(np.argmax(x[:sys_len] != first[0][:sys_len])) or sys_len for x in first)
    assert common >= 8, "users share a system prompt"
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            # next prompt = previous prompt + previous output + a new user message
            assert np.array_equal(cur.tokens[:prev.prompt_len], prev.tokens)
            assert cur.prompt_len > prev.prompt_len + prev.output_len
    for r in a:
        assert r.tokens.dtype == np.int32 and r.tokens.max() < 32000 and r.tokens.min() >= 0


def test_agentic_shape_at_full_scale():
    reqs = agentic_trace(0, 1.0, vocab_size=1000)
    lens = np.array([r.prompt_len for r in reqs])
    frac_long = np.mean(lens >= 64_000)
    assert 0.35 <= frac_long <= 0.75, frac_long
    assert lens.max() <= 1_000_000
    assert 250 <= np.median([r.output_len for r in reqs]) <= 600
    assert max(r.tokens.max() for r in reqs) < 1000
    sessions = {}
    for r in reqs:
        sessions.setdefault(r.session, []).append(r)
    reused = sum(min(p.prompt_len, c.prompt_len) for s in sessions.values()
                 for p, c in zip(s, s[1:]) if np.array_equal(c.tokens[:p.prompt_len], p.tokens))
    assert reused > 0.5 * lens.sum(), "heavy prefix reuse within a session"


def test_scale_shrinks_lengths_and_counts():
    small, big = trace_summary(agentic_trace(1, 0.05)), trace_summary(agentic_trace(1, 0.5))
    assert small["prompt_tokens"] < big["prompt_tokens"] / 5
    assert small["sessions"] < big["sessions"]
    assert trace_summary(chat_trace(1, 0.05))["requests"] < trace_summary(chat_trace(1, 1.0))[
        "requests"]


def test_generator_argument_errors():
    for bad in (dict(scale=0), dict(scale=-1.0), dict(scale="1"), dict(vocab_size=1),
                dict(seed=1.5)):
        with pytest.raises(ConfigError):
            chat_trace(**{"seed": 0, **bad})


def test_load_trace_both_formats(tmp_path):
    p = tmp_path / "t.jsonl"
    lines = [{"tokens": [1, 2, 3], "output_len": 4, "session": 9},
             {"length": 20, "prefix_id": "sys", "prefix_len": 8, "output_len": 5},
             {"length": 30, "prefix_id": "sys", "prefix_len": 12, "output_len": 6},
             {"length": 10, "prefix_id": 7, "prefix_len": 4, "output_len": 1}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = load_trace(p, vocab_size=100)
    assert [r.prompt_len for r in reqs] == [3, 20, 30, 10]
    assert reqs[0].session == 9 and reqs[0].output_len == 4
    assert np.array_equal(reqs[1].tokens[:8], reqs[2].tokens[:8])
    assert not np.array_equal(reqs[3].tokens[:4], reqs[1].tokens[:4])
    assert all(r.tokens.max() < 100 for r in reqs)
    assert _same(reqs, load_trace(p, vocab_size=100))


@pytest.mark.parametrize("line,msg", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"tokens": []}', "non-empty list of ints"),
    ('{"tokens": [1, "a"]}', "non-empty list of ints"),
    ('{"tokens": [1, 500]}', r"'tokens'\[1\] = 500 is outside the vocabulary"),
    ('{"tokens": [1, 100000000000000000000000]}', r"'tokens'\[1\] = 1000.* is outside"),
    ('{"length": 0}', r"'length' must be an int in \[1, "),
    ('{"length": 100000000000}', r"'length' must be an int in \[1, 16777216\]"),
    ('{"length": 1e11}', r"'length' must be an int"),
    ('{"length": 5, "prefix_len": 9, "prefix_id": 1}', "exceeds length"),
    ('{"length": 5, "prefix_len": 2}', "without prefix_id"),
    ('{"length": 5, "output_len": -1}', "'output_len'"),
    ('{"foo": 1}', "needs 'tokens' or 'length'"),
])
def test_load_trace_bad_lines(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"tokens": [1]}\n' + line + "\n")
    with pytest.raises(ConfigError, match=msg) as e:
        load_trace(p, vocab_size=100)
    assert ":2:" in str(e.value)


def test_load_trace_bounded_regular_utf8(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"tokens": [1]}\n{"session": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.jsonl:2: not UTF-8"):
        load_trace(latin)
    with pytest.raises(ConfigError, match="must be a regular file, but this is a device"):
        load_trace("/dev/zero")
    with pytest.raises(ConfigError, match="this is a directory"):
        load_trace(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes: opening it must not block
    with pytest.raises(ConfigError, match="this is a FIFO"):
        load_trace(fifo)


def test_load_trace_missing_and_empty(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")
