"""The KV event publisher: batches framed as vLLM's ZMQ publisher frames them, sent from a thread.

Each batch leaves a PUB socket as three frames ``(topic, sequence number as 8 big-endian bytes,
msgpack payload)``; sequence numbers count batches from 0. An endpoint with ``*``, ``::``,
``ipc://`` or ``inproc://`` is bound, any other (``tcp://HOST:PORT``) is connected to a subscriber
that binds, as vLLM does. A replay socket (ROUTER, optional) answers a request whose last frame is
a start sequence number (8 bytes, big endian) with every kept batch from there on, as
``(topic, seq, payload)``, then an end marker ``(b"", seq -1, b"")``.

Serving never waits on a subscriber: ``publish`` puts the batch in a bounded queue and drops it
(counted in ``dropped``) when the queue is full; the thread encodes and sends.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from itertools import count

import zmq

from hicache.errors import UsageError
from hicache.events import wire
from hicache.events.endpoints import binds, offset_endpoint

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class PublisherSettings:
    """Where and how a publisher sends (the policy file's ``[events]`` section)."""
    endpoint: str
    replay_endpoint: str = ""
    topic: str = ""
    queue_size: int = 10_000     # batches waiting for the thread; more are dropped
    buffer_steps: int = 10_000   # batches kept for replay
    hwm: int = 100_000           # the PUB socket's high-water mark


class Publisher:
    """One publisher (one per DCP group). ``index``: the group's replica index, stamped on
    every batch as vLLM stamps its data-parallel rank (and offsetting the endpoints)."""

    def __init__(self, settings: PublisherSettings, index: int = 0) -> None:
        self.settings, self.index = settings, index
        self.dropped = 0     # batches the full queue refused
        self.queued = 0      # batches accepted (numbered 0 .. queued-1 as they are sent)
        self.sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=settings.queue_size)
        self._kept: deque = deque(maxlen=settings.buffer_steps)
        self._seq = count()
        self._topic = settings.topic.encode("utf-8")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._replay = None
        self.endpoint = offset_endpoint(settings.endpoint, index)
        try:
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if settings.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (settings.buffer_steps + 1))
                self._replay.bind(offset_endpoint(settings.replay_endpoint, index))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise UsageError(f"KV events: cannot open {self.endpoint}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="hicache-kv-events")
        self._thread.start()

    def publish(self, events: list, ts: float) -> bool:
        """Queue one batch of events; False (and counted in ``dropped``) when the queue is
        full or the publisher closed. Never blocks."""
        if not self._running:
            return False
        batch = wire.KVEventBatch(ts=ts, events=events, data_parallel_rank=self.index)
        try:
            self._queue.put_nowait(batch)
            self.queued += 1
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # the sockets are this thread's alone from its start to its end
            self._close_sockets()

    def _loop(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            try:
                seq = next(self._seq)
                payload = wire.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._kept.append((seq, payload))
                self.sent += 1
            except zmq.ZMQError as e:  # a send that fails is a dropped batch, said once
                if not self.dropped:
                    log.warning("KV events: a batch was not sent (%s)", e)
                self.dropped += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._kept):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):  # a full queue: the thread ends once it drained
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout=timeout)  # it closes the sockets as it ends (never two threads)

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=200)
