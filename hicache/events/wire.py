"""KV events in vLLM's wire format: msgspec Structs whose msgpack bytes are those of vLLM's
``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (the same field
order, defaults, tags and array layout), so vLLM's own decoder and the routers that read vLLM's
events (llm-d's KV indexer, Dynamo's KV router) read hicache's.

A batch is an array ``[ts, events, data_parallel_rank]``; an event is a map tagged
``type = <class name>``; fields equal to their default are left out. Block hashes are hicache's
page chain hashes (16 bytes each), ``block_size`` is the widened page (``P * c`` tokens), and
``medium`` names the tier: ``GPU`` for L1, ``CPU`` for L2, ``STORAGE`` for L3 (whatever memory L1
is on: the names are the tiers vLLM's consumers know).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM = {"l1": "GPU", "l2": "CPU", "l3": "STORAGE"}  # tier -> the event's medium


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Union[int, None] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    # fields hicache leaves unset (omitted from the bytes), declared so that the map header's
    # width is the one vLLM's encoder writes for its class (msgpack map16 past 15 entries)
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None
    session_id: Union[str, None] = None
    lookahead_token_ids: Union[list[list[int]], None] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its bytes (msgspec.ValidationError / DecodeError when it is not one)."""
    return _DECODER.decode(payload)
