"""What ``HiCache.finish`` refuses (``hicache.service``), checked before anything changes."""

from __future__ import annotations

import numpy as np

from hicache.errors import UsageError
from hicache.kvport import span_slots

from .request import Request

__all__ = ["check_finish"]


def check_finish(request_id, req: Request, arr: np.ndarray, handed: dict, *, kv,
                 companions, host, stopped: bool) -> dict:
    """The companions' values by name; UsageError (the request stays admitted, nothing
    changed) unless ``arr`` may be cached for the request: it starts with the admitted
    prompt, has no negative id, and every token past the hit that has a page has KV
    written at every layer (tokens past the page table have nowhere to be and are never
    cached) (``CheckedPort.unwritten``): a page is never cached with rows nobody wrote;
    each companion checks its value the same way. A stopped cache caches nothing: only
    the prompt is checked then."""
    values = {c.name: handed.pop(c.finish_arg, None) for c in companions}
    extra = [k for k, v in handed.items() if v is not None and v != 0 and v != {}]
    if extra:
        raise UsageError(f"finish of request {request_id!r}: {extra[0]}= is no companion's "
                         "value here (this cache keeps none that takes it)")
    n = min(arr.size, req.tokens.size)
    if not np.array_equal(arr[:n], req.tokens[:n]):
        bad = int(np.flatnonzero(arr[:n] != req.tokens[:n])[0])
        raise UsageError(f"finish of request {request_id!r}: token {bad} is {int(arr[bad])} "
                         f"but the admitted prompt has {int(req.tokens[bad])} there")
    if arr.size and arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise UsageError(f"finish of request {request_id!r}: token {bad} is {int(arr[bad])};"
                         " token ids are non-negative")
    w, table = host.page_tokens, req.prefix.page_table
    if not stopped:
        whole = min(arr.size // w, len(table)) * w
        for c in companions:
            c.check_finish(host, req, arr, whole, values[c.name])
    start, end = req.prefix.hit_len, min(int(arr.size), len(table) * w)  # past: no page
    if stopped or end <= start:
        return values
    slots = span_slots(table[start // w:], start, end, w)
    first = kv.unwritten(slots)
    if first >= 0:
        raise UsageError(
            f"finish of request {request_id!r}: token {start + first} of {arr.size} has no "
            "KV written at every layer; pass only the tokens whose KV the engine wrote "
            f"(the first {start + first} here)")
    return values
