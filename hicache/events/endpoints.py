"""ZMQ endpoints of the KV event publisher: checked, placed per DCP group, bound or connected
(as vLLM's publisher does). No zmq import: the policy file checks its endpoints here."""

from __future__ import annotations

from hicache.errors import UsageError


def offset_endpoint(endpoint: str, index: int) -> str:
    """The endpoint of publisher ``index`` (a DCP group's replica index): a tcp port moved up by
    ``index`` (port 0 stays 0), ``inproc`` (and ``ipc``) names suffixed ``_dp<index>``, as
    vLLM places its data-parallel ranks' publishers."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{index}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"
    return endpoint


def binds(endpoint: str) -> bool:
    """Whether a publisher binds ``endpoint`` (a wildcard, ipc, inproc) or connects to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_endpoint(endpoint: str, what: str = "endpoint") -> str:
    """``endpoint`` if ZMQ can use it (tcp://HOST:PORT, ipc://, inproc://), else UsageError."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://",
                                                                   "inproc://")):
        raise UsageError(f"{what} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                         f"got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"{what} must be tcp://HOST:PORT, got {endpoint!r}")
    return endpoint
