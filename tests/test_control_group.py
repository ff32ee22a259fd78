"""The CPU control plane under a group that takes only CUDA tensors (as NCCL does).

The engine's group is built with ``backend="cuda:gloo"``: torch maps only the CUDA device type
to a backend, so any CPU tensor on it is refused, exactly as under NCCL. HiCache's per-step
agreement (debug digest included), the L3 MIN-agreement and the benchmark's soak flag must run
on a CPU gloo group created once beside it. The engine's own data plane (the DCP merge) runs on
the gloo world group here, standing in for its NCCL traffic on CUDA tensors.
"""

import numpy as np
import torch

from hicache.config import HiCacheConfig
from hicache.distributed import launch
from helpers import make_cfg
from test_service import req


def _cuda_only_engine_group(rank, world, cfg_dict, prompts):
    import torch.distributed as dist

    from hicache import distributed as hd
    from hicache.commands.bench import _agree_continue
    from hicache.engine.model import MLAModel
    from hicache.l3 import min_across_ranks
    from hicache.serving import Server, model_config
    from hicache.service import HiCache

    engine = dist.new_group(list(range(world)), backend="cuda:gloo")
    out = {"device_types": sorted(hd.device_types(engine))}
    try:  # the precondition: this group refuses CPU tensors, as NCCL does
        dist.all_reduce(torch.zeros(1), group=engine)
        out["cpu_refused"] = False
    except RuntimeError:
        out["cpu_refused"] = True
    ctl = hd.control_group(engine)
    out["created_once"] = hd.control_group(engine) is ctl and ctl is not engine
    out["world_reused"] = hd.control_group(dist.group.WORLD) is dist.group.WORLD

    cfg = HiCacheConfig.from_dict(cfg_dict)
    model = MLAModel(model_config(cfg))
    jobs = [req(i, p) for i, p in enumerate(prompts)]
    hits = []
    for attempt in range(2):  # the second HiCache on the same path restores from L3
        with HiCache(cfg, rank, engine, mode="l1+l2+l3", debug=True) as cache:
            assert cache.control_group is ctl  # the same twin, not a second group
            server = Server(model, cache, group=dist.group.WORLD, chunk_tokens=16,
                            max_running=1)
            results = server.run(jobs)
            cache.drain()
            s = cache.stats()
            hits.append(s["hit_tokens"])
            out.setdefault("outputs", []).append({r.request_id: r.output for r in results})
    out["hits"] = hits
    out["min"] = min_across_ranks([5 + rank, 9 - rank], engine)
    out["continue"] = [_agree_continue(rank == 0, engine), _agree_continue(rank == 1, engine)]
    return out


def test_control_plane_runs_beside_a_cuda_only_group(tmp_path):
    cfg = make_cfg(tmp_path / "l3", dcp=2, l1_pages=16, l2_ratio=1.0, prefetch="wait_complete")
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 128, 24)
    prompts = [np.concatenate([shared, rng.integers(0, 128, 9)]) for _ in range(3)]
    out = launch(2, _cuda_only_engine_group, cfg.to_dict(), prompts, timeout_s=240)
    for o in out:
        assert o["device_types"] == ["cuda"] and o["cpu_refused"]
        assert o["created_once"] and o["world_reused"]
        assert o["min"] == [5, 8]
        assert o["continue"] == [True, False]  # rank 0's flag decides for every rank
        first, warm = o["hits"]
        assert first["l1"] > 0  # the shared prefix hit L1: transfers were agreed on the twin
        assert warm["l3"] > 0   # the warm start's L3 prefetch was MIN-agreed on the twin
        assert o["outputs"][0] == o["outputs"][1]
    assert out[0]["hits"] == out[1]["hits"] and out[0]["outputs"] == out[1]["outputs"]
