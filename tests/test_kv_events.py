"""KV events in vLLM's wire format: the bytes of a batch, a reader written from vLLM's documented
schema (plain msgpack, no hicache class), the ZMQ framing (topic, sequence numbers), the replay
socket, and a publisher that never stalls its caller."""

import threading

import msgpack
import pytest
import zmq

from hicache.errors import UsageError
from hicache.events import wire
from hicache.events.endpoints import check_endpoint, offset_endpoint
from hicache.events.publisher import Publisher, PublisherSettings

# what vLLM 0.33's own classes (vllm.distributed.kv_events) encode for BATCH below
VLLM_BYTES = bytes.fromhex(
    "93cb3ff800000000000094de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392"
    "c410000102030405060708090a0b0c0d0e0fc410101112131415161718191a1b1c1d1e1fb1706172656e745f62"
    "6c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72"
    "615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291b030313233"
    "343536373839616263646566c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "91c410000102030405060708090a0b0c0d0e0fa66d656469756da343505581a474797065b0416c6c426c6f636b"
    "73436c6561726564de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c41020"
    "2122232425262728292a2b2c2d2e2fb1706172656e745f626c6f636b5f68617368c410101112131415161718191a"
    "1b1c1d1e1fa9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f72615f6964c0a66d6564"
    "69756da753544f52414745a96c6f72615f6e616d65c003")
