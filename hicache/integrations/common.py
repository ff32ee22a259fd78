"""What both engine adapters share: engine keys -> store keys, the weights signature, opening
one store per shard. Imports no engine."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Iterable

from ..l3 import L3Error, L3Store, Namespace, keys_for_rank, open_store
from ..l3.keys import DIGEST_BYTES

log = logging.getLogger(__name__)

# Files whose bytes are the weights (the rest of a checkpoint directory is metadata).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_META_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_SAMPLES = 8  # sampled windows per weight file
_WINDOW = 64 << 10


def engine_chain(engine_key: bytes | str) -> bytes:
    """The 16-byte chain part of a store key from an engine's own page/block hash (an engine
    key already covers the whole prefix, as hicache's chain hash does)."""
    if isinstance(engine_key, str):
        engine_key = engine_key.encode()
    if not isinstance(engine_key, (bytes, bytearray)) or not engine_key:
        raise L3Error(f"an engine key must be non-empty bytes or str, got {engine_key!r:.60}")
    return hashlib.blake2b(bytes(engine_key), digest_size=DIGEST_BYTES,
                           person=b"hicache-engine").digest()


def store_keys(engine_keys: Iterable[bytes | str], namespace: Namespace, rank: int) -> list[bytes]:
    """Store keys of one shard (``rank``) for the engine's keys, in order."""
    return keys_for_rank([engine_chain(k) for k in engine_keys], namespace, rank)


def weights_signature(model: str, override: str | None = None) -> str:
    """A signature of the weights a model name stands for.

    ``override`` (a revision, a checksum, ...) wins. For a local checkpoint directory: a hash of
    its config files and, for every weight file, its name, size and sampled content windows (a
    fine-tune of the same shapes differs in every window). For a hub id nothing local pins the
    weights: the id is used and a warning asks for ``weights_signature``.
    """
    if override:
        return str(override)
    if not isinstance(model, str) or not model:
        raise L3Error(f"model must be a non-empty str, got {model!r}")
    if not os.path.isdir(model):
        log.warning("hicache: model %r is not a local directory, so the L3 namespace cannot pin "
                    "its weights; pass weights_signature (e.g. the revision) so a store written "
                    "with other weights never hits", model)
        return f"id:{model}"
    h = hashlib.blake2b(digest_size=16, person=b"hicache-weights")
    names = sorted(os.listdir(model))
    for name in names:
        path = os.path.join(model, name)
        if name in _META_FILES and os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    found = False
    for name in names:
        path = os.path.join(model, name)
        if not name.endswith(_WEIGHT_SUFFIXES) or not os.path.isfile(path):
            continue
        found = True
        size = os.path.getsize(path)
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(size - _WINDOW, 0) * i // max(_SAMPLES - 1, 1))
                h.update(f.read(_WINDOW))
    if not found:
        raise L3Error(f"model directory {model!r} holds no weight files "
                      f"({', '.join(_WEIGHT_SUFFIXES)}); pass weights_signature")
    return "dir:" + h.hexdigest()


def signature(fields: dict[str, Any]) -> str:
    """A stable text of the fields that sign a namespace (sorted ``k=v``; order-free)."""
    return ",".join(f"{k}={fields[k]}" for k in sorted(fields))


def open_stores(where: Any, namespace: Namespace, ranks: Iterable[int], *, writer: bool = True,
                capacity_bytes: int | None = None, timeout_s: float | None = None
                ) -> dict[int, L3Store]:
    """One store per shard index (LMDB ranks in one process share one environment)."""
    out: dict[int, L3Store] = {}
    try:
        for r in ranks:
            out[r] = open_store(where, namespace, r, writer=writer,
                                capacity_bytes=capacity_bytes, timeout_s=timeout_s)
    except BaseException:
        for s in out.values():
            s.close()
        raise
    return out
