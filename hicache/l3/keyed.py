"""``KeyedStore``: an authenticated store seen through the keys its callers derive.

Callers derive page keys from tokens (:func:`hicache.l3.keys.page_keys`: anyone can). With a fleet
secret the backend holds each page under a keyed store key instead (:mod:`hicache.l3.auth`), and
checks the MAC of every value it reads. This wrapper turns caller keys into store keys (the
current secret's for everything; for reads, where the current secret finds nothing, the previous
secret's too, so a rotation keeps what the previous secret stored) and is an ``L3Store`` to its
callers. Each secret vouches only for the keys it derived: a value under a current-secret key
verifies with the current secret's MAC alone, so whoever holds a leaked previous secret cannot
re-sign the pages stored since the rotation; a page read from the previous secret is rewritten
under the current one. Attributes it does not define are the backend store's.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from .auth import Secret, Secrets
from .base import L3Stats, L3Store, Out, PutResult
from .keys import DIGEST_BYTES
from ..errors import L3Error

log = logging.getLogger(__name__)

_PREFIX = DIGEST_BYTES + 2  # namespace digest | rank


class KeyedStore:
    def __init__(self, inner: L3Store, secrets: Secrets) -> None:
        self.inner, self.secrets = inner, secrets

    def __getattr__(self, name: str):
        if name in ("inner", "secrets"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @staticmethod
    def store_keys(keys: Sequence[bytes], secret: Secret) -> list[bytes]:
        return [k[:_PREFIX] + secret.store_chain(k[_PREFIX:]) for k in keys]

    def check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.inner.check_keys(keys)

    def check_tensor(self, t: torch.Tensor, what: str) -> None:
        self.inner.check_tensor(t, what)

    _check_keys = check_keys
    _check_tensor = check_tensor

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        keys = self.inner.check_keys(keys)
        n = self.inner.exists_prefix(self.store_keys(keys, self.secrets.current))
        prev = self.secrets.previous
        if prev is not None and n < len(keys):
            n += self.inner.exists_prefix(self.store_keys(keys[n:], prev))
        return n

    def get(self, keys: Sequence[bytes], out: Out) -> int:
        """Pages under the current secret's keys (MACs checked with the current secret only),
        then, during a rotation, the rest under the previous secret's keys (MACs checked with
        the previous secret only); a page served from the previous secret is written again
        under the current one, so the rotation window empties as pages are read."""
        keys = self.inner.check_keys(keys)
        dst = self.inner._destinations(keys, out)
        served = self.inner.get(self.store_keys(keys, self.secrets.current), dst)
        prev = self.secrets.previous
        if prev is None or served >= len(keys):
            return served
        first, seen = served, {}
        with self.inner.verifying(prev):
            served += self.inner.get(self.store_keys(keys[first:], prev),
                                     lambda i: seen.setdefault(i, dst(first + i)))
        if served > first and self.inner.writer:
            self._rewrite(keys[first:served], [seen[i] for i in range(served - first)])
        return served

    def _rewrite(self, keys: list[bytes], pages: list[torch.Tensor]) -> None:
        """Pages read under the previous secret, stored again under the current one (a failed
        write costs only a later re-read)."""
        try:
            self.inner.put(self.store_keys(keys, self.secrets.current), pages)
        except L3Error as e:
            log.warning("hicache L3: rewriting %d pages under the current secret failed: %s",
                        len(keys), e)

    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> PutResult:
        keys = self.inner.check_keys(keys)
        return self.inner.put(self.store_keys(keys, self.secrets.current), shards)

    def delete(self, keys: Sequence[bytes]) -> int:
        keys = self.inner.check_keys(keys)
        n = self.inner.delete(self.store_keys(keys, self.secrets.current))
        if self.secrets.previous is not None:
            n += self.inner.delete(self.store_keys(keys, self.secrets.previous))
        return n

    @property
    def stats(self) -> L3Stats:
        return self.inner.stats

    def abandon(self) -> None:
        self.inner.abandon()

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
