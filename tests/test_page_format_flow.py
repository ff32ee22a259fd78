"""Every tier takes its sizes from a PageFormat: the pools, the transfer engine (with a declared
dtype conversion), the L3 namespace, the config's memory math, ``hicache plan`` and the
service."""

import pytest
import torch

from hicache import preflight, topology
from hicache.config import HiCacheConfig
from hicache.errors import L3Error, UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2.copy_convert import ConvertBackend
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine
from hicache.l3.keys import Namespace
from hicache.layout import DCPLayout
from hicache.page_format import FormatSet, PageFormat
from hicache.service import HiCache

from helpers import make_cfg


def filled(pool: DeviceKVPool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(pool.dtype))
    return pool.kv.clone()


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
def test_a_format_of_another_width_and_dtype_flows_l1_to_l2_and_back(kind):
    lay = DCPLayout(2, 1, 4)
    fmt = PageFormat.striped_kv(3, 4, 24, torch.float16)
    d = DeviceKVPool.for_format(lay, fmt, 6)
    h = HostKVPool.for_format(lay, fmt, 5, layout_kind=kind)
    assert d.kv.shape == (3, 24, 24) and d.kv.nbytes == d.nbytes == 6 * fmt.page_bytes
    assert h.buf.nbytes == h.nbytes == 5 * fmt.page_bytes == 5 * h.bytes_per_page
    assert (d.num_layers, d.kv_dim, d.dtype, d.rows_per_page) == (3, 24, torch.float16, 4)
    ref = filled(d, 0)
    with TransferEngine(d, h) as eng:
        assert eng.block_elems == fmt.block_elems and eng.conversion is None
        eng.backup([1, 4], [3, 0]).wait()
        assert torch.equal(h.read_page(3), ref[:, 4:8]) and torch.equal(h.read_page(0),
                                                                          ref[:, 16:20])
        d.kv.zero_()
        job = eng.load([3, 0], [2, 5])
        job.wait()
        assert job.nbytes == 2 * fmt.page_bytes
    assert torch.equal(d.kv[:, 8:12], ref[:, 4:8]) and torch.equal(d.kv[:, 20:24], ref[:, 16:20])


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_wider_host_dtype_converts_exactly_both_ways(kind, narrow):
    lay = DCPLayout(2, 0, 4)
    fmt = PageFormat.striped_kv(2, 4, 8, narrow)
    d = DeviceKVPool.for_format(lay, fmt, 5)
    h = HostKVPool.for_format(lay, fmt.with_dtype(torch.float32), 4, layout_kind=kind)
    ref = filled(d, 1)
    with TransferEngine(d, h) as eng:
        assert isinstance(eng.backend, ConvertBackend) and eng.conversion.exact
        eng.backup([0, 3, 4], [2, 0, 1]).wait()
        assert h.read_page(2).dtype == torch.float32
        assert torch.equal(h.read_page(2), ref[:, 0:4].float())  # widened, value for value
        d.kv.zero_()
        job = eng.load([2, 0, 1], [1, 2, 0])
        for layer in range(2):
            job.wait_layer(layer)
        job.wait()
        assert torch.equal(d.kv[:, 4:8], ref[:, 0:4])  # back to the same bits
        assert torch.equal(d.kv[:, 8:12], ref[:, 12:16]) and torch.equal(d.kv[:, 0:4],
                                                                           ref[:, 16:20])
        # an L3 value holds a host page: restore converts from the host format too
        staging = torch.stack([h.read_page(0), h.read_page(1)]).contiguous()
        d.kv.zero_()
        eng.restore(staging, [3, 4]).wait()
        assert torch.equal(d.kv[:, 12:16], ref[:, 12:16])
        assert torch.equal(d.kv[:, 16:20], ref[:, 16:20])
        with pytest.raises(UsageError, match="float32"):
            eng.restore(staging.to(narrow), [3])
        assert eng.stats.jobs_d2h == 1 and eng.stats.jobs_h2d == 2
        assert eng.stats.bytes_d2h == 3 * fmt.page_bytes


