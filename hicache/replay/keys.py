"""Page chain keys (one int per whole page, naming the page and everything before it) and the
tokens a request decodes in the replay.

A decoded token is not known without a model; what matters to the cache is which decoded pages
equal which: greedy decoding after equal prompts gives equal tokens, after different prompts
different ones. ``Fillers`` gives each distinct prompt its own run of ids, negative (prompt ids
are not), within int32 as every token id the cache keeps.
"""

from __future__ import annotations

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)


def page_keys(tokens: np.ndarray, page_tokens: int) -> list[int]:
    """One key per whole page of ``tokens``: a hash of the page's tokens and the key before it
    (equal keys: equal prefixes, within one process)."""
    raw = np.ascontiguousarray(tokens, np.int64).tobytes()
    w = page_tokens * 8
    out, h = [], 0
    for a in range(0, len(raw) // w * w, w):
        h = hash((h, raw[a:a + w]))
        out.append(h)
    return out


class Fillers:
    """Decoded tokens per distinct prompt (the same prompt: the same tokens)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def tokens(self, prompt: np.ndarray, keys: list[int], page_tokens: int,
               n: int) -> np.ndarray:
        """``n`` decoded ids for ``prompt`` (whose whole-page keys are ``keys``): a mix of the
        prompt's number and the position, 31 bits of it, negated (a page of one prompt's
        equals a page of another's with odds 2**-31 per token)."""
        if n <= 0:
            return np.zeros(0, np.int64)
        tail = prompt[len(keys) * page_tokens:]
        name = (keys[-1] if keys else 0, len(prompt), tail.tobytes())
        k = np.uint64(self._ids.setdefault(name, len(self._ids)) + 1)
        with np.errstate(over="ignore"):
            x = k * _MIX ^ (np.arange(1, n + 1, dtype=np.uint64) * _MIX)
            x ^= x >> np.uint64(29)
            x *= _MIX
        return -1 - (x >> np.uint64(33)).astype(np.int64)
