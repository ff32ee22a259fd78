"""Production traces: Mooncake FAST'25 and Qwen-Bailian ``hash_ids`` JSON lines, and hicache's own.

A hash-id trace names each prompt by the ids of its blocks (512 tokens for Mooncake, 16 for
Bailian); equal ids at equal positions mean equal content. Tokens are made from the ids
deterministically: a block's tokens depend on its id only, so equal hash chains are equal token
prefixes, and the first tokens of a block spell its id (in base ``vocab``; as ``id * block +
position`` with no vocabulary), so blocks with different ids always differ. ``block_tokens``
rescales every block (a 512-token block becomes ``block_tokens`` tokens; prompt and output
lengths scale with it), so a production trace's structure fits a small model.

Records stay compact (ids and lengths, never a whole trace's tokens): ``TraceRequest.tokens``
makes one prompt's tokens when it is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..checks import check_int
from ..errors import ConfigError
from ..ids import TOKEN_MAX
from . import MAX_REQUEST_TOKENS, MAX_TRACE_BYTES, load_trace

FORMATS = ("mooncake", "bailian", "hicache")
NATIVE_BLOCK = {"mooncake": 512, "bailian": 16}  # tokens per hash id, as each trace was made
MAX_HASH_ID = (1 << 40) - 1
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request of a trace. ``hash_ids``: int64 block ids (None for a token trace, whose
    ``prompt`` holds its tokens); ``prompt_len`` / ``output_len`` in tokens (already scaled);
    ``arrival_s``: seconds from the trace's start; ``session``: the conversation it belongs to
    (Bailian ``chat_id`` chains; else its own index)."""
    index: int
    hash_ids: np.ndarray | None
    prompt_len: int
    output_len: int
    arrival_s: float
    session: int
    block_tokens: int
    prompt: np.ndarray | None = None
    vocab: int | None = None  # the trace's: where ``id * block + position`` would not fit int32

    def tokens(self, vocab: int | None = None) -> np.ndarray:
        """The prompt's token ids (int64; below ``vocab`` when given, else below the trace's
        own, else ``id * block + position``: always within int32, the cache's token ids)."""
        if self.prompt is not None:
            return self.prompt.astype(np.int64, copy=False)
        return block_tokens(self.hash_ids, self.block_tokens,
                            self.vocab if vocab is None else vocab)[:self.prompt_len]


def block_tokens(ids: np.ndarray, block: int, vocab: int | None = None) -> np.ndarray:
    """Tokens of consecutive blocks with ids ``ids`` (int64 [len(ids) * block]). Without
    ``vocab``: ``id * block + position`` (injective). With it: the id's digits in base
    ``vocab`` first, then a mix of id and position, all below ``vocab``."""
    ids = np.asarray(ids, np.int64)
    pos = np.arange(block, dtype=np.int64)
    if vocab is None:
        return (ids[:, None] * block + pos[None, :]).reshape(-1)
    u = ids.astype(np.uint64)[:, None]
    with np.errstate(over="ignore"):
        mixed = (u + np.uint64(1)) * _MIX ^ (pos.astype(np.uint64)[None, :] + np.uint64(1)) * _MIX
        mixed ^= mixed >> np.uint64(29)
        mixed *= _MIX
    out = (mixed % np.uint64(vocab)).astype(np.int64)
    digits = id_digits(MAX_HASH_ID, vocab)  # the same for every request (low digits first)
    rem = ids.copy()
    for d in range(min(digits, block)):
        out[:, d] = rem % vocab
        rem //= vocab
    return out.reshape(-1)


def id_digits(max_id: int, vocab: int) -> int:
    """Base-``vocab`` digits needed to spell ids up to ``max_id``."""
    d = 1
    while vocab ** d <= max_id:
        d += 1
    return d


@dataclass(frozen=True)
class Trace:
    """A parsed trace: its requests in arrival order and what they were read as."""
    path: str
    format: str
    block_tokens: int
    native_block: int
    requests: list[TraceRequest]

    def unique_blocks(self) -> int:
        ids = [r.hash_ids for r in self.requests if r.hash_ids is not None]
        return int(len(np.unique(np.concatenate(ids)))) if ids else 0


