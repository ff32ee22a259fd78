"""Seeded request traces for benchmarks: multi-turn chat, agentic long context, recorded JSONL.

Every generator is deterministic in its seed. ``scale`` shrinks lengths (linearly) and counts (by its square
root) together; 1.0 = full size. Token ids are drawn below ``vocab_size`` so they fit a small model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checks import check_int
from ..errors import ConfigError


SCALE_MAX = 4.0               # generated traces: scale in (0, SCALE_MAX]
SEED_MAX = (1 << 63) - 1      # seeds in [0, SEED_MAX]
MAX_TRACE_BYTES = 1 << 30     # a trace file is read up to this size, never past it
MAX_LINE_BYTES = 64 << 20     # one JSONL line
MAX_REQUEST_TOKENS = 1 << 24  # prompt length or output_len of one request


@dataclass(frozen=True, eq=False)
class Request:
    """One request: ``tokens`` int32 [prompt_len]; ``output_len`` tokens to generate.
    ``shared_len``: its leading tokens every session of the trace shares (a system prompt, a
    tool preamble); ``scope`` / ``public_tokens``: what the cache is told (``HiCache.admit``;
    the bench's ``--scope`` / ``--scopes`` / ``--public-prefix``)."""
    request_id: int
    session: int
    tokens: np.ndarray
    output_len: int
    arrival_index: int
    shared_len: int = 0
    scope: str | None = None
    public_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return int(len(self.tokens))


def _check(seed: int, scale: float, vocab_size: int) -> None:
    _check_seed(seed)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not (0 < scale <= SCALE_MAX):
        raise ConfigError(f"scale must be a number in (0, {SCALE_MAX:g}], got {scale!r}")
    check_int(vocab_size, "vocab_size", 2, error=ConfigError)


def _check_seed(seed: int) -> None:
    check_int(seed, "seed", 0, SEED_MAX, ConfigError)


def _n(base: float, scale: float, lo: int = 1) -> int:
    return max(lo, int(round(base * scale)))


def _count(base: float, scale: float, lo: int = 2) -> int:
    """Counts shrink with sqrt(scale), so small scales still give a useful number of requests."""
    return max(lo, int(round(base * math.sqrt(scale))))


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int,
                   hi: int) -> int:
    return int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), lo, hi))


def _interleave(rng: np.random.Generator, sessions: list[list[tuple[np.ndarray, int]]],
                shared_len: int = 0) -> list[Request]:
    """Merge per-session turn lists into one arrival order, keeping each session's order."""
    owners = np.concatenate([np.full(len(s), i) for i, s in enumerate(sessions)])
    rng.shuffle(owners)
    nxt = [0] * len(sessions)
    out = []
    for idx, sid in enumerate(owners.tolist()):
        toks, olen = sessions[sid][nxt[sid]]
        nxt[sid] += 1
        out.append(Request(idx, sid, toks, olen, idx, shared_len))
    return out


def _stream(seed: int, kind: int, scale: float, vocab_size: int):
    """A generator's checked arguments: its random stream (one per kind of trace) and a
    function drawing ``n`` token ids from it."""
    _check(seed, scale, vocab_size)
    rng = np.random.default_rng([seed, kind])
    return rng, lambda n: rng.integers(0, vocab_size, n, dtype=np.int32)


def chat_trace(seed: int = 0, scale: float = 1.0, vocab_size: int = 32000) -> list[Request]:
    """Multi-turn chat: users share one system prompt; each turn's prompt is the previous
    prompt + the previous output + a new user message, so histories grow turn by turn."""
    rng, tok = _stream(seed, 1, scale, vocab_size)
    system = tok(_n(2048, scale, 8))
    users = _count(64, scale)
    sessions = []
    for _ in range(users):
        turns = int(rng.integers(2, 9))
        prompt = system
        out_prev = None
        items = []
        for _t in range(turns):
            msg = tok(_lognormal_int(rng, 300 * scale, 0.6, 4, int(4000 * scale) + 4))
            parts = [prompt] + ([out_prev] if out_prev is not None else []) + [msg]
            prompt = np.concatenate(parts)
            olen = _lognormal_int(rng, 250 * scale, 0.5, 1, int(2000 * scale) + 1)
            items.append((prompt, olen))
            out_prev = tok(olen)
        sessions.append(items)
    return _interleave(rng, sessions, len(system))


def agentic_trace(seed: int = 0, scale: float = 1.0, vocab_size: int = 32000) -> list[Request]:
    """Agentic long context: bimodal first prompts (about half >= 64K tokens at scale 1, up to
    1M), outputs median ~400, each agent step re-sends the whole context + output + a tool
    result (heavy prefix reuse within a session); sessions share a tool/system preamble."""
    rng, tok = _stream(seed, 2, scale, vocab_size)
    preamble = tok(_n(4096, scale, 8))
    n_sessions = _count(32, scale)
    sessions = []
    for _ in range(n_sessions):
        if rng.random() < 0.5:
            first = math.exp(rng.uniform(math.log(64_000), math.log(400_000)))
        else:
            first = math.exp(rng.uniform(math.log(4_000), math.log(60_000)))
        ctx = np.concatenate([preamble, tok(max(1, int(first * scale) - len(preamble)))])
        steps = int(rng.integers(3, 9))
        items = []
        for _s in range(steps):
            olen = _lognormal_int(rng, 400 * scale, 0.6, 1, int(8000 * scale) + 1)
            items.append((ctx, olen))
            tool = tok(_lognormal_int(rng, 1500 * scale, 0.8, 1, int(20000 * scale) + 1))
            ctx = np.concatenate([ctx, tok(olen), tool])
            if len(ctx) > 1_000_000 * scale:
                break
        sessions.append(items)
    return _interleave(rng, sessions, len(preamble))


