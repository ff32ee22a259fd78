"""vLLM's own tests, from vLLM's source distribution on PyPI (its wheel ships no tests): fetched
once by ``make test-engines`` into the engine environment cache (PyPI is the one network CI has;
the file is checked against the hash pinned here), then read at test time straight from the
tarball. Nothing of vLLM's test code is kept in this repository.

    python tests/engines/upstream.py DIR   # download the pinned sdist into DIR (once)
"""

import hashlib
import json
import os
import shutil
import sys
import tarfile
import urllib.request

PROJECT, VERSION = "vllm", "0.33.0"
SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
FILENAME = f"{PROJECT}-{VERSION}.tar.gz"
ENV = "HICACHE_UPSTREAM_DIR"  # where the Makefile keeps the sdist
INDEX = "https://pypi.org/simple/"


def sdist_path() -> str | None:
    """The pinned sdist in $HICACHE_UPSTREAM_DIR, or None."""
    d = os.environ.get(ENV)
    path = os.path.join(d, FILENAME) if d else None
    return path if path and os.path.isfile(path) else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(dest_dir: str) -> str:
    """Download the pinned sdist from PyPI's simple index (JSON form) into dest_dir, checked
    against SHA256; a present, intact file is kept."""
    path = os.path.join(dest_dir, FILENAME)
    if os.path.isfile(path) and _sha256(path) == SHA256:
        return path
    req = urllib.request.Request(INDEX + PROJECT + "/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    url = next(f["url"] for f in files if f["filename"] == FILENAME)
    os.makedirs(dest_dir, exist_ok=True)
    tmp = path + ".part"
    with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    if _sha256(tmp) != SHA256:
        os.unlink(tmp)
        raise SystemExit(f"{FILENAME}: sha256 differs from the pinned {SHA256}")
    os.replace(tmp, path)
    return path


def extract(sdist: str, members: list[str], dest: str) -> dict[str, str]:
    """Unpack the named files (paths inside the sdist's top folder) under dest; their paths."""
    top = f"{PROJECT}-{VERSION}/"
    out = {}
    with tarfile.open(sdist) as tar:
        for m in members:
            info = tar.getmember(top + m)
            target = os.path.join(dest, m)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tar.extractfile(info) as src, open(target, "wb") as f:
                shutil.copyfileobj(src, f)
            out[m] = target
    return out


if __name__ == "__main__":
    print(fetch(sys.argv[1]))
