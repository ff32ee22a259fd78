"""The Triton latent decode-attention kernel against the torch reference, under TRITON_INTERPRET=1.

Runs in a subprocess so the interpreter flag is set before triton is imported and never leaks
into other tests. Shapes are tiny: the interpreter is slow.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(r"""
    import json, math, os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from hicache.kernels.decode_attention import available, decode_attention_latent
    from hicache.engine.attention import attend_latent, attend_latent_torch

    out = {"available": available(), "cases": []}
    g = torch.Generator().manual_seed(0)
    cases = [
        # T, H, R, Dr, N, dtype, splits, q positions
        (1, 4, 32, 8, 40, torch.float32, None, "last"),     # plain decode
        (3, 18, 20, 8, 33, torch.float32, 3, "mixed"),      # verify, odd dims, forced splits
        (2, 8, 16, 16, 25, torch.bfloat16, 2, "mixed"),     # bf16 rows (fp32 math in kernel)
        (2, 2, 16, 4, 5, torch.float16, None, "none"),      # nothing allowed: o=0, lse=-inf
        (1, 3, 16, 4, 0, torch.float32, None, "last"),      # empty shard
    ]
    for t, h, r, dr, n, dt, splits, mode in cases:
        q_lat = torch.randn(t, h, r, generator=g)
        q_pe = torch.randn(t, h, dr, generator=g)
        kv = torch.randn(n, r + dr, generator=g).to(dt)
        kv_pos = torch.randperm(2 * n + 1, generator=g)[:n].sort().values * 1  # a shard's positions
        if mode == "last":
            q_pos = torch.full((t,), 2 * n + 1)
        elif mode == "none":
            q_pos = torch.full((t,), -1)
        else:
            q_pos = torch.linspace(-1, 2 * n, t).round().long()
        o, lse = decode_attention_latent(q_lat, q_pe, kv, q_pos, kv_pos, 0.37, r,
                                         num_splits=splits)
        o_ref, lse_ref = attend_latent_torch(q_lat, q_pe, kv, q_pos, kv_pos, 0.37, r)
        o2, lse2 = attend_latent(q_lat, q_pe, kv, q_pos, kv_pos, 0.37, r, backend="triton")
        # the same keys as scattered rows of a larger pool layer, read in place (no gather)
        pool = torch.randn(3 * n + 2, r + dr, generator=g).to(dt)
        rows = torch.randperm(3 * n + 2, generator=g)[:n]
        pool[rows] = kv
        o3, lse3 = decode_attention_latent(q_lat, q_pe, pool, q_pos, kv_pos, 0.37, r,
                                           num_splits=splits, rows=rows)
        o4, lse4 = attend_latent(q_lat, q_pe, pool, q_pos, kv_pos, 0.37, r, backend="torch",
                                 rows=rows)
        fin = torch.isfinite(lse_ref)
        out["cases"].append({
            "indirect_same": bool(torch.equal(o3, o) and torch.equal(lse3, lse)),
            "indirect_torch_same": bool(torch.equal(o4, o_ref) and torch.equal(lse4, lse_ref)),
            "o_err": float((o - o_ref).abs().max()) if o.numel() else 0.0,
            "lse_err": float((lse[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0,
            "inf_match": bool(torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))),
            "nan": bool(torch.isnan(o).any() or torch.isnan(lse).any()),
            "zeros_where_empty": bool((o[~fin] == 0).all()),
            "dispatch_same": bool(torch.equal(o2, o) or (o2 - o).abs().max() < 1e-6),
            "shape_ok": tuple(o.shape) == (t, h, r) and tuple(lse.shape) == (t, h),
            "any_allowed": bool(fin.any()),
        })
    print(json.dumps(out))
""")


def test_kernel_matches_torch_reference_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["available"]
    assert len(res["cases"]) == 5
    for i, c in enumerate(res["cases"]):
        assert c["shape_ok"], (i, c)
        assert not c["nan"], (i, c)
        assert c["inf_match"], (i, c)
        assert c["zeros_where_empty"], (i, c)
        assert c["o_err"] < 2e-5 and c["lse_err"] < 2e-5, (i, c)
        assert c["dispatch_same"], (i, c)
        assert c["indirect_same"] and c["indirect_torch_same"], (i, c)
    assert res["cases"][0]["any_allowed"] and not res["cases"][3]["any_allowed"]