def test_a_conversion_that_rounds_or_is_undeclared_is_refused():
    lay = DCPLayout(1, 0, 4)
    fmt = PageFormat.striped_kv(2, 4, 8, torch.float32)
    d = DeviceKVPool.for_format(lay, fmt, 2)
    with pytest.raises(UsageError, match="would round"):
        TransferEngine(d, HostKVPool.for_format(lay, fmt.with_dtype(torch.bfloat16), 2))
    d16 = DeviceKVPool.for_format(lay, fmt.with_dtype(torch.float16), 2)
    with pytest.raises(UsageError, match="no declared conversion"):
        TransferEngine(d16, HostKVPool.for_format(lay, fmt.with_dtype(torch.bfloat16), 2))
    with pytest.raises(UsageError, match="differ in shape"):
        TransferEngine(d, HostKVPool.for_format(lay, PageFormat.striped_kv(2, 4, 16,
                                                                           torch.float32), 2))


def test_a_failed_conversion_copy_fails_the_job():
    lay = DCPLayout(1, 0, 4)
    fmt = PageFormat.striped_kv(2, 4, 8, torch.bfloat16)
    d = DeviceKVPool.for_format(lay, fmt, 2)
    h = HostKVPool.for_format(lay, fmt.with_dtype(torch.float32), 2)
    with TransferEngine(d, h) as eng:
        def broken(job):
            raise RuntimeError("injected")
        eng.backend.copy = broken  # as hicache.faults wraps it
        job = eng.backup([0], [1])
        assert job.status() == "failed"
        with pytest.raises(Exception, match="injected"):
            job.wait()
        assert eng.stats.jobs_d2h == 0


def test_a_replicated_format_keeps_every_row_on_every_rank():
    P, c = 4, 2
    fmt = PageFormat.replicated(2, P, c, 8, torch.float32)
    for rank in range(c):
        lay = DCPLayout(c, rank, P)
        pool = DeviceKVPool.for_format(lay, fmt, 3)
        assert pool.kv.shape == (2, 3 * P * c, 8) and pool.num_slots == 3 * P * c
        slots = torch.tensor([0, 1, 5, 9, 23])
        rows = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)
        assert pool.write(1, slots, rows) == 5  # every slot's row, whichever rank owns it
        owned, got = pool.read(1, slots)
        assert owned.tolist() == slots.tolist() and torch.equal(got, rows)
        assert torch.equal(pool.kv[1, 9], rows[3])  # slot v at row v
    striped = DeviceKVPool.for_format(DCPLayout(c, 1, P), PageFormat.striped_kv(2, P, 8,
                                                                               torch.float32), 3)
    assert striped.write(1, torch.tensor([0, 1, 5, 9, 23]), rows) == 4  # only the odd slots


def test_a_state_format_lives_in_pools_without_slots():
    lay = DCPLayout(2, 0, 4)
    fmt = PageFormat.state(3, 12, torch.float32, rows=2)
    d = DeviceKVPool.for_format(lay, fmt, 2)
    h = HostKVPool.for_format(lay, fmt, 2)
    assert d.kv.shape == (3, 4, 6) and h.buf.shape == (2, 3, 2, 6)
    with pytest.raises(UsageError, match="state snapshot"):
        d.write(0, [0], torch.zeros(1, 6))
    ref = filled(d, 2)
    with TransferEngine(d, h) as eng:
        eng.backup([1], [0]).wait()
    assert torch.equal(h.read_page(0), ref[:, 2:4])
    assert len(h.read_page_bytes(0)) == fmt.page_bytes


def test_a_format_that_does_not_fit_the_layout_is_refused():
    with pytest.raises(UsageError, match="has 8 rows a page but the layout"):
        DeviceKVPool.for_format(DCPLayout(2, 0, 4), PageFormat.striped_kv(2, 8, 8,
                                                                         torch.float32), 2)
    with pytest.raises(UsageError, match="replicated.*gives it 8"):
        HostKVPool.for_format(DCPLayout(2, 0, 4), PageFormat.replicated(2, 4, 1, 8,
                                                                        torch.float32), 2)


