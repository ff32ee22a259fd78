"""vLLM 0.33's own secondary-tier tests (tests/v1/kv_offload/tiering/test_fs_tier.py and
test_obj_tier.py), read from vLLM's sdist at test time (tests/engines/upstream.py; nothing of
them is kept here) and run UNCHANGED in a pytest of their own against hicache's tier: the tier
class they construct is rebound to HiCacheTier with the same arguments
(tests/engines/upstream_plugin.py). vLLM's mock spec sets ``worker_kv_bytes_per_block = 0``.

Those files test two tiers' implementations as much as the tier contract: a test that opens the
fs tier's files, its O_DIRECT / C-extension paths, its thread pool's queues or the object tier's
NIXL agent has no counterpart in hicache and fails on a missing attribute. CONTRACT lists the
tests whose subject is the secondary-tier contract vLLM's tiering manager relies on (lookups,
store and load jobs and their results, partial failures, events and their locality,
bad arguments): every one must pass. The full tally is printed."""

import collections
import json
import os
import subprocess
import sys

import pytest
import upstream

FILES = ["tests/v1/kv_offload/tiering/test_fs_tier.py",
         "tests/v1/kv_offload/tiering/test_obj_tier.py"]
CONTRACT = {
    "test_fs_tier.py::" + t for t in (
        "test_lookup_empty_tier",
        "test_failed_load_missing_file",
        "test_multiple_jobs_tracked_independently",
        "test_multi_block_job_partial_failure",
        "test_store_load_data_integrity[False-0]",
        "test_out_of_bounds_block_id_smoke[False]",
        "test_batch_lookup_dispatch[False]",
        "test_wait_idle_blocks_until_tasks_complete",
        "test_invalid_path_raises_at_construction",
        "test_invalid_locality_raises_at_construction[local]",
        "test_invalid_locality_raises_at_construction[]",
        "test_successful_store_emits_stored_event",
        "test_store_event_uses_configured_locality[REMOTE-Locality.REMOTE]",
        "test_load_job_emits_no_event",
        "test_events_disabled_by_default",
        "test_events_require_global_kv_events_flag",
        "test_cascade_store_emits_fs_event_through_tiering_manager",
    )} | {
    "test_obj_tier.py::" + t for t in (
        "test_invalid_locality_raises_at_construction[local]",
        "test_invalid_locality_raises_at_construction[]",
    )}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    sdist = upstream.sdist_path()
    assert sdist, (f"vLLM's sdist ({upstream.FILENAME}) is not in ${upstream.ENV}: "
                   "`make test-engines` fetches it")
    root = tmp_path_factory.mktemp("vllm-upstream")
    upstream.extract(sdist, FILES, str(root))
    report = root / "report.json"
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, HICACHE_UPSTREAM_REPORT=str(report),
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here),
                                           os.environ.get("PYTHONPATH", "")]))
    # vLLM's own tests/conftest.py is not in the sdist's path here (--noconftest): the two
    # files use pytest's built-in fixtures only
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--noconftest", "-p", "upstream_plugin", "--tb=line", *FILES],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert report.exists(), p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(report.read_text()), p.stdout


def test_vllm_tier_contract_tests_pass_unchanged(outcomes):
    got, log = outcomes
    print(dict(collections.Counter(got.values())))
    for name, outcome in sorted(got.items()):
        print(f"{outcome:8} {name}")
    missing = sorted(t for t in CONTRACT if got.get(t) != "passed")
    assert not missing, f"{missing}\n{log[-6000:]}"
