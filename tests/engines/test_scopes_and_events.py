"""Tenants and routers against the real engines: a request's salt is its scope through each
adapter (vLLM's ``cache_salt`` is in the block hashes its tier receives; SGLang 0.5.23 seeds its
storage hashes with the request's extra key and cache salt): two salts never share a page of
hicache's L3, one salt does. And vLLM's own event classes (vllm.distributed.kv_events) decode
the stream a HiCache publishes, byte for byte."""

import time

import msgspec
import numpy as np
import pytest
import zmq
from engine_helpers import damage  # noqa: F401,I001  first: before the engines (engine_helpers)

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str
from vllm.distributed import kv_events as vkv
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.request import Request

from hicache.events import wire
from hicache.service import HiCache

from test_sglang_backend import P, backend, fill, host_pool, indices
from test_vllm_tier import HIT, MISS, Tiered

TOKENS = list(range(100, 164))  # 4 blocks of 16 (vLLM) / 16 pages of 4 (SGLang)


def vllm_keys(salt):
    """The offload keys vLLM derives for TOKENS in a request with ``cache_salt=salt``."""
    init_none_hash(sha256)  # vLLM's own hashing, as its engine sets it up
    hasher = get_request_block_hasher(16, sha256)
    req = Request(f"r-{salt}", TOKENS, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=hasher)
    return [make_offload_key(bytes(h), 0) for h in req.block_hashes]


def test_vllm_cache_salts_never_share_a_page(where):
    t = Tiered(where, chunks=4)
    try:
        a, b, again = vllm_keys("tenant-a"), vllm_keys("tenant-b"), vllm_keys("tenant-a")
        assert again == a and not set(a) & set(b)
        t.store("a", a)
        t.store("x", vllm_keys("filler"))  # push a's chunks out of vLLM's CPU tier
        assert t.resolve(t.request("b"), b) == [MISS] * 4   # another salt: not in hicache's L3
        assert t.resolve(t.request("a2"), again) == [HIT] * 4  # the same salt: all of it
        assert t.resolve(t.request("n"), vllm_keys(None)) == [MISS] * 4  # nor unsalted
    finally:
        t.close()


def sglang_hashes(salt):
    """SGLang's storage hashes of TOKENS' pages (page size P) for a request with this salt."""
    return get_storage_hash_str(RadixKey(TOKENS[:4 * P], cache_salt=salt), None, page_size=P)


def test_sglang_cache_salts_never_share_a_page(where):
    pool = host_pool("layer_first")
    fill(pool, 3)
    be = backend(where, pool)
    try:
        a, b = sglang_hashes("tenant-a"), sglang_hashes("tenant-b")
        assert len(a) == 4 and not set(a) & set(b) and sglang_hashes("tenant-a") == a
        assert be.batch_set_v1(a, indices(pool, [0, 1, 2, 3])) == [True] * 4
        assert be.batch_exists(b) == 0 and be.batch_exists(sglang_hashes(None)) == 0
        assert be.batch_exists(sglang_hashes("tenant-a")) == 4
    finally:
        be.close()


def replay_all(ctx, endpoint: str) -> list:
    """Every batch the publisher kept, from sequence number 0 (its replay socket)."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 10000)
    req.connect(endpoint)
    req.send_multipart((b"", (0).to_bytes(8, "big")))
    out = []
    while True:
        _, _topic, seq, payload = req.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) < 0:
            break
        out.append(payload)
    req.close(0)
    return out


@pytest.fixture
def events_run(tmp_path):
    """The batches a HiCache publishes while serving two scopes and the shared one (from its
    replay socket, before it closes), L3 on; twice on one L3 (the restart hits it)."""
    from helpers import make_cfg, write_kv_rows
    ctx = zmq.Context()
    replay = f"ipc://{tmp_path}/replay"
    cfg = make_cfg(tmp_path / "l3", l1_pages=12, prefetch="wait_complete").replace(
        events={"endpoint": f"ipc://{tmp_path}/events", "replay_endpoint": replay})
    prompt = np.arange(3, 44)
    payloads = []
    for _ in range(2):
        with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
            for i, scope in enumerate(["tenant-a", "tenant-b", None, "tenant-a"]):
                p = cache.admit(i, prompt, scope, 8)
                while not p.ready:
                    cache.step()
                cache.alloc(i, len(prompt))
                write_kv_rows(cache, i, len(prompt))
                cache.finish(i, prompt)
                cache.step()
            cache.drain()
            pub = cache.events.publisher
            for _ in range(100):  # the thread sends what is queued
                if pub.sent == pub.queued:
                    break
                time.sleep(0.05)
            got = replay_all(ctx, replay)
            assert len(got) == pub.queued and pub.dropped == 0
            payloads += got
    ctx.term()
    return payloads


def test_vllms_classes_decode_the_stream_byte_for_byte(events_run):
    decode = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode
    encode = msgspec.msgpack.Encoder().encode
    media, kinds, extra = set(), set(), set()
    for payload in events_run:
        batch = decode(payload)  # vLLM's own classes
        assert encode(batch) == payload and wire.decode(payload) == wire.decode(encode(batch))
        for e in batch.events:
            kinds.add(type(e).__name__)
            if isinstance(e, (vkv.BlockStored, vkv.BlockRemoved)):
                media.add(e.medium)
            if isinstance(e, vkv.BlockStored):
                assert e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes)
                extra |= {x for x in (e.extra_keys or []) if x is not None}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert media == {"GPU", "CPU", "STORAGE"}
    assert len(extra) == 2 and not any("tenant" in str(x) for x in extra)
    assert not any(b"tenant" in p for p in events_run)
