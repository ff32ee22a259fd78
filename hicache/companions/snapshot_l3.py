"""KDA state snapshots in L3: written ONCE for the DCP group, read by every rank.

A snapshot is replicated data (the same on every DCP rank), so it is stored once, under the
group's rank-0 key of the page that ends at its position, in the namespace of its STATE
``PageFormat`` (the weights signature, the layout and the format sign it: a KV page and a
snapshot never share a key). One designated rank writes (DCP rank 0 of replica 0), through a
``CompanionWriter`` (a background ``AsyncWriter`` over this namespace's store): ``finish`` only
queues a copy, the service's ``TierIO`` agrees the writer's errors and flushes it with the
target's at ``drain``; every rank reads. The value is the L3 value format of every page
(header, XXH3 checksum or, in an
authenticated store, the keyed MAC, payload): a forged or damaged value is a miss. Its payload
is ``[layers, 1, conv + rec]`` fp32 (the short-conv window widened exactly, then the recurrent
matrix), split back by ``conv_elems``.

Imports no controller, service or engine. A store failure ends this store on this rank
(``GuardedStore``): its snapshots are then misses here, and the service's agreement turns a
rank that lacks a snapshot into a miss on every rank.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hicache.l3.backends import open_store
from hicache.l3.companion import CompanionWriter
from hicache.l3.guard import GuardedStore
from hicache.l3.keys import Namespace, keys_for_rank


class StateL3:
    """This rank's view of the group's snapshots in L3."""

    def __init__(self, config, rank: int, replica: tuple[int, int], weights_signature: str,
                 fmt, conv_elems: int) -> None:
        self.format = fmt
        self.conv_elems = conv_elems
        self.page_tokens = config.page_tokens
        self.namespace = Namespace.from_config(config, model=weights_signature, fmt=fmt)
        self.writes = rank == 0 and replica[0] == 0
        ns = self.namespace
        self.store = GuardedStore(lambda: open_store(config.l3, ns, 0), config.l3, 0, ns)
        self.written = self.read = 0  # bytes (written: by the writer's thread, once stored)
        self._lock = threading.Lock()
        self.writer = CompanionWriter(self.store, self._wrote) if self.writes else None
        # the lookups and the read at admission run here (``submit``): admit never waits on them
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-snapshot-read")

    def _wrote(self, pages: int) -> None:
        with self._lock:
            self.written += pages * self.format.page_bytes

    def _key(self, chain: bytes) -> bytes:
        """The group's key of the snapshot after the page whose chain hash is ``chain``."""
        return keys_for_rank([chain], self.namespace, 0)[0]

    def put(self, chain: bytes, state) -> None:
        """Queue the snapshot after the page whose chain hash is ``chain`` (the request's:
        ``hicache.service``) for the background writer (the designated rank only; the others
        skip). The tensor queued is a new one (a copy): ``state`` may be reused."""
        if self.writer is None or self.store.failed:
            return
        conv, rec = state
        layers = conv.shape[0]
        shard = torch.cat([conv.detach().to("cpu", torch.float32).reshape(layers, -1),
                           rec.detach().to("cpu", torch.float32).reshape(layers, -1)], 1)
        self.writer.submit([self._key(chain)], [shard.reshape(self.format.shape)])

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` (a ``find`` and the lookups before it) on the read thread."""
        return self._reads.submit(fn, *args)

    def find(self, chains, lo: int, hi: int):
        """``(p, (conv, rec))`` of the deepest snapshot held after the pages whose chain
        hashes are ``chains`` (at least ``hi`` tokens' worth) at a page end in
        ``(lo, hi]``, read in the call (the service's runs on the read thread: ``submit``;
        ``conv`` [L, conv_elems] fp32, ``rec`` flat); ``(lo, None)`` when none is there or
        readable."""
        pt = self.page_tokens
        if self.store.failed:
            return lo, None
        for page in range(hi // pt, lo // pt, -1):
            key = keys_for_rank([chains[page - 1]], self.namespace, 0)
            if not self.store.exists_prefix(key):
                continue
            buf = torch.empty(self.format.shape, dtype=self.format.dtype)
            if self.store.get(key, [buf]) != 1:
                continue  # damaged or gone since: try a shallower one
            with self._lock:  # the read thread counts
                self.read += self.format.page_bytes
            flat = buf.reshape(self.format.layers, -1)
            return page * pt, (flat[:, :self.conv_elems], flat[:, self.conv_elems:])
        return lo, None

    def close(self) -> None:
        """Stop the read thread (a read running ends first, queued ones are dropped) and the
        writer (flushed by the service's drain already; an error left here was agreed already
        or comes after the last step: logged), then close the store."""
        self._reads.shutdown(wait=True, cancel_futures=True)
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.close()
        except Exception as err:  # noqa: BLE001
            logging.getLogger("hicache").warning("snapshot L3 writer: %s", err)
        finally:
            self.store.close()
