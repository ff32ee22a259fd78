"""One validation for check-config, hicache-bench, the example and HiCache: config errors,
node-wide memory, the L3 path, presets, and the dict round trip of every valid config."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from hicache.errors import ConfigError
from hicache import preflight
from hicache.config import SECTIONS, HiCacheConfig, loads
from hicache.preflight import Machine, memory_need, validate

from helpers import admit_ready

GiB = 1 << 30
NO_CUDA = Machine(cuda=False, host_available=64 * GiB)


def cfg_of(text: str) -> HiCacheConfig:
    return loads(text)


@pytest.mark.parametrize("text, words", [
    ("[model]\nrope_dim = 0", "model.rope_dim: 0 is out of range"),
    ("[model]\nrope_dim = 15", "model.rope_dim: 15 is odd"),
    ("[l2]\nratio = nan", "l2.ratio: nan is out of range"),
    ("[policy]\nprefetch_timeout_s = nan", "policy.prefetch_timeout_s: nan is out of range"),
    ("[policy]\nprefetch_timeout_per_1k_s = inf", "policy.prefetch_timeout_per_1k_s: inf"),
])
def test_static_errors_at_load(text, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        cfg_of(text)


def test_machine_dependent_errors(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    base = "[parallel]\ntp = 2\ndcp = 2\n"
    cases = [
        (base + "[model]\nnum_heads = 3", "model.num_heads: 3 is not divisible by parallel.dcp 2"),
        ('[l2]\npin = "on"', 'l2.pin: "on" needs CUDA'),
        (f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{a_file}"', "exists and is not a directory"),
        ('[l3]\nenabled = true\n[l3.lmdb]\npath = "/proc/hicache"', "is under /proc"),
        ('[l3]\nenabled = true\n[l3.lmdb]\npath = ""', "l3.lmdb.path: is empty"),
        ('[l3]\nenabled = true\n[l3.lmdb]\npath = "a\\u0000b"', "contains a NUL"),
        (f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{a_file}/sub"', "is not a directory"),
        ("[model]\nnum_layers = 64\nkv_lora_rank = 4096\n[l3]\nenabled = true\n[l3.lmdb]\n"
         f'size_bytes = 1048576\npath = "{tmp_path}/l3"', "l3.lmdb.size_bytes: 1048576 is smaller"),
        ("[l2]\nsize_bytes = 100", "l2.size_bytes: 100 is smaller than one page"),
    ]
    for text, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            validate(cfg_of(text), machine=NO_CUDA)
        assert "\n" not in str(e.value)
    # the same config without the L3 tier does not look at the path
    validate(cfg_of(f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{a_file}"'), tiers=("l1", "l2"),
             machine=NO_CUDA)


def test_l3_without_l2_is_a_warning_naming_the_keys(tmp_path):
    cfg = cfg_of(f'[l2]\nratio = 0.0\n[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/s"')
    (w,) = validate(cfg, machine=NO_CUDA)
    assert "l3.enabled" in w and "l2.ratio" in w and "store nothing" in w
    assert validate(cfg.replace(l2={"ratio": 1.0}), machine=NO_CUDA) == []


def test_memory_is_checked_for_the_whole_node():
    # 4 layers * 16 rows * 80 * 4 B = 20 KiB a page; L1 1 GiB worth, L2 2x that, per rank
    cfg = cfg_of("[parallel]\ntp = 2\ndcp = 2\n[l1]\nnum_pages = 52429")
    need = memory_need(cfg, 2)
    page = cfg.page_bytes_per_rank
    assert (need.l1_per_rank, need.l2_per_rank) == (52429 * page, 2 * 52429 * page)
    assert need.host_total == 2 * 3 * 52429 * page
    # one rank's pools fit, two ranks' do not: the node check says so, naming the keys
    one_rank = Machine(cuda=False, host_available=int(need.host_total / 2 / 0.9) + GiB)
    validate(cfg, ranks=1, machine=one_rank)
    with pytest.raises(ConfigError, match=r"memory: 2 rank\(s\) on this node need 6\.00 GiB .*"
                                          r"L1 1\.00 GiB \+ L2 2\.00 GiB per rank.*l1\.num_pages"):
        validate(cfg, machine=one_rank)
    # with CUDA L1 is on the GPU: only L2 counts against host memory, L1 against the GPU
    gpu = memory_need(cfg, 2, cuda=True)
    assert gpu.host_total == 2 * 2 * 52429 * page
    with pytest.raises(ConfigError, match="l1.num_pages: the device pool needs"):
        preflight.check_memory(gpu, Machine(True, 64 * GiB, device_free=GiB // 2))


def test_l2_counts_at_least_one_page():
    cfg = cfg_of("[l1]\nnum_pages = 100\n[l2]\nratio = 0.0")
    assert memory_need(cfg, 1).l2_per_rank == cfg.page_bytes_per_rank  # the service keeps one
    assert memory_need(cfg.replace(l2={"ratio": 1.5}), 1).l2_per_rank == \
        150 * cfg.page_bytes_per_rank


# ---- presets and the dict round trip ---------------------------------------------------------
def test_preset_round_trips_and_replaces():
    cfg = cfg_of('[model]\npreset = "deepseek-r1"')
    assert (cfg.model.num_layers, cfg.model.kv_lora_rank, cfg.model.rope_dim) == (61, 512, 64)
    assert HiCacheConfig.from_dict(cfg.to_dict()) == cfg
    moved = cfg.replace(l1={"num_pages": 8}, parallel={"tp": 2, "dcp": 2})
    assert moved.model == cfg.model and moved.l1.num_pages == 8
    with pytest.raises(ConfigError, match="model.num_layers: 3 conflicts with model.preset"):
        cfg.replace(model={"num_layers": 3})
    with pytest.raises(ConfigError, match="model.rope_dim: 32 conflicts"):
        cfg_of('[model]\npreset = "kimi-k2"\nrope_dim = 32')


def test_a_preset_runs_in_the_service(tmp_path):
    from hicache import HiCache
    cfg = cfg_of('[model]\npreset = "deepseek-r1"\ndtype = "bfloat16"\nsignature = "r1-test"\n'
                 '[cache]\npage_size = 4\n'
                 f'[l1]\nnum_pages = 8\n[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/l3"')
    tokens = np.arange(30)
    with HiCache(cfg.replace()) as cache:
        admit_ready(cache, 0, tokens)  # alloc only once the (empty) L3 lookup is agreed
        cache.finish(0, tokens)
        cache.step()
        again = cache.admit(1, tokens)
        cache.abort(1)
        cache.drain()
    assert again.device_len == 28  # whole 4-token pages of the first 29 tokens


def test_a_preset_too_big_for_the_machine_is_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    policy = tmp_path / "big.toml"
    policy.write_text('[model]\npreset = "deepseek-r1"\n[l1]\nnum_pages = 1000000\n')
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "examples/engine_loop.py"), str(policy)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: memory: 1 rank(s) on this node need") and "GiB" in line


def _section_values(kind):
    """Strategies for every key of a section, within its documented range."""
    out = {}
    for f in dataclasses.fields(kind):
        m = f.metadata
        if f.name == "url":  # l3.url: a Redis URL or a list of cluster nodes
            out[f.name] = st.sampled_from(["", "redis://127.0.0.1:6379/0",
                                           ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]])
        elif m.get("choices"):
            out[f.name] = st.sampled_from(m["choices"])
        elif isinstance(f.default, bool):
            out[f.name] = st.booleans()
        elif isinstance(f.default, int) and not m.get("type"):
            lo = int(m["min"] or 0)
            out[f.name] = st.one_of(st.integers(lo, lo + 16), st.integers(lo, int(m["max"])))
        elif isinstance(f.default, float) or m.get("type"):
            out[f.name] = st.floats(m["min"], min(m["max"], 64.0), allow_nan=False)
        else:
            out[f.name] = st.text(min_size=1, max_size=8).filter(lambda s: "\0" not in s)
    return st.fixed_dictionaries({}, optional=out)


@given(st.fixed_dictionaries({}, optional={n: _section_values(k) for n, k in SECTIONS.items()}))
def test_every_valid_config_round_trips(d):
    try:
        cfg = HiCacheConfig.from_dict(d)
    except ConfigError:
        return  # an invalid combination (topology, odd rope_dim, preset conflict)
    again = HiCacheConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert cfg.replace() == cfg
    for name, sec in d.items():
        for key, value in sec.items():
            got = getattr(getattr(cfg, name), key)
            if not (name == "model" and cfg.model.preset and key in
                    ("num_layers", "kv_lora_rank", "rope_dim")):
                want = tuple(value) if isinstance(value, list) else value
                assert got == want or (isinstance(value, float) and math.isclose(got, value))


def test_a_preset_passes_hicache_bench_resolution(tmp_path):
    from hicache.commands import bench as bench_cli
    policy = tmp_path / "p.toml"
    policy.write_text('[model]\npreset = "deepseek-r1"\n[parallel]\ntp = 2\ndcp = 2\n'
                      f'[l1]\nnum_pages = 8\n[l3.lmdb]\npath = "{tmp_path}/l3"\n')
    args = bench_cli.build_parser().parse_args(["--config", str(policy), "--dcp", "2",
                                                "--l3-path", str(tmp_path / "other")])
    cfg, modes, workloads = bench_cli._resolve(args)
    assert cfg.model.preset == "deepseek-r1" and cfg.model.num_layers == 61
    assert cfg.l3.enabled and cfg.l3.path == str(tmp_path / "other")
    assert HiCacheConfig.from_dict(cfg.to_dict()) == cfg
