"""Cache scopes (tenants): what keeps two tenants' prefixes apart in every tier.

A scope enters a request's page chain before its first scoped page: the radix tree keys that
page by the scope's tag and its tokens (so no walk from another scope reaches it), and the chain
hash that names it in L2, L3 and the KV events mixes the tag in at that page. Pages before it,
the request's declared public prefix (whole pages), stay in the shared scope, so a system prompt
every tenant sends is cached once.

The tag is a digest of the scope, never the scope; :func:`public_digest` is a further digest of
the tag, the only form a scope takes outside the process (KV events). A neutral module: it
imports no tier, controller or service.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hicache.errors import UsageError

TAG_BYTES = 16


@dataclass(frozen=True, slots=True)
class Scope:
    """One request's scope: ``tag`` (the scope's digest, ``TAG_BYTES``) and ``public_pages``,
    the leading whole pages matched and cached in the shared scope."""
    tag: bytes
    public_pages: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tag, bytes) or len(self.tag) != TAG_BYTES:
            raise UsageError(f"a scope tag is {TAG_BYTES} bytes, got {self.tag!r:.40}")
        if type(self.public_pages) is not int or self.public_pages < 0:
            raise UsageError(f"public_pages must be an int >= 0, got {self.public_pages!r}")

    def bound(self, page_tokens: int) -> int:
        """Tokens of the public prefix: where the scoped part of the chain starts."""
        return self.public_pages * page_tokens


def scope_tag(scope: "bytes | str") -> bytes:
    """The tag of a scope given as bytes or str (UsageError for anything else or empty)."""
    if isinstance(scope, str):
        raw = scope.encode("utf-8")
    elif isinstance(scope, (bytes, bytearray, memoryview)):
        raw = bytes(scope)
    else:
        raise UsageError(f"a scope is bytes, str or None, got {type(scope).__name__}")
    if not raw:
        raise UsageError("a scope must not be empty (None is the shared scope)")
    return hashlib.blake2b(raw, digest_size=TAG_BYTES, person=b"hicache-scope").digest()


def make_scope(scope, public_tokens: int, page_tokens: int) -> "Scope | None":
    """A request's ``Scope`` from what ``admit`` was given: None (the shared scope: every page
    shared, ``public_tokens`` has nothing to do), else the scope's tag with ``public_tokens``
    rounded down to whole pages (UsageError for a negative or non-int count)."""
    if type(public_tokens) is not int or public_tokens < 0:
        raise UsageError(f"public_tokens must be an int >= 0, got {public_tokens!r}")
    if scope is None:
        return None
    if isinstance(scope, Scope):
        return scope
    return Scope(scope_tag(scope), public_tokens // page_tokens)


def mix(prev: bytes, tag: bytes) -> bytes:
    """The chain state after the scope enters it: what the first scoped page's hash chains
    from instead of ``prev`` (the public prefix's last chain hash, or the chain's seed)."""
    return hashlib.blake2b(prev + tag, digest_size=len(prev), person=b"hicache-scope-in").digest()


def public_digest(tag: bytes) -> str:
    """What may leave the process for a scope (KV events' ``extra_keys``): a digest of the tag
    that groups one scope's blocks without naming it (hex, 16 characters)."""
    return hashlib.blake2b(tag, digest_size=8, person=b"hicache-scope-ev").hexdigest()


def label(scope: "Scope | None", page: int) -> str:
    """``public`` for a page in the shared scope (no scope, or inside the public prefix), else
    ``scoped``: the only scope label metrics carry."""
    return "public" if scope is None or page < scope.public_pages else "scoped"
