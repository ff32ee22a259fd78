"""The weights signature: a digest of what defines a checkpoint's weights, named by content,
never by path (no torch, no engine: the service and the engine adapters call it).

What it covers, per checkpoint directory:
- ``config.json`` and, when sharded, ``model.safetensors.index.json``, whole;
- every safetensors weight file: its name, its size, its whole header (every tensor's name,
  dtype, shape and byte range, and the file's metadata) and a sample of its tensor bytes:
  ``SAMPLES`` chunks of ``CHUNK`` bytes spread evenly over the data section, the first and the
  last included.

So the same weights at another path (another node's mount, a copy) have the same signature, and
other weights (another model, a fine-tune, another quantization or dtype: every sampled byte
differs) have another. It reads a few hundred KiB per file whatever the checkpoint's size (a
600 GB checkpoint in well under a second; ``bench/weights_signature.py``), so nothing is cached.
It does not read every byte: a change confined to bytes no sample falls on (one edited weight
of a multi-GB file) keeps the signature; pin such weights with an explicit signature
(``weights_signature``, ``[model] signature``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checks import regular_file
from ..errors import CheckpointError
from .hf_config import weight_files

SAMPLES = 64         # chunks sampled per weight file
CHUNK = 4096         # bytes per chunk
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not a checkpoint's
MAX_JSON = 64 << 20  # config.json / the index, read whole


def _whole(path: Path, what: str) -> bytes:
    if not regular_file(path, what, CheckpointError):
        raise CheckpointError(f"{path}: missing")
    size = path.stat().st_size
    if size > MAX_JSON:
        raise CheckpointError(f"{path}: {size} bytes; {what} is at most {MAX_JSON}")
    return path.read_bytes()


def sample_offsets(start: int, end: int, samples: int = SAMPLES, chunk: int = CHUNK) -> list:
    """Where the chunks of a data section ``[start, end)`` are read: evenly spread, the first
    at ``start`` and the last ending at ``end`` (the whole section when it is small)."""
    span = end - start
    if span <= samples * chunk:
        return list(range(start, end, chunk))
    last = end - chunk
    return [start + (last - start) * i // (samples - 1) for i in range(samples)]


def file_digest(path: Path) -> str:
    """XXH3-128 of one safetensors file's size, header and sampled tensor bytes."""
    import xxhash
    if not regular_file(path, "a weight file", CheckpointError):
        raise CheckpointError(f"{path}: missing")
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n}, file "
                                  f"{size} bytes)")
        h.update(f"{size}\0".encode())
        h.update(os.pread(fd, n, 8))
        for off in sample_offsets(8 + n, size):
            h.update(os.pread(fd, min(CHUNK, size - off), off))
    return h.hexdigest()


def weights_signature(directory: str | os.PathLike) -> str:
    """The signature of the checkpoint in ``directory`` (see the module doc):
    ``"xxh3-128:<hex>"``. CheckpointError naming the file that cannot be read."""
    import xxhash
    d = Path(directory)
    try:
        files, _ = weight_files(d)
    except CheckpointError as e:
        raise CheckpointError(str(e)) from None
    total = xxhash.xxh3_128()
    names = ["config.json"] + (["model.safetensors.index.json"]
                               if (d / "model.safetensors.index.json").is_file() else [])
    for name in names:
        total.update(f"{name}\0{xxhash.xxh3_128_hexdigest(_whole(d / name, name))}\n".encode())
    for p in sorted(files):
        total.update(f"{p.relative_to(d).as_posix()}\0{file_digest(p)}\n".encode())
    return f"xxh3-128:{total.hexdigest()}"
