"""Keys: the chain stands for the whole prefix; rank and namespace separate shards."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import L3Error
from hicache.l3 import Namespace, chain_hashes, keys_for_rank, page_keys
from hicache.l3.keys import KEY_BYTES

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=2, dcp_size=2)
PT = NS.page_tokens  # 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=20), st.lists(st.integers(0, 3), max_size=20))
def test_key_equal_iff_prefix_equal(a, b):
    ka, kb = page_keys(a, PT, NS, 0), page_keys(b, PT, NS, 0)
    assert len(ka) == len(a) // PT and len(kb) == len(b) // PT
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[: (i + 1) * PT] == b[: (i + 1) * PT]
        assert (ka[i] == kb[i]) == same_prefix


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=4, max_size=24))
def test_chain_is_rank_independent_and_input_type_independent(tokens):
    k0, k1 = page_keys(tokens, PT, NS, 0), page_keys(tokens, PT, NS, 1)
    assert all(len(k) == KEY_BYTES for k in k0)
    assert all(a != b and a[-16:] == b[-16:] for a, b in zip(k0, k1))
    assert page_keys(torch.tensor(tokens), PT, NS, 1) == k1
    assert page_keys(np.array(tokens, dtype=np.int64), PT, NS, 1) == k1
    assert keys_for_rank(chain_hashes(tokens, PT), NS, 1) == k1


def test_every_namespace_field_changes_the_digest():
    base = dict(model="m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=2, dcp_size=2,
                interleave=1, format_version=1)
    changes = dict(model="m2", num_layers=3, kv_dim=16, dtype="float16", page_size=4, dcp_size=1,
                   interleave=2, format_version=2)
    digests = {Namespace(**base).digest}
    for k, v in changes.items():
        digests.add(Namespace(**{**base, k: v}).digest)
    assert len(digests) == 1 + len(changes)
    assert Namespace(**{**base, "dtype": torch.bfloat16}).digest == Namespace(**base).digest
    assert Namespace(**base).shard_shape == (2, 2, 8) and Namespace(**base).shard_bytes == 64


def test_tail_dropped_and_keys_stable():
    toks = list(range(10))
    assert len(page_keys(toks, PT, NS, 0)) == 2
    assert page_keys(toks, PT, NS, 0) == page_keys(toks[:8], PT, NS, 0)
    other = Namespace("m", 2, 8, "float16", 2, 2)
    assert not set(page_keys(toks, PT, NS, 0)) & set(page_keys(toks, PT, other, 0))


@pytest.mark.parametrize("tokens,match", [
    ([1.5, 2.0], "ints"), (torch.ones(4), "integers"), ("abcd", "list, tensor"),
    ([-1, 2, 3, 4], "non-negative"), ([True, 1, 2, 3], "ints"),
])
def test_bad_tokens(tokens, match):
    with pytest.raises(L3Error, match=match):
        page_keys(tokens, PT, NS, 0)


def test_bad_args():
    with pytest.raises(L3Error, match="outside the DCP group"):
        page_keys([1, 2, 3, 4], PT, NS, 2)
    with pytest.raises(L3Error, match="widened page"):
        page_keys([1, 2, 3, 4], 2, NS, 0)
    with pytest.raises(L3Error, match="page_size"):
        Namespace("m", 2, 8, "bfloat16", 0, 2)
    with pytest.raises(L3Error, match="unknown dtype"):
        Namespace("m", 2, 8, "bf17", 2, 2)


def test_from_config_signs_every_model_field():
    from dataclasses import dataclass, replace
    from types import SimpleNamespace

    @dataclass(frozen=True)
    class Model:
        num_layers: int = 2
        kv_lora_rank: int = 6
        rope_dim: int = 2
        dtype: str = "bfloat16"
        hidden_size: int = 32

        @property
        def kv_dim(self):
            return self.kv_lora_rank + self.rope_dim

    def cfg(model=Model(), dcp=2):
        return SimpleNamespace(model=model, parallel=SimpleNamespace(dcp=dcp, interleave=1),
                               cache=SimpleNamespace(page_size=2))

    ns = Namespace.from_config(cfg())
    assert ns.shard_shape == (2, 2, 8) and ns.dcp_size == 2 and ns.dtype == "bfloat16"
    assert ns.digest == NS.__class__.from_config(cfg()).digest
    others = [cfg(replace(Model(), hidden_size=64)), cfg(dcp=1),
              cfg(replace(Model(), rope_dim=4))]
    assert len({ns.digest} | {Namespace.from_config(c).digest for c in others}) == 4
    assert Namespace.from_config(cfg(), model="weights-v2").digest != ns.digest