def test_the_namespace_is_built_from_a_format():
    fmt = PageFormat.striped_kv(2, 4, 8, torch.bfloat16)
    ns = Namespace.for_format(fmt, "m", page_size=4, dcp_size=2)
    # the target KV keeps the keys stores hold already (no format version bump)
    assert ns.digest == Namespace("m", 2, 8, "bfloat16", 4, 2).digest
    assert ns.format == fmt and ns.shard_shape == (2, 4, 8) and ns.shard_bytes == 128
    wide = Namespace.for_format(fmt.with_dtype(torch.float32), "m", 4, 2)
    assert wide.shard_bytes == 256 and wide.torch_dtype == torch.float32
    draft = Namespace.for_format(PageFormat.replicated(2, 4, 2, 8, torch.bfloat16), "m", 4, 2)
    state = Namespace.for_format(PageFormat.state(2, 16, torch.bfloat16), "m", 4, 2)
    assert draft.shard_shape == (2, 8, 8) and state.shard_shape == (2, 1, 16)
    assert len({ns.digest, wide.digest, draft.digest, state.digest}) == 4
    with pytest.raises(L3Error, match="rows"):
        Namespace("m", 2, 8, "bfloat16", 4, 2, kind="state")  # a state names its rows
    with pytest.raises(L3Error, match="a striped shard has 4 rows"):
        Namespace("m", 2, 8, "bfloat16", 4, 2, rows=8)


def test_config_memory_math_and_plan_read_the_format(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    fmt = cfg.page_format
    m = cfg.model
    assert fmt == PageFormat.striped_kv(m.num_layers, cfg.cache.page_size, m.kv_dim, m.dtype)
    assert cfg.formats == FormatSet(fmt) and cfg.page_bytes_per_rank == fmt.page_bytes
    need = preflight.memory_need(cfg, 3)
    assert need.l1_per_rank == cfg.l1.num_pages * fmt.page_bytes
    assert need.l2_per_rank == cfg.l2_num_pages * fmt.page_bytes
    bf = HiCacheConfig.from_dict({"model": {"dtype": "bfloat16"}})
    assert bf.page_bytes_per_rank * 2 == HiCacheConfig().page_bytes_per_rank
    r1 = topology.get_model("deepseek-r1")
    assert r1.page_format(8) == PageFormat.striped_kv(61, 1, 576, torch.bfloat16)
    assert topology.kv_bytes_per_token(r1, 8, 4) == r1.page_format(8).page_bytes / 4
    fp32 = topology.KVShape("x", 61, "mla", 1, kv_lora_rank=512, rope_dim=64, dtype="float32")
    assert fp32.bytes_per_token == 2 * r1.bytes_per_token and fp32.dtype_bytes == 4


def test_the_service_builds_its_pools_and_namespace_from_the_config_format(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
        assert cache.l1.format == cache.l2.format == cfg.page_format
        assert cache.namespace.format == cache.l2.format
        assert cache.namespace.digest == Namespace.from_config(cfg, "test-weights").digest
        assert cache.l2.nbytes == cache.ctrl.host.num_pages * cfg.page_format.page_bytes


def test_check_config_and_plan_show_the_format(tmp_path, capsys):
    import json

    from hicache.commands.cli import main
    policy = tmp_path / "p.toml"
    policy.write_text('[model]\nnum_layers = 3\nkv_lora_rank = 24\nrope_dim = 8\n'
                      'dtype = "bfloat16"\n[cache]\npage_size = 8\n[l1]\nnum_pages = 4\n')
    assert main(["check-config", str(policy), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    fmt = PageFormat.striped_kv(3, 8, 32, torch.bfloat16)
    assert info["page_formats"] == [fmt.describe()] and "3 layers x 8 rows x 32 bfloat16" in \
        fmt.describe()
    assert info["page_bytes_per_rank"] == fmt.page_bytes == 3 * 8 * 32 * 2
    assert main(["plan", "--shape", "mla:4:24:8:4", "--tp", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["kv_bytes_per_token_per_rank"] == 4 * 32 * 4  # float32: 4 bytes a value
    assert main(["plan", "--shape", "mla:4:24:8:3", "--tp", "2"]) == 2
    assert "BYTES must be one of 1, 2, 4" in capsys.readouterr().err
