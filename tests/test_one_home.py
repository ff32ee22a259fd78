"""One home for each choice list and default: the policy file's schema (hicache.config); the
pools, the transfer engine and the CLIs read theirs from it, and a list's name means one thing."""

import importlib
import inspect

import pytest

from hicache import config
from hicache.config import IOSection, L2Section, ModelSection, bounds, choices, default
from hicache.errors import ConfigError, UsageError


def test_the_tiers_take_choices_and_defaults_from_the_schema():
    from hicache.l2 import pool, transfer
    assert pool.LAYOUTS is choices(L2Section, "layout")
    assert pool.PIN_MODES is choices(L2Section, "pin")
    sig = inspect.signature(pool.HostKVPool)
    assert sig.parameters["layout_kind"].default == default(L2Section, "layout") == "page_first"
    assert sig.parameters["pin"].default == default(L2Section, "pin") == "auto"
    assert inspect.signature(pool.host_pages_for).parameters["ratio"].default == \
        default(L2Section, "ratio")
    assert transfer.IO_BACKENDS is choices(IOSection, "backend")
    assert transfer.COPY_THREADS == default(IOSection, "copy_threads")
    assert transfer.MAX_COPY_THREADS == bounds(IOSection, "copy_threads")[1]
    assert inspect.signature(transfer.TransferEngine).parameters["io_backend"].default == \
        default(IOSection, "backend")


def test_a_value_the_schema_lacks_is_refused_by_both_alike():
    from hicache.l2.pool import resolve_pin
    with pytest.raises(ConfigError, match="l2.pin"):
        config.HiCacheConfig.from_dict({"l2": {"pin": "always"}})
    with pytest.raises(UsageError, match="pin must be one of"):
        resolve_pin("always")


def test_model_presets_are_the_registry_mla_models():
    from hicache import topology
    presets = choices(ModelSection, "preset")
    assert presets[0] == "" and set(presets[1:]) == {
        n for n, m in topology.MODELS.items() if m.attention == "mla"}
    assert "llama-3-70b" not in presets  # a GQA model has no MLA latent to cache


def test_each_list_name_means_one_thing():
    service = importlib.import_module("hicache.service")
    ring = importlib.import_module("hicache.pcp.ring")
    dcp = importlib.import_module("hicache.engine.dcp")
    assert set(service.CACHE_MODES) == {"recompute", "l1", "l1+l2", "l1+l2+l3"}
    assert ring.PCP_MODES == ("full_kv", "ring") and dcp.DCP_BACKENDS == ("a2a", "ag_rs")
    for mod in (service, ring, dcp, importlib.import_module("hicache.commands.decode"),
                importlib.import_module("hicache.commands.bench")):
        assert not hasattr(mod, "MODES"), mod.__name__
        assert mod is importlib.import_module("hicache.l3.backends") or \
            not hasattr(mod, "BACKENDS"), mod.__name__
