"""What the loader's finite-weights check costs (issue 27 point 2), as a ratio in one run.

``load_checkpoint`` reads every weight once to refuse NaN/inf (``hf.non_finite``: a sum per
tensor, memory-mapped; ``torch.isfinite(t).all()`` is shown too, which it replaces). The baseline is what every first load already pays for the same
bytes: XXH3-128 of every byte of the files (what the weights signature hashed before it sampled).

    .venv/bin/python bench/finite_check.py [--mib 512] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hicache.checkpoints.hf import non_finite


def _file_digest(path: Path) -> str:
    """XXH3-128 of every byte of the file (the baseline)."""
    import xxhash
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    n = a.mib * (1 << 20) // torch.tensor([], dtype=dtype).element_size()
    per = 1 << 22
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "model.safetensors"
        save_file({f"w{i}": torch.randn(min(per, n - i * per)).to(dtype)
                   for i in range(-(-n // per))}, str(f))
        _file_digest(f)  # warm the page cache for both
        best = {}
        for _ in range(3):
            t0 = time.perf_counter()
            with safe_open(str(f), framework="pt", device="cpu") as st:
                ok = not any(non_finite(st.get_tensor(k)) for k in st.keys())
            t1 = time.perf_counter()
            _file_digest(f)
            t2 = time.perf_counter()
            with safe_open(str(f), framework="pt", device="cpu") as st:
                all(bool(torch.isfinite(st.get_tensor(k)).all()) for k in st.keys())
            t3 = time.perf_counter()
            best["finite"] = min(best.get("finite", 1e9), t1 - t0)
            best["xxh3"] = min(best.get("xxh3", 1e9), t2 - t1)
            best["isfinite"] = min(best.get("isfinite", 1e9), t3 - t2)
        assert ok
        gb = f.stat().st_size / 1e9
        print(f"{a.mib} MiB of {a.dtype} weights, {torch.get_num_threads()} threads: finite check "
              f"{gb / best['finite']:.2f} GB/s, XXH3-128 of the file {gb / best['xxh3']:.2f} GB/s,"
              f" isfinite().all() {gb / best['isfinite']:.2f} GB/s; the check costs "
              f"{best['finite'] / best['xxh3']:.2f}x hashing every byte once")


if __name__ == "__main__":
    main()
