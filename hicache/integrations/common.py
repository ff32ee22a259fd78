"""What both engine adapters share: engine keys -> store keys, the weights signature, opening
one store per shard. Imports no engine."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Iterable

from ..errors import CheckpointError, L3Error
from ..l3 import L3Store, Namespace, keys_for_rank, open_store
from ..l3.auth import Trust
from ..l3.keys import DIGEST_BYTES

log = logging.getLogger(__name__)


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

    ``override`` (a revision, a checksum, ...) wins. A local checkpoint directory is signed by
    its content (:func:`hicache.checkpoints.signature.weights_signature`: config, safetensors
    headers and sampled tensor bytes; never its path). For a hub id nothing local pins the
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
    from ..checkpoints.signature import weights_signature as checkpoint_signature
    try:
        return checkpoint_signature(model)
    except CheckpointError as e:
        raise L3Error(f"cannot sign the weights of {model!r}: {e}; pass weights_signature") \
            from None


def weights_fields(model: str, override: str | None = None) -> dict[str, str]:
    """The namespace fields that name the weights: their content signature alone for a local
    checkpoint (the same weights at another path share pages), else the model name (a hub id)
    with the signature or the override the caller gave."""
    weights = weights_signature(model, override)
    if not override and isinstance(model, str) and os.path.isdir(model):
        return {"weights": weights}
    return {"model": model, "weights": weights}


def undersized(tier: str, tier_bytes: int, block_bytes: int, request_bytes: int | None = None,
               max_len: int | None = None) -> str | None:
    """The one warning line for a tier that cannot do its job (None when it can): smaller
    than one block across all layers (it holds nothing), or than one request's KV at the
    engine's longest request (``max_len`` tokens: such a request is never offloaded whole)."""
    if tier_bytes < block_bytes:
        return (f"hicache: warning: the {tier} holds {tier_bytes:,} B, less than one block "
                f"across all layers ({block_bytes:,} B): it can offload nothing")
    if request_bytes and tier_bytes < request_bytes:
        return (f"hicache: warning: the {tier} holds {tier_bytes:,} B, less than one "
                f"request's KV ({request_bytes:,} B at {max_len:,} tokens): a request that "
                "long is never offloaded whole; size it for at least one request")
    return None


def held(store: L3Store, skeys: list[bytes]) -> list[bool]:
    """Per key: is it stored? (``exists_prefix`` runs from each miss on; one call when all are
    held, one more per missing key.) The keys need not be in chunk order."""
    out: list[bool] = []
    i = 0
    while i < len(skeys):
        n = store.exists_prefix(skeys[i:])
        out += [True] * n
        i += n
        if i < len(skeys):
            out.append(False)
            i += 1
    return out


def get_each(store: L3Store, skeys: list[bytes], out) -> list[bool]:
    """Per key: was it served into ``out(i)``? (``get`` serves prefixes; a missing, corrupt or
    unreadable page fails only itself.)"""
    got: list[bool] = []
    i = 0
    while i < len(skeys):
        base = i
        n = store.get(skeys[i:], lambda j, b=base: out(b + j))
        got += [True] * n
        i += n
        if i < len(skeys):
            got.append(False)
            i += 1
    return got


# vLLM / SGLang spellings of one KV cache dtype (same bytes): mapped to one name
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
                    "bf16": "bfloat16", "half": "float16", "fp16": "float16",
                    "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def kv_dtype_name(dtype: Any) -> str:
    """One name per KV cache byte format (``fp8`` and ``fp8_e4m3`` alike; ``fp8_e5m2`` apart)."""
    name = str(dtype).removeprefix("torch.")
    return KV_DTYPE_ALIASES.get(name, name)


def is_remote(where: Any) -> bool:
    """A Redis / Valkey URL (or a cluster's URL list) names a store over the network."""
    if isinstance(where, (list, tuple)):
        return True
    return isinstance(where, str) and "://" in where and not where.startswith("file://")


def signature(fields: dict[str, Any]) -> str:
    """A stable text of the fields that sign a namespace (sorted ``k=v``; order-free)."""
    return ",".join(f"{k}={fields[k]}" for k in sorted(fields))


def require_client(where: Any) -> None:
    """A Redis / Valkey store needs the optional redis client: one line saying how to get it."""
    if is_remote(where):
        try:
            import redis  # noqa: F401
        except ImportError:
            raise L3Error("the store is a Redis / Valkey URL, which needs the redis client: "
                          "pip install 'hicache[redis]'") from None


def trust_of(extra: Any) -> Trust:
    """The fleet-secret keys of an adapter's config (``secret_file``, ``previous_secret_file``,
    ``authenticate``: the policy ``[l3]`` keys, the same rule); ConfigError naming a bad one."""
    return Trust.of(extra)


def open_stores(where: Any, namespace: Namespace, ranks: Iterable[int], *, writer: bool = True,
                capacity_bytes: int | None = None, timeout_s: float | None = None,
                trust: Trust | None = None) -> dict[int, L3Store]:
    """One store per shard index (LMDB ranks in one process share one environment). A shared
    store (Redis) without the fleet secret is refused, unless ``trust.authenticate`` is
    False (one warning line)."""
    require_client(where)
    out: dict[int, L3Store] = {}
    try:
        for r in ranks:
            out[r] = open_store(where, namespace, r, writer=writer,
                                capacity_bytes=capacity_bytes, timeout_s=timeout_s,
                                trust=trust)
    except BaseException:
        for s in out.values():
            s.close()
        raise
    return out
