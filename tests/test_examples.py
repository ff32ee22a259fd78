"""The README's engine loop runs, hits the cache, and decodes what the dense model decodes."""

import importlib.util
from pathlib import Path

import numpy as np

from hicache import load_config
from hicache.engine.model import MLAModel
from hicache.serving import model_config

ROOT = Path(__file__).resolve().parents[1]


def _run_engine_loop(monkeypatch, **kw) -> list[list[int]]:
    """examples/engine_loop.py's main(**kw); its outputs checked against plain generation."""
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("engine_loop", ROOT / "examples/engine_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    outputs = mod.main(**kw)
    cfg = load_config(ROOT / "examples/policy.toml")
    model = MLAModel(model_config(cfg))
    system = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 200)
    for rid, out in enumerate(outputs):
        question = np.random.default_rng(rid + 1).integers(0, cfg.model.vocab_size, 40)
        assert out == model.generate(np.concatenate([system, question]).tolist(), 8)
    return outputs


def test_engine_loop_example(capsys, monkeypatch):
    _run_engine_loop(monkeypatch)
    text = capsys.readouterr().out
    assert "request 1: reused 192 of 240" in text and "request 2: reused 192 of 240" in text


def test_engine_loop_example_speculative(capsys, monkeypatch):
    # the speculative variant: a draft proposes 3 tokens per target step; the cache keeps the
    # draft's KV beside the target's, so the hits of requests 1 and 2 bring it back too
    _run_engine_loop(monkeypatch, spec=True)
    text = capsys.readouterr().out
    assert "request 1: reused 192 of 240" in text and "draft KV reused 192" in text
    assert "'draft_recomputed_tokens': 0" in text and "'acceptance_rate': 1.0" in text