H0, H1, H2 = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
BATCH = wire.KVEventBatch(ts=1.5, data_parallel_rank=3, events=[
    wire.BlockStored([H0, H1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None,
                     [("0123456789abcdef",), None]),
    wire.BlockRemoved([H0], "CPU"),
    wire.AllBlocksCleared(),
    wire.BlockStored([H2], H1, [9, 10, 11, 12], 4, None, "STORAGE", None)])


def read_batch(payload: bytes) -> dict:
    """A reader from vLLM's documented schema alone: a batch is the array [ts, events,
    data_parallel_rank?]; each event a map tagged by "type"; block hashes bytes or ints."""
    arr = msgpack.unpackb(payload, raw=False)
    ts, events = arr[0], arr[1]
    out = []
    for e in events:
        kind = e.pop("type")
        assert kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"), kind
        if kind == "BlockStored":
            assert len(e["token_ids"]) == e["block_size"] * len(e["block_hashes"])
            assert e.get("extra_keys") is None or len(e["extra_keys"]) == len(e["block_hashes"])
        out.append((kind, e))
    return {"ts": ts, "events": out, "dp": arr[2] if len(arr) > 2 else None}


def test_a_batch_is_the_bytes_vllm_encodes():
    assert wire.encode(BATCH) == VLLM_BYTES
    assert wire.decode(VLLM_BYTES) == BATCH


def test_the_documented_schema_reads_a_batch():
    got = read_batch(wire.encode(BATCH))
    assert got["ts"] == 1.5 and got["dp"] == 3
    kinds = [k for k, _ in got["events"]]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStored"]
    stored = got["events"][0][1]
    assert stored["block_hashes"] == [H0, H1] and stored["parent_block_hash"] is None
    assert stored["medium"] == "GPU" and stored["extra_keys"] == [["0123456789abcdef"], None]
    assert got["events"][3][1]["parent_block_hash"] == H1
    assert "extra_keys" not in got["events"][3][1]  # a default is left out, as vLLM does


def _settings(**kw):
    return PublisherSettings(**{"endpoint": "tcp://127.0.0.1:0", **kw})


def _subscribe(ctx, endpoint, topic=b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def test_frames_sequence_numbers_and_replay(tmp_path):
    ctx = zmq.Context()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = Publisher(PublisherSettings(endpoint=ep, replay_endpoint=rep, topic="kv@pod@m"),
                    index=0)
    sub = _subscribe(ctx, ep)
    try:
        seen = None
        for _ in range(200):  # a SUB joins late: publish until one arrives
            pub.publish([wire.AllBlocksCleared()], 0.0)
            if sub.poll(50):
                seen = sub.recv_multipart()
                break
        assert seen is not None
        topic, seq, payload = seen
        assert topic == b"kv@pod@m" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        for i in range(3):
            pub.publish(BATCH.events, 2.0 + i)
        got = []
        while len(got) < 3:
            t, s, p = sub.recv_multipart()
            if read_batch(p)["ts"] >= 2.0:
                got.append((int.from_bytes(s, "big"), read_batch(p)))
        seqs = [s for s, _ in got]
        assert seqs == sorted(seqs) and seqs[2] - seqs[0] == 2 and seqs[0] > first
        assert got[0][1]["dp"] == 0
        # the replay socket: every kept batch from a sequence number, then the end marker
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.RCVTIMEO, 5000)
        req.connect(rep)
        req.send_multipart((b"", seqs[1].to_bytes(8, "big")))
        frames = [req.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(f[2], "big") for f in frames[:2]] == seqs[1:]
        assert frames[0][1] == b"kv@pod@m" and read_batch(frames[1][3])["ts"] == 4.0
        assert frames[2][1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        req.close(0)
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


class _Held(Publisher):
    """A publisher whose thread waits for ``go`` before sending: a subscriber that is slow."""
    def __init__(self, *a, **kw):
        self.go = threading.Event()
        super().__init__(*a, **kw)

    def _run(self):
        self.go.wait(10)
        super()._run()


def test_a_full_queue_drops_and_never_blocks():
    pub = _Held(_settings(endpoint="tcp://127.0.0.1:9", queue_size=4), index=0)  # nobody there
    try:
        done = [pub.publish([wire.AllBlocksCleared()], float(i)) for i in range(50)]
        assert done.count(True) == 4 and pub.dropped == 46
    finally:
        pub.go.set()
        pub.close()
    assert pub.publish([wire.AllBlocksCleared()], 0.0) is False


def test_endpoints():
    assert offset_endpoint("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://x", 1) == "inproc://x_dp1"
    assert offset_endpoint("ipc:///run/x", 1) == "ipc:///run/x_dp1"
    assert check_endpoint("tcp://router:5557") == "tcp://router:5557"
    for bad in ("router:5557", "tcp://router", "tcp://:5557", "http://x:1"):
        with pytest.raises(UsageError, match="tcp://HOST:PORT"):
            check_endpoint(bad)
    with pytest.raises(UsageError, match="cannot open"):
        Publisher(_settings(endpoint="ipc:///nonexistent-dir/x/y"))


def test_each_dcp_group_publishes_on_its_own_port_with_its_index(tmp_path):
    """Replica (DCP group) 1 of a fleet publishes on PORT + 1 (its replay socket likewise) and
    stamps its batches 1, as vLLM's data-parallel ranks do."""
    import time
    from hicache.service import HiCache
    from helpers import make_cfg
    cfg = make_cfg(tmp_path / "l3").replace(
        events={"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": f"ipc://{tmp_path}/r"})
    ctx = zmq.Context()
    try:
        with HiCache(cfg, 0, None, mode="l1", replica=(1, 2)) as cache:
            pub = cache.events.publisher
            assert pub.endpoint == "tcp://127.0.0.1:5558"
            for _ in range(100):
                if pub.sent == pub.queued:
                    break
                time.sleep(0.05)
            req = ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.RCVTIMEO, 5000)
            req.connect(f"ipc://{tmp_path}/r_dp1")
            req.send_multipart((b"", (0).to_bytes(8, "big")))
            first = req.recv_multipart()
            req.close(0)
    finally:
        ctx.term()
    assert int.from_bytes(first[2], "big") == 0
    got = read_batch(first[3])
    assert got["dp"] == 1 and [k for k, _ in got["events"]] == ["AllBlocksCleared"]
