"""What naming the weights by content costs at load (issue 34 point 3), as a ratio in one run.

Writes a multi-GB safetensors checkpoint (``config.json`` plus ``--files`` weight files, ``--gib``
in all, random bf16 bytes) under ``--dir``, then times the weights signature
(:mod:`hicache.checkpoints.signature`: config, every header, ``SAMPLES`` chunks of ``CHUNK``
bytes per file) against the baseline it replaced: XXH3-128 of every byte of every file. Each is
timed warm (the files in the page cache) and cold (the files' pages dropped with
``posix_fadvise(DONTNEED)`` first). The checkpoint is deleted at the end.

    python bench/weights_signature.py [--gib 4] [--files 4] [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hicache.checkpoints import signature
from hicache.commands.report import table

TENSOR_BYTES = 64 << 20


def write_checkpoint(d: Path, gib: float, files: int) -> list[Path]:
    """``files`` safetensors files of ``gib`` GiB in all (bf16 tensors of 64 MiB, random)."""
    (d / "config.json").write_text(json.dumps({"architectures": ["Bench"], "hidden_size": 8}))
    per_file = int(gib * (1 << 30)) // files
    rng = np.random.default_rng(0)
    out = []
    bar = tqdm(total=per_file * files, unit="B", unit_scale=True, desc="writing checkpoint")
    for i in range(files):
        n = max(1, per_file // TENSOR_BYTES)
        header, off = {}, 0
        for t in range(n):
            header[f"model.layers.{i}.mlp.w{t}.weight"] = {
                "dtype": "BF16", "shape": [TENSOR_BYTES // 2 // 4096, 4096],
                "data_offsets": [off, off + TENSOR_BYTES]}
            off += TENSOR_BYTES
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        p = d / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(p, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for _ in range(n):
                f.write(rng.bytes(TENSOR_BYTES))
                bar.update(TENSOR_BYTES)
        out.append(p)
    bar.close()
    index = {"weight_map": {k: p.name for p in out for k in _names(p)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _names(p: Path) -> list[str]:
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return list(json.loads(f.read(n)))


def whole_file_xxh3(paths: list[Path]) -> str:
    """The baseline: XXH3-128 of every byte (what the signature hashed before)."""
    import xxhash
    h = xxhash.xxh3_128()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, paths, cold: bool, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        if cold:
            drop_cache(paths)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="checkpoint size (GiB)")
    ap.add_argument("--files", type=int, default=4, help="weight files")
    ap.add_argument("--dir", default="/tmp", help="where the checkpoint is written (deleted)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hicache-sig-bench-") as tmp:
        d = Path(tmp)
        paths = write_checkpoint(d, a.gib, a.files)
        every = paths + [d / "config.json", d / "model.safetensors.index.json"]
        rows = []
        for cold in (False, True):
            whole_file_xxh3(paths)  # the page cache as the mode wants it (warm: all of it)
            sig = timed(lambda: signature.weights_signature(d), every, cold, a.reps)
            base = timed(lambda: whole_file_xxh3(paths), every, cold, 1 if cold else a.reps)
            rows.append({"cache": "cold" if cold else "warm", "signature_s": sig,
                         "whole_file_xxh3_s": base, "ratio": base / sig})
        size = sum(p.stat().st_size for p in paths)
    result = {"bytes": size, "files": a.files, "samples_per_file": signature.SAMPLES,
              "chunk_bytes": signature.CHUNK, "rows": rows}
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"{size / (1 << 30):.2f} GiB in {a.files} safetensors files; the signature reads each "
          f"header and {signature.SAMPLES} chunks of {signature.CHUNK} B per file")
    print(table([[r["cache"], r["signature_s"], r["whole_file_xxh3_s"], r["ratio"]]
                 for r in rows], ["page cache", "signature s", "whole-file XXH3 s",
                                  "ratio (x faster)"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
