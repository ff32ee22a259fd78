"""L3 keys: a namespace digest + the DCP rank + a hash chain over widened pages' token ids.

A key stands for a whole prefix: page ``i``'s chain hash covers page ``i-1``'s chain hash and page
``i``'s token ids, so two requests share page ``i``'s key only when they share every token before
it. The chain is rank-independent (every rank of a DCP group derives the same chain for the same
tokens); the rank and the namespace are prepended so each rank's shard has its own key and a
store written with another layout (model, dtype, P, c, interleave, format) can never hit.

    key = namespace.digest (16 B) | rank (2 B, big endian) | chain hash (16 B)
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

from hicache.checks import check_int
from hicache.errors import L3Error, UsageError
from hicache import page_format
from hicache.ids import as_tokens
from hicache.page_format import PageFormat, PageKind
from hicache.scope import Scope, mix

FORMAT_VERSION = 2  # 2: XXH3-64 value checksum (1: CRC-32)
DIGEST_BYTES = 16
KEY_BYTES = 2 * DIGEST_BYTES + 2
CHAIN_SEED = b"hicache-l3-chain"  # the chain state before its first page


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    try:
        return page_format.dtype_name(dtype)
    except UsageError:
        raise L3Error(f"unknown dtype {dtype!r}" if isinstance(dtype, str) else
                      f"dtype must be a torch.dtype or its name, got {dtype!r}") from None


DEFAULT_FORMAT = ("striped", "kv", "raw")  # (kind, name, encoding) signed as before: same keys


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a stored rank shard: the model signature, the
    shard's ``PageFormat`` (``format``) and the DCP layout its keys are chained over.

    ``model`` is a free-form model signature (name, weights revision, ...). ``for_format``
    builds one from a ``PageFormat``; the fields spell the same facts out (``num_layers``,
    ``kv_dim`` = row width, ``dtype``, ``page_size`` = P, ``kind``, ``name``, ``rows``,
    ``encoding``). The target KV's namespace digest is the one stores written before formats
    existed carry; any other format signs its kind, name, rows and encoding too.
    """

    model: str
    num_layers: int
    kv_dim: int
    dtype: str
    page_size: int  # physical rows per page on each rank (P)
    dcp_size: int
    interleave: int = 1
    format_version: int = FORMAT_VERSION
    kind: str = "striped"
    name: str = "kv"
    rows: int = 0   # rows per shard; 0 = the kind's own (P striped, P*c replicated)
    encoding: str = "raw"
    digest: bytes = field(init=False, repr=False, compare=False)
    format: PageFormat = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise L3Error(f"Namespace.model must be a str, got {self.model!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for key in ("num_layers", "kv_dim", "page_size", "dcp_size", "interleave",
                    "format_version"):
            check_int(getattr(self, key), f"Namespace.{key}", error=L3Error)
        check_int(self.rows, "Namespace.rows", 0, error=L3Error)
        try:
            kind = PageKind(self.kind)
            own = {PageKind.STRIPED: self.page_size,
                   PageKind.REPLICATED: self.page_size * self.dcp_size}.get(kind, 0)
            if self.rows and own and self.rows != own:
                raise UsageError(f"a {kind.value} shard has {own} rows, got rows={self.rows}")
            fmt = PageFormat(self.name, kind, self.num_layers, self.rows or own or 0,
                             self.kv_dim, self.dtype, self.encoding)
        except (UsageError, ValueError) as e:
            raise L3Error(f"Namespace: {e}") from None
        object.__setattr__(self, "kind", kind.value)
        object.__setattr__(self, "rows", fmt.rows)
        object.__setattr__(self, "format", fmt)
        fields = [self.model, self.num_layers, self.kv_dim, self.dtype, self.page_size,
                  self.dcp_size, self.interleave, self.format_version]
        if (self.kind, self.name, self.encoding) != DEFAULT_FORMAT:
            fields += [self.kind, self.name, self.rows, self.encoding]
        digest = hashlib.blake2b(msgpack.packb(fields), digest_size=DIGEST_BYTES,
                                 person=b"hicache-ns").digest()
        object.__setattr__(self, "digest", digest)

    @classmethod
    def for_format(cls, fmt: PageFormat, model: str, page_size: int, dcp_size: int,
                   interleave: int = 1) -> "Namespace":
        """The namespace of ``fmt``'s shards under a DCP layout of ``page_size`` (P) rows per
        rank over ``dcp_size`` ranks (the chain covers ``P*c`` tokens a page)."""
        if not isinstance(fmt, PageFormat):
            raise L3Error(f"format must be a PageFormat, got {type(fmt).__name__}")
        return cls(model=model, num_layers=fmt.layers, kv_dim=fmt.row_width, dtype=fmt.dtype,
                   page_size=page_size, dcp_size=dcp_size, interleave=interleave,
                   kind=fmt.kind.value, name=fmt.name, rows=fmt.rows, encoding=fmt.encoding)

    # ---- the namespace record (what ``hicache l3 ls`` shows) ---------------------------------
    RECORD_FIELDS = ("model", "num_layers", "kv_dim", "dtype", "page_size", "dcp_size",
                     "interleave", "format_version", "kind", "name", "rows", "encoding")

    def record(self) -> bytes:
        """The fields that make this namespace, as stored beside its pages (msgpack). A record
        proves itself: :meth:`from_record` rebuilds the namespace and compares the digest, so no
        secret is needed to trust what it says about the keys under its digest."""
        return msgpack.packb({k: getattr(self, k) for k in self.RECORD_FIELDS})

    @classmethod
    def from_record(cls, raw: bytes, digest: bytes | None = None) -> "Namespace | None":
        """The namespace a :meth:`record` describes; None when it is unreadable or (given
        ``digest``) names another digest."""
        try:
            fields = msgpack.unpackb(bytes(raw))
            ns = cls(**{k: fields[k] for k in cls.RECORD_FIELDS})
        except Exception:
            return None
        return ns if digest is None or ns.digest == bytes(digest) else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.format.dtype

    @property
    def shard_shape(self) -> tuple[int, int, int]:
        """Shape of one rank's shard of one widened page: ``[L, rows, width]``."""
        return self.format.shape

    @property
    def shard_bytes(self) -> int:
        return self.format.page_bytes

    @property
    def page_tokens(self) -> int:
        """Tokens in one widened page (``P * c``): the unit the chain hashes."""
        return self.page_size * self.dcp_size

    @classmethod
    def from_config(cls, config: Any, model: str = "mla",
                    fmt: PageFormat | None = None) -> "Namespace":
        """Build from a ``HiCacheConfig`` (duck-typed: model/parallel/cache sections) for
        ``fmt`` (default: the config's target KV format). Pass ``model`` = a weights signature
        when the same shapes can carry different weights (the model section's own
        ``signature`` field is left to the caller: it may be overridden)."""
        m, par = config.model, config.parallel
        if dataclasses.is_dataclass(m):  # every model field (shapes, preset, ...) signs the bytes
            sig = ",".join(f"{k}={v}" for k, v in sorted(dataclasses.asdict(m).items())
                           if k != "signature")
        else:
            sig = f"lora{m.kv_lora_rank}:rope{m.rope_dim}"
        if fmt is None:
            fmt = PageFormat.striped_kv(m.num_layers, config.cache.page_size, m.kv_dim, m.dtype)
        return cls.for_format(fmt, f"{model}:{sig}", config.cache.page_size, par.dcp,
                              par.interleave)


