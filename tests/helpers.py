"""Configs the tests share: one tiny model (2 layers, latent 32 + rope 8), as a ``HiCacheConfig``
(:func:`make_cfg`) or as policy-file text (:func:`policy_toml`), so a key that changes changes
in one place."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

from hicache.config import HiCacheConfig, route_l3_keys

TINY_MODEL = {"num_layers": 2, "kv_lora_rank": 32, "rope_dim": 8, "hidden_size": 64,
              "num_heads": 4, "vocab_size": 128}


def tiny_sections(l3_path=None, *, dcp: int | None = None, page_size: int = 4, l1_pages: int = 24,
                  l2_ratio: float | None = None, model: dict | None = None,
                  l3: dict | None = None, policy: dict | None = None) -> dict:
    """The policy file of the tiny model as a dict: L3 on at ``l3_path`` (when given); sections
    left at their defaults are left out."""
    d: dict = {"model": {**TINY_MODEL, **(model or {})}}
    if dcp is not None:
        d["parallel"] = {"tp": dcp, "dcp": dcp}
    d["cache"] = {"page_size": page_size}
    d["l1"] = {"num_pages": l1_pages}
    if l2_ratio is not None:
        d["l2"] = {"ratio": l2_ratio}
    if l3_path is not None:  # flat backend keys go into their [l3.<backend>] table
        d["l3"] = route_l3_keys({"enabled": True, "path": str(l3_path), **(l3 or {})})
    if policy:
        d["policy"] = dict(policy)
    return d


def make_cfg(l3_path, dcp: int = 1, l1_pages: int = 24, l2_ratio: float = 2.0,
             signature: str = "test-weights", l3: dict | None = None, **policy) -> HiCacheConfig:
    """The service tests' config: 4-token pages, L3 (64 MiB) at ``l3_path``; what the tests
    count must not depend on this machine's measured speeds, so ``l3_cost_model`` is off unless
    given."""
    return HiCacheConfig.from_dict(tiny_sections(
        Path(l3_path), dcp=dcp, l1_pages=l1_pages, l2_ratio=l2_ratio,
        model={"signature": signature}, l3={"size_bytes": 64 << 20, **(l3 or {})},
        policy={"l3_cost_model": False, **policy}))


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string


def policy_toml(l3_path=None, **kw) -> str:
    """:func:`tiny_sections` as policy-file (TOML) text."""
    lines = []
    for section, values in tiny_sections(l3_path, **kw).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for sub, table in values.items():  # [l3.lmdb] and the like
            if isinstance(table, dict):
                lines.append(f"[{section}.{sub}]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def admit_ready(cache, request_id, prompt, alloc: bool = True):
    """Admit ``prompt``, step until its prefix is ready (the L3 lookup agreed) and, with
    ``alloc``, allocate room for the whole prompt; the ``Prefix``."""
    p = cache.admit(request_id, prompt)
    while not p.ready:
        cache.step()
    if alloc:
        cache.alloc(request_id, len(prompt))
        write_kv_rows(cache, request_id, len(prompt))
    return p


def write_kv_rows(cache, request_id, end: int, start: int | None = None, seed: int = 0):
    """Write KV rows (every layer, seeded random) for positions [start, end) of an admitted
    request (start: its hit), as an engine would before ``finish`` caches them."""
    import torch
    from hicache.kvport import RowWrite
    p = cache.prefix(request_id)
    start = p.hit_len if start is None else start
    if end <= start:
        return
    kv = cache.kv
    w = RowWrite.for_positions(kv.layout, torch.tensor(p.page_table, device=kv.device),
                               p.page_table, start, end)
    g = torch.Generator().manual_seed(seed)
    for layer in range(kv.num_layers):
        kv.write(layer, w, torch.randn(end - start, kv.kv_dim, generator=g).to(kv.dtype))


@contextmanager
def l3_writes_land_at_once():
    """Each L3 write-back submission is stored before the step that made it returns. A test
    that counts L3 hits on a revisit must not race the background writer, which on a loaded
    machine can lag several requests behind (the hit is then a correct, but uncounted, miss)."""
    from hicache.l3.prefetch import AsyncWriter
    real = AsyncWriter.submit

    def submit(self, keys, shards):
        done = real(self, keys, shards)
        done.result(60)
        return done

    with patch.object(AsyncWriter, "submit", submit):
        yield


def secret_file(directory, name: str = "fleet") -> str:
    """A fleet secret file (mode 600) for an authenticated L3: the same ``name`` gives the same
    secret."""
    import hashlib
    import os
    path = Path(directory) / f"{name}.secret"
    path.write_text(hashlib.sha256(name.encode()).hexdigest())
    os.chmod(path, 0o600)
    return str(path)


class _Held:
    """``store.<method>`` (one store object) held on an event: ``entered`` once a call started,
    ``returned`` once one ended, ``keys`` the keys it was given. ``release`` lets them through
    (a bound of ``limit_s`` keeps a wrong, synchronous caller from hanging: it then sees
    ``returned``)."""

    method = ""

    def __init__(self, store, limit_s: float = 60.0) -> None:
        import threading
        self.entered, self.release, self.returned = (threading.Event() for _ in range(3))
        self.keys: list = []
        real = getattr(store, self.method)

        def held(keys, arg):
            self.keys += list(keys)
            self.entered.set()
            self.release.wait(limit_s)
            try:
                return real(keys, arg)
            finally:
                self.returned.set()

        setattr(store, self.method, held)


class BlockedPuts(_Held):
    """``store.put`` held (``_Held``)."""
    method = "put"


class BlockedGets(_Held):
    """``store.get`` held (``_Held``)."""
    method = "get"


def admit_gated(cache, gate, seen: list) -> None:
    """``cache``'s next ``admit`` only: ``seen`` gets whether it returned while ``gate``'s get
    was held (started, not ended) with its prefix not ready, then the gate is released."""
    real = cache.admit

    def admit(request_id, tokens):
        prefix = real(request_id, tokens)
        seen.append(gate.entered.wait(60) and not gate.returned.is_set() and not prefix.ready)
        gate.release.set()
        cache.admit = real
        return prefix

    cache.admit = admit