def load_trace(path: str | Path, vocab_size: int = 32000, seed: int = 0) -> list[Request]:
    """Requests from JSONL: ``{"tokens": [...], "output_len"?, "session"?}`` lines, or
    ``{"length": n, "prefix_id": s, "prefix_len": k, "output_len": m}`` lines (the first k
    tokens are shared by every line with the same prefix_id; the rest are unique)."""
    check_int(vocab_size, "vocab_size", 2, error=ConfigError)
    _check_seed(seed)
    from ..config import read_regular_file
    p = Path(path)
    try:
        data = read_regular_file(p, "a trace", MAX_TRACE_BYTES)
    except OSError as e:
        raise ConfigError(f"cannot read trace {p}: {e.strerror or e}") from None
    prefixes: dict[str, np.ndarray] = {}
    rng = np.random.default_rng([seed, 3])
    out: list[Request] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{p}:{lineno}"
        obj = _trace_object(raw, where)
        if obj is None:
            continue
        olen = _int_field(obj, "output_len", where, default=1, lo=0, hi=MAX_REQUEST_TOKENS)
        session = _int_field(obj, "session", where, default=len(out), lo=0, hi=SEED_MAX)
        shared = 0
        if "tokens" in obj:
            arr = _given_tokens(obj["tokens"], where, vocab_size)
        elif "length" in obj:
            arr = _made_tokens(obj, where, vocab_size, seed, prefixes, rng)
            shared = min(int(obj.get("prefix_len", 0) or 0), len(arr))
        else:
            raise ConfigError(f"{where}: a line needs 'tokens' or 'length' "
                              f"(got keys {sorted(obj)})")
        out.append(Request(len(out), session, arr, olen, len(out), shared))
    if not out:
        raise ConfigError(f"{p}: the trace has no requests")
    return out


def _trace_object(raw: bytes, where: str) -> dict | None:
    """One trace line as its JSON object (None for a blank line)."""
    if len(raw) > MAX_LINE_BYTES:
        raise ConfigError(f"{where}: line is {len(raw)} bytes; the limit is {MAX_LINE_BYTES}")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start} of the line); a trace "
                          "is UTF-8 JSON Lines") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _given_tokens(toks, where: str, vocab_size: int) -> np.ndarray:
    """A line's ``tokens`` list, checked (int32 array)."""
    if (not isinstance(toks, list) or not toks
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks)):
        raise ConfigError(f"{where}: 'tokens' must be a non-empty list of ints")
    if len(toks) > MAX_REQUEST_TOKENS:
        raise ConfigError(f"{where}: 'tokens' has {len(toks)} ids; the limit is "
                          f"{MAX_REQUEST_TOKENS}")
    bad = next((i for i, t in enumerate(toks) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"{where}: 'tokens'[{bad}] = {toks[bad]} is outside the "
                          f"vocabulary [0, {vocab_size}) (model.vocab_size)")
    return np.asarray(toks, dtype=np.int32)


def _made_tokens(obj: dict, where: str, vocab_size: int, seed: int,
                 prefixes: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """A ``length`` line's tokens: its shared prefix (``prefixes``, extended as needed) then
    unique tokens from ``rng``."""
    n = _int_field(obj, "length", where, lo=1, hi=MAX_REQUEST_TOKENS)
    k = _int_field(obj, "prefix_len", where, default=0, lo=0, hi=MAX_REQUEST_TOKENS)
    if k > n:
        raise ConfigError(f"{where}: prefix_len {k} exceeds length {n}")
    pid = obj.get("prefix_id", None)
    if k and pid is None:
        raise ConfigError(f"{where}: prefix_len given without prefix_id")
    pre = np.empty(0, np.int32)
    if k:
        key = json.dumps(pid)
        have = prefixes.get(key, np.empty(0, np.int32))
        if len(have) < k:  # extend the shared prefix stream deterministically
            ext = np.random.default_rng([seed, 4, len(prefixes) if key not in prefixes
                                         else list(prefixes).index(key), len(have)])
            have = np.concatenate([have, ext.integers(0, vocab_size, k - len(have),
                                                      dtype=np.int32)])
            prefixes[key] = have
        pre = have[:k]
    return np.concatenate([pre, rng.integers(0, vocab_size, n - k, dtype=np.int32)])


def _int_field(obj: dict, name: str, where: str, default: int | None = None, lo: int = 0,
               hi: int = SEED_MAX) -> int:
    if name not in obj:
        if default is None:
            raise ConfigError(f"{where}: missing '{name}'")
        return default
    return check_int(obj[name], f"{where}: '{name}'", lo, hi, ConfigError)


def trace_summary(reqs: list[Request]) -> dict:
    lens = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    return {"requests": len(reqs), "sessions": len({r.session for r in reqs}),
            "prompt_tokens": int(lens.sum()), "prompt_p50": float(np.median(lens)),
            "prompt_max": int(lens.max()), "output_p50": float(np.median(outs))}