def load(path: str | Path, fmt: str, block: int | None = None, *,
         max_requests: int | None = None, vocab: int = 32000, seed: int = 0) -> Trace:
    """Read a trace file of format ``fmt`` (one of ``FORMATS``); ``block``: tokens per hash id
    (default: the format's own). ConfigError naming the file and line for a bad record."""
    if fmt not in FORMATS:
        raise ConfigError(f"--trace-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if max_requests is not None:
        check_int(max_requests, "--max-requests", 1, error=ConfigError)
    if fmt == "hicache":
        return _token_trace(path, block, max_requests, vocab, seed)
    native = NATIVE_BLOCK[fmt]
    block = native if block is None else check_int(block, "--block-tokens", 1, 1 << 16,
                                                   ConfigError)
    from ..config import read_regular_file
    p = Path(path)
    try:
        data = read_regular_file(p, "a trace", MAX_TRACE_BYTES)
    except OSError as e:
        raise ConfigError(f"cannot read trace {p}: {e.strerror or e}") from None
    reqs: list[TraceRequest] = []
    chats: dict[int, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if max_requests is not None and len(reqs) >= max_requests:
            break
        if not raw.strip():
            continue
        reqs.append(_record(raw, f"{p}:{lineno}", fmt, native, block, len(reqs), chats))
    if not reqs:
        raise ConfigError(f"{p}: the trace has no requests")
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))  # stable by time
    if order != list(range(len(reqs))):
        reqs = [reqs[i] for i in order]
    ids = [r.hash_ids for r in reqs if len(r.hash_ids)]
    top = max(int(i.max()) for i in ids) if ids else 0
    if (top + 1) * block > TOKEN_MAX:  # the whole trace maps its blocks the other way
        reqs = [replace(r, vocab=TOKEN_MAX) for r in reqs]
    return Trace(str(p), fmt, block, native, reqs)


def _record(raw: bytes, where: str, fmt: str, native: int, block: int, index: int,
            chats: dict[int, int]) -> TraceRequest:
    """One hash-id line as a request (ConfigError naming ``where`` otherwise)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    need = ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [k for k in need if k not in obj]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    n_in = check_int(obj["input_length"], f"{where}: 'input_length'", 1, MAX_REQUEST_TOKENS,
                     ConfigError)
    n_out = check_int(obj["output_length"], f"{where}: 'output_length'", 0, MAX_REQUEST_TOKENS,
                      ConfigError)
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 1e12:
        raise ConfigError(f"{where}: 'timestamp' must be a number >= 0, got {ts!r}")
    ids = obj["hash_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(type(h) is int and 0 <= h <= MAX_HASH_ID for h in ids)):
        raise ConfigError(f"{where}: 'hash_ids' must be a non-empty list of ints in "
                          f"[0, {MAX_HASH_ID}]")
    if not (len(ids) - 1) * native < n_in <= len(ids) * native:
        raise ConfigError(f"{where}: input_length {n_in} does not fit {len(ids)} hash ids of "
                          f"{native} tokens")
    session = index
    if fmt == "bailian":
        session = _session(obj, where, index, chats)
    scale = block / native
    prompt = min(len(ids) * block, max((len(ids) - 1) * block + 1, round(n_in * scale)))
    out = max(1, round(n_out * scale)) if n_out else 0
    arrival = ts / 1000.0 if fmt == "mooncake" else float(ts)
    return TraceRequest(index, np.asarray(ids, np.int64), prompt, out, arrival, session, block)


def _session(obj: dict, where: str, index: int, chats: dict[int, int]) -> int:
    """A Bailian request's conversation: its parent's, or a new one (``chats``: chat id ->
    session)."""
    cid = check_int(obj.get("chat_id", index), f"{where}: 'chat_id'", -1, 1 << 62, ConfigError)
    parent = check_int(obj.get("parent_chat_id", -1), f"{where}: 'parent_chat_id'", -1,
                       1 << 62, ConfigError)
    for k in ("turn",):
        if k in obj:
            check_int(obj[k], f"{where}: '{k}'", 0, 1 << 30, ConfigError)
    if "type" in obj and not isinstance(obj["type"], str):
        raise ConfigError(f"{where}: 'type' must be a string, got {obj['type']!r}")
    session = chats.get(parent, len(chats)) if parent >= 0 else len(chats)
    chats[cid] = session
    return session


def _token_trace(path, block, max_requests, vocab: int, seed: int) -> Trace:
    """hicache's own JSONL (``workloads.load_trace``), arrivals one second apart."""
    if block is not None:
        raise ConfigError("--block-tokens applies to hash-id traces (mooncake, bailian), "
                          "not to --trace-format hicache")
    reqs = load_trace(path, vocab_size=vocab, seed=seed)
    if max_requests is not None:
        reqs = reqs[:max_requests]
    out = [TraceRequest(i, None, r.prompt_len, r.output_len, float(i), r.session, 1,
                        r.tokens.astype(np.int64)) for i, r in enumerate(reqs)]
    return Trace(str(path), "hicache", 1, 1, out)


def as_requests(trace: Trace, vocab: int | None) -> list:
    """The trace as the benches' jobs (``workloads.Request``, tokens below ``vocab``; None:
    the trace's own, within int32), in arrival order."""
    from . import Request
    out = []
    for i, r in enumerate(trace.requests):
        toks = r.tokens(vocab)
        out.append(Request(i, r.session, toks.astype(np.int32), max(r.output_len, 1), i))
    return out
