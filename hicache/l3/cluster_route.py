"""Pipelined commands on a Redis Cluster, node by node: a dead shard costs its own keys only.

``RedisStore`` sends each request's commands (one key each) as one round trip per node: every
node's commands are written first, then every node's replies read. A node that cannot be reached
(refused, reset, timed out) answers its own commands with that error (a miss, "not stored");
the other nodes' replies stand. Such a node is skipped for ``retry_after_s`` (its keys answer at
once, no timeout paid per call), the operator gets one warning line naming it and the slots it
served, and the client's slot map is refreshed (at most once per ``retry_after_s``) so a replica
the cluster promoted in its place takes the keys over. A reply that says the slot moved
(``MOVED`` / ``ASK`` after a failover or a resharding) or that the cluster cannot serve the slot
(``CLUSTERDOWN``, ``TRYAGAIN``) is a miss for this call and asks for a refresh too.

redis-py's own cluster pipeline raises for the whole pipeline when one node's connection fails,
which turned every lookup into a miss while one master of three was down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

log = logging.getLogger("hicache")


def slot_ranges(slots: Sequence[int]) -> str:
    """``0-5460,10923`` for sorted slot numbers (``-`` for none)."""
    out: list[str] = []
    lo = prev = None
    for s in slots:
        if prev is not None and s == prev + 1:
            prev = s
            continue
        if lo is not None:
            out.append(f"{lo}-{prev}" if prev != lo else str(lo))
        lo = prev = s
    if lo is not None:
        out.append(f"{lo}-{prev}" if prev != lo else str(lo))
    return ",".join(out) or "-"


class NodeDown(Exception):
    """The answer of a command whose node is being skipped after it failed."""


class ClusterRouter:
    """Routes and runs pipelined single-key commands for one cluster client. Thread-safe.
    ``on_error(exc)`` counts a node's failure (``stats.errors``, the reasons); ``errors`` are
    the exceptions that mean a node is unavailable."""

    def __init__(self, errors: tuple, retry_after_s: float,
                 on_error: Callable[[BaseException], None], where: str) -> None:
        self._errors, self.retry_after_s = errors, retry_after_s
        self._on_error, self._where = on_error, where
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # node name -> monotonic time it is skipped until
        self._warned: set[str] = set()     # nodes the operator was told about (until they answer)
        self._refresh_after = 0.0

    # ---- routing -------------------------------------------------------------------------
    def _route(self, client, commands: list[tuple], results: list) -> dict:
        """Group command indices by the node owning their key's slot; a slot no node serves
        answers its error at once."""
        from redis.exceptions import RedisClusterException
        groups: dict[str, tuple] = {}
        now = time.monotonic()
        for i, cmd in enumerate(commands):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(cmd[1]))
            except RedisClusterException as e:  # slot not covered
                results[i] = e
                continue
            with self._lock:
                skip = self._down.get(node.name, 0.0) > now
            if skip:
                results[i] = NodeDown(node.name)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return groups

    def run(self, client, commands: list[tuple]) -> list:
        """One round trip per node; a reply (raw), or an exception object for a command its
        node refused or could not answer."""
        results: list = [None] * len(commands)
        groups = self._route(client, commands, results)
        sent, failed = [], []
        try:
            for name, (node, idx) in groups.items():
                conn = None
                try:
                    conn = client.get_redis_connection(node).connection_pool.get_connection()
                    conn.send_packed_command(conn.pack_commands([commands[i] for i in idx]))
                    sent.append([name, conn, idx, 0])
                except self._errors as e:
                    if conn is not None:
                        conn.disconnect()
                        client.get_redis_connection(node).connection_pool.release(conn)
                    failed.append(name)
                    self._node_failed(client, name, e, idx, results)
            for entry in sent:
                self._read(client, entry, commands, results, failed)
        finally:
            for name, conn, idx, read in sent:
                if read < len(idx):  # replies left unread: drop the link
                    conn.disconnect()
                client.get_redis_connection(groups[name][0]).connection_pool.release(conn)
        self._after(client, groups, failed, results)
        return results

    def _read(self, client, entry: list, commands, results: list, failed: list) -> None:
        from redis.exceptions import ResponseError
        name, conn, idx, _ = entry
        try:
            for i in idx:
                try:
                    results[i] = conn.read_response()
                except ResponseError as e:  # this command failed (MOVED, OOM, ...), not the link
                    results[i] = e
                entry[3] += 1
        except self._errors as e:
            failed.append(name)
            self._node_failed(client, name, e, idx[entry[3]:], results)

    # ---- failures and recovery --------------------------------------------------------------
    def _node_failed(self, client, name: str, e: BaseException, idx, results: list) -> None:
        for i in idx:
            results[i] = e
        self._on_error(e)
        with self._lock:
            self._down[name] = time.monotonic() + self.retry_after_s
            tell = name not in self._warned
            self._warned.add(name)
        if tell:
            slots = sorted(s for s, nodes in client.nodes_manager.slots_cache.items()
                           if nodes and nodes[0].name == name)
            log.warning("hicache: L3 Redis cluster node %s (slots %s) is unavailable "
                        "(%s: %s); its keys are misses until it answers or a replica takes "
                        "its slots", name, slot_ranges(slots), type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")

    def _after(self, client, groups: dict, failed: list, results: list) -> None:
        """Forget the nodes that answered; refresh the slot map after a failure or a
        redirection (at most once per ``retry_after_s``)."""
        from redis.exceptions import AskError, ClusterDownError, TryAgainError
        answered = [n for n in groups if n not in failed]
        with self._lock:
            for n in answered:
                self._down.pop(n, None)
                if n in self._warned:
                    self._warned.discard(n)
                    log.info("hicache: L3 Redis cluster node %s answers again", n)
        moved = any(isinstance(r, (AskError, ClusterDownError, TryAgainError, NodeDown))
                    for r in results)
        if failed or moved:
            self.refresh(client, failed[0] if failed else None)

    def refresh(self, client, last_failed: str | None = None) -> bool:
        """Re-read the slot map from the cluster (promoted replicas, moved slots); False when
        it is not due or no node answered."""
        now = time.monotonic()
        with self._lock:
            if now < self._refresh_after:
                return False
            self._refresh_after = now + self.retry_after_s
        try:
            client.nodes_manager.initialize(last_failed_node_name=last_failed)
        except Exception as e:  # no startup node answered: keep the old map
            log.debug("hicache: L3 cluster slot map refresh failed: %s", e)
            return False
        return True
