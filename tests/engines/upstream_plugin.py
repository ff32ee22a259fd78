"""A pytest plugin (``-p upstream_plugin``) that runs vLLM's own secondary-tier test modules,
unchanged, against hicache's tier: the tier class each module builds its tiers from
(``FileSystemTierManager``, ``ObjectStoreSecondaryTierManager``) is rebound, in the loaded module
only, to a HiCacheTier taking the same constructor arguments (its store: an LMDB directory, under
the fs tier's ``root_dir``). Every test's outcome goes to $HICACHE_UPSTREAM_REPORT as JSON."""

import json
import os
import tempfile

import engine_helpers  # noqa: F401  (before vLLM: the torchvision placeholder)
from hicache.integrations.vllm import HiCacheTier

WEIGHTS = "vllm-upstream-tests"


class FsHiCacheTier(HiCacheTier):
    """HiCacheTier built from vLLM's fs tier arguments."""

    def __init__(self, offloading_spec, primary_kv_view, tier_type, root_dir, *,
                 n_read_threads=None, n_write_threads=None, enable_kv_events=False,
                 locality=None, backpressure_detector=None, **_fs_only):
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         store=os.path.join(root_dir, "hicache-l3"), mla=False,
                         weights_signature=WEIGHTS, enable_kv_events=enable_kv_events,
                         locality=locality,
                         backpressure_detector=backpressure_detector)


class ObjHiCacheTier(HiCacheTier):
    """HiCacheTier built from vLLM's object-store tier arguments (a fresh LMDB directory)."""

    def __init__(self, offloading_spec, primary_kv_view, tier_type, store_config=None,
                 prefix=None, *, enable_kv_events=False, locality=None,
                 backpressure_detector=None, **_obj_only):
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         store=tempfile.mkdtemp(prefix="hicache-obj-"), mla=False,
                         weights_signature=WEIGHTS, enable_kv_events=enable_kv_events,
                         locality=locality,
                         backpressure_detector=backpressure_detector)


SHIMS = {"FileSystemTierManager": FsHiCacheTier,
         "ObjectStoreSecondaryTierManager": ObjHiCacheTier}
_outcomes: dict[str, str] = {}


def pytest_collection_modifyitems(session, config, items):
    for mod in {item.module for item in items if getattr(item, "module", None)}:
        for name, shim in SHIMS.items():
            if hasattr(mod, name):
                setattr(mod, name, shim)


def pytest_runtest_logreport(report):
    path, _, test = report.nodeid.partition("::")
    name = path.rsplit("/", 1)[-1] + "::" + test
    if report.when == "call" or report.outcome != "passed":
        if _outcomes.get(name, "passed") == "passed":
            _outcomes[name] = report.outcome if report.when == "call" else \
                ("error" if report.outcome == "failed" else report.outcome)


def pytest_sessionfinish(session):
    path = os.environ.get("HICACHE_UPSTREAM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