def _tokens_array(tokens: Any) -> np.ndarray:
    """Token ids as little-endian int64 [n] (``hicache.ids.as_tokens``), non-negative."""
    try:
        arr = as_tokens(tokens)
    except UsageError as e:
        raise L3Error(str(e)) from None
    if arr.size and arr.min() < 0:
        raise L3Error("token ids must be non-negative")
    return np.ascontiguousarray(arr, dtype="<i8")


def chain_hashes(tokens: Any, page_tokens: int, scope: Scope | None = None) -> list[bytes]:
    """Rank-independent chain hash of every WHOLE page of ``tokens`` (the tail is dropped).
    ``scope`` (``hicache.scope``; None: the shared scope) enters the chain before its first
    scoped page (after its public pages), so two scopes share no page's hash past those."""
    check_int(page_tokens, "page_tokens", error=L3Error)
    arr = _tokens_array(tokens)
    return chain_on(CHAIN_SEED, arr, page_tokens, 0, scope)


def chain_on(prev: bytes, arr: np.ndarray, page_tokens: int, first: int,
             scope: Scope | None = None) -> list[bytes]:
    """The chain hashes of the whole pages of ``arr`` (token ids of any int dtype, hashed as
    int64), continuing a chain whose last hash is ``prev`` (``CHAIN_SEED`` at its start) at
    page index ``first``."""
    n_pages = arr.size // page_tokens
    pages = arr[: n_pages * page_tokens].reshape(n_pages, page_tokens)  # [n, page_tokens] int64
    out: list[bytes] = []
    enter = scope.public_pages - first if scope is not None else -1
    for i, row in enumerate(pages):  # one hash per page over its raw int64 bytes
        if i == enter:
            prev = mix(prev, scope.tag)
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(np.ascontiguousarray(row, dtype="<i8").data)
        prev = h.digest()
        out.append(prev)
    return out


def make_key(namespace: Namespace, rank: int, chain: bytes) -> bytes:
    if not isinstance(rank, int) or not 0 <= rank < namespace.dcp_size:
        raise L3Error(f"rank {rank!r} is outside the DCP group [0, {namespace.dcp_size})")
    return namespace.digest + rank.to_bytes(2, "big") + chain


def page_keys(tokens: Any, page_tokens: int, namespace: Namespace, rank: int,
              scope: Scope | None = None) -> list[bytes]:
    """Store keys of every whole widened page of ``tokens`` for ``rank``'s shard (in
    ``scope``: ``chain_hashes``)."""
    if not isinstance(namespace, Namespace):
        raise L3Error(f"namespace must be a Namespace, got {type(namespace).__name__}")
    if page_tokens != namespace.page_tokens:
        raise L3Error(f"page_tokens {page_tokens} != the namespace's widened page "
                      f"{namespace.page_size}*{namespace.dcp_size} = {namespace.page_tokens}")
    prefix = make_key(namespace, rank, b"")
    return [prefix + c for c in chain_hashes(tokens, page_tokens, scope)]


def keys_for_rank(chains: Sequence[bytes], namespace: Namespace, rank: int) -> list[bytes]:
    """Keys from already computed chain hashes (share one chain between tiers/ranks)."""
    prefix = make_key(namespace, rank, b"")
    return [prefix + c for c in chains]
