"""The adapters' L3 health bookkeeping (hicache.integrations.health): failure reasons from the
real redis client's exceptions, and deltas taken from real stores' counters."""

import socket

import pytest
import redis
import torch

from hicache.integrations.health import REASONS, Health, error_reason
from hicache.l3 import Namespace, keys_for_rank, open_store


@pytest.mark.parametrize("err,reason", [
    (redis.exceptions.TimeoutError("Timeout reading from socket"), "timeout"),
    (socket.timeout("timed out"), "timeout"),
    (redis.exceptions.AuthenticationError("invalid username-password pair"), "auth"),
    (redis.exceptions.ResponseError("NOAUTH Authentication required."), "auth"),
    (redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
     "refused"),
    (redis.exceptions.ConnectionError("Connection closed by server."), "refused"),
    (ConnectionRefusedError(111, "Connection refused"), "refused"),
    (redis.exceptions.ResponseError("OOM command not allowed"), "other"),
    (None, "other"),
])
def test_error_reason(err, reason):
    assert error_reason(err) == reason and reason in REASONS


def test_health_takes_deltas_of_real_store_counters(tmp_path):
    ns = Namespace(model="m", num_layers=1, kv_dim=8, dtype="uint8", page_size=1, dcp_size=1)
    s = open_store(str(tmp_path / "l3"), ns, 0)
    try:
        h = Health()
        keys = keys_for_rank([bytes([i]) * 16 for i in range(3)], ns, 0)
        shard = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
        s.put(keys, [shard] * 3)
        h.outcome(hits=2, misses=1)
        d = h.take([s])
        assert (d.pages_written, d.bytes_written, d.hits, d.misses) == (3, 24, 2, 1)
        assert d.errors == {}
        d = h.take([s])
        assert d.empty  # nothing new
        h.error("auth")
        assert h.take([s]).errors == {"auth": 1}
        with pytest.raises(ValueError, match="unknown L3 failure reason"):
            h.error("bad")
    finally:
        s.close()
