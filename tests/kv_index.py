"""What a router would build from hicache's KV events, and nothing else: a subscriber thread on the
ZMQ endpoint and a prefix index keyed the way routers key blocks, by their own hash of the
parent's key, the block's token ids and its extra keys (the events' block hashes only link a
block to its parent and to its removal).

Media: ``GPU`` (L1) and ``CPU`` (L2) blocks belong to the publisher that announced them and go with
its ``AllBlocksCleared``; ``STORAGE`` (L3) blocks are in a store every publisher of the fleet
shares, and go only with a ``BlockRemoved`` for ``STORAGE``. The batches are read with a reader
written from vLLM's documented schema (``read_batch``), not with hicache's classes.
"""

from __future__ import annotations

import hashlib
import threading

import msgpack
import zmq

ROOT = b"router-root"


def read_batch(payload: bytes) -> tuple[float, list, int | None]:
    """``(ts, [(type, fields)], data_parallel_rank)`` of one batch: the array [ts, events,
    data_parallel_rank?], each event a map tagged by ``type``."""
    arr = msgpack.unpackb(payload, raw=False)
    events = []
    for e in arr[1]:
        e = dict(e)
        events.append((e.pop("type"), e))
    return arr[0], events, arr[2] if len(arr) > 2 else None


def router_key(parent: bytes, tokens, extra) -> bytes:
    h = hashlib.sha256(parent)
    h.update(msgpack.packb([list(map(int, tokens)), extra]))
    return h.digest()


class PrefixIndex:
    def __init__(self) -> None:
        self.key_of: dict[bytes, bytes] = {}        # block hash -> router key
        self.media = {"GPU": set(), "CPU": set(), "STORAGE": set()}
        self.payloads: list[bytes] = []             # every payload seen (for the leak checks)
        self.extra_seen: set = set()
        self.last_seq = -1

    def apply(self, payload: bytes) -> None:
        self.payloads.append(payload)
        _ts, events, _dp = read_batch(payload)
        for kind, e in events:
            if kind == "AllBlocksCleared":  # this publisher's L1 and L2 are empty
                self.media["GPU"].clear()
                self.media["CPU"].clear()
            elif kind == "BlockStored":
                self._stored(e)
            elif kind == "BlockRemoved":
                s = self.media[e["medium"]]
                for h in e["block_hashes"]:  # (a block never announced: nothing to drop)
                    s.discard(self.key_of.get(h))

    def _stored(self, e: dict) -> None:
        bs, toks = e["block_size"], e["token_ids"]
        extra = e.get("extra_keys") or [None] * len(e["block_hashes"])
        parent = self.key_of[e["parent_block_hash"]] if e["parent_block_hash"] is not None \
            else ROOT
        for i, h in enumerate(e["block_hashes"]):
            x = extra[i]
            if x is not None:
                self.extra_seen.add(tuple(x))
            key = router_key(parent, toks[i * bs:(i + 1) * bs], x)
            self.key_of[h] = key
            self.media[e["medium"]].add(key)
            parent = key

    def predict(self, tokens, block_size: int, digest: str | None = None,
                public_blocks: int = 0) -> dict:
        """Hit tokens per tier a request would find: the L1 run, then blocks only in L2, then
        blocks in L3 (``digest``: its scope's public digest, entering at ``public_blocks``)."""
        n = (len(tokens) - 1) // block_size  # the last token is never a hit
        parent, keys = ROOT, []
        for i in range(n):
            x = [digest] if digest is not None and i == public_blocks else None
            parent = router_key(parent, tokens[i * block_size:(i + 1) * block_size], x)
            keys.append(parent)
        gpu, cpu, sto = (self.media[m] for m in ("GPU", "CPU", "STORAGE"))
        i = 0
        while i < n and keys[i] in gpu:
            i += 1
        l1 = i
        while i < n and keys[i] in cpu and keys[i] not in gpu:
            i += 1
        l2 = i
        while i < n and keys[i] in sto:
            i += 1
        return {"l1": l1 * block_size, "l2": (l2 - l1) * block_size, "l3": (i - l2) * block_size}


class Subscriber:
    """A SUB socket bound on ``endpoint`` (the publisher connects), feeding a ``PrefixIndex``
    from a thread, in sequence order: batches a late join missed are asked of the replay socket
    (``replay``) first; ``miss`` first batches are lost as by a late join. ``wait(n)`` returns
    once batches 0 .. n-1 were applied."""

    def __init__(self, endpoint: str, replay: str, miss: int = 0) -> None:
        self.index = PrefixIndex()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(endpoint)
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = replay
        self.next = 0                      # the next sequence number to apply
        self.replayed = 0
        self.miss = miss                   # batches to lose as a late join would
        self.topics: set = set()
        self.ranks: set = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self._sub.poll(50):
                continue
            topic, seq, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if self.miss:
                self.miss -= 1
                continue
            if seq < self.next:  # had it already (a replay got there first)
                continue
            if seq > self.next:
                self._replay(seq)
            if seq == self.next:
                self._apply(topic, seq, payload)

    def _replay(self, upto: int) -> None:
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.RCVTIMEO, 5000)
        req.connect(self.replay)
        req.send_multipart((b"", self.next.to_bytes(8, "big")))
        while True:
            _, topic, seq, payload = req.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq < 0:
                break
            if seq < upto and self._apply(topic, seq, payload):
                self.replayed += 1
        req.close(0)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> bool:
        with self._cv:
            if seq != self.next:  # applied already (by the other thread's replay)
                return False
            self.topics.add(topic)
            self.ranks.add(read_batch(payload)[2])
            self.index.apply(payload)
            self.next = seq + 1
            self._cv.notify_all()
            return True

    def restarted(self) -> None:
        """The publisher was replaced (a new cache): its batches count from 0 again."""
        with self._cv:
            self.next = 0

    def wait(self, count: int, timeout: float = 30.0) -> None:
        """Until batches 0 .. count-1 were applied (what stays missing for a while is asked
        of the replay socket, as a subscriber that lost the tail of the stream does)."""
        for _ in range(int(timeout / 0.5)):
            with self._cv:
                if self._cv.wait_for(lambda: self.next >= count, 0.5):
                    return
            self._replay(count)
        raise TimeoutError(f"{self.next} of {count} batches applied")

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._sub.close(0)
        self._ctx.term()
