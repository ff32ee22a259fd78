"""Helpers shared by the engine adapter tests. Import it before vLLM or SGLang: it makes the
torchvision import placeholder available (stubs/torchvision) where no torchvision is installed,
in the test process and in processes the tests spawn."""

import importlib.util
import os
import sys

from hicache.l3 import PageStore, RedisStore
from hicache.l3.keyed import KeyedStore

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
_spec = importlib.util.find_spec("torchvision")
if _spec is None or (_spec.origin or "").startswith(STUBS):  # see stubs/torchvision/__init__.py
    # transformers must not take the placeholder for a real torchvision
    import transformers.utils as _tfu
    from transformers.utils import import_utils as _tf

    def _no_torchvision() -> bool:
        return False

    _tf.is_torchvision_available = _tfu.is_torchvision_available = _no_torchvision
    if STUBS not in sys.path:
        sys.path.append(STUBS)


def damage(store, key: bytes) -> None:
    """Flip one payload byte of a stored value under the store, as a bad disk or a stray writer
    would (the header and checksum or MAC stay as written)."""
    if isinstance(store, KeyedStore):  # authenticated: the value lives under the keyed key
        key = KeyedStore.store_keys([key], store.secrets.current)[0]
        store = store.inner
    if isinstance(store, PageStore):
        with store._env.begin(write=True) as txn:
            v = bytearray(txn.get(key, db=store._data))
            v[len(v) // 2] ^= 0x40
            txn.put(key, bytes(v), db=store._data)
        return
    assert isinstance(store, RedisStore)
    import redis
    with redis.Redis.from_url(store.url) as c:
        full = store.key_prefix + key
        v = bytearray(c.get(full))
        v[-1] ^= 0x40
        c.set(full, bytes(v))
