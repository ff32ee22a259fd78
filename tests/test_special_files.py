"""Files that are not files (issue 27, point 6): every path hicache opens is ``stat``-checked
before ``open``. A FIFO (nobody ever writes to it: opening it for reading would block for
ever), a socket, a device or a directory is one line naming the path and what it is."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.checks import regular_file
from hicache.errors import CheckpointError, L3CorruptError, L3Error


def test_regular_file_says_what_a_path_is_without_opening_it(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert regular_file(f, "a file") is True
    assert regular_file(tmp_path / "none", "a file") is False
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match=r"fifo: the thing must be a regular file, but this is a "
                                      r"FIFO$"):
        regular_file(fifo, "the thing")
    sock = tmp_path / "s"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(sock))
    try:
        with pytest.raises(ValueError, match="this is a socket"):
            regular_file(sock, "x", ValueError)
    finally:
        srv.close()
    with pytest.raises(OSError, match="this is a character device"):
        regular_file("/dev/null", "x")
    with pytest.raises(OSError, match="this is a directory"):
        regular_file(tmp_path, "x")
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(OSError, match="this is a FIFO"):  # symlinks are followed
        regular_file(link, "x")


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_an_lmdb_store_whose_files_are_fifos_is_refused_at_once(tmp_path, name):
    from hicache.l3 import PageStore
    from hicache.l3.lmdb_check import precheck
    from test_l3_store import NS, SLOT
    d = tmp_path / "store"
    PageStore(d, NS, 0, capacity_bytes=10 * SLOT).close()  # a real store first
    os.unlink(d / name)
    os.mkfifo(d / name)
    with pytest.raises(L3CorruptError, match=f"{name} must be a regular file, but this is a FIFO"):
        precheck(str(d))
    with pytest.raises(L3Error, match="this is a FIFO"):
        PageStore(d, NS, 0, capacity_bytes=10 * SLOT)


def test_l3_check_of_a_fifo_data_mdb_returns_at_once(tmp_path):
    """The issue's case: `hicache l3 check DIR` used to wait out its 600 s child timeout."""
    os.mkfifo(tmp_path / "data.mdb")
    r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "l3", "check", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "DAMAGED" in r.stdout and "this is a FIFO" in r.stdout
    assert "took over" not in r.stdout


def _checkpoint(tmp_path) -> Path:
    from test_hf_checkpoint import make_checkpoint
    d = tmp_path / "ckpt"
    make_checkpoint(d, arch="v2", q_lora=None, moe=False)
    return d


def test_checkpoint_files_that_are_fifos_are_refused(tmp_path):
    from hicache.checkpoints.hf import load_checkpoint, load_model, weights_signature
    d = _checkpoint(tmp_path)
    for name, what in (("config.json", "config.json"),
                       ("model.safetensors", "the weight file")):
        bad = tmp_path / f"bad-{name}"
        shutil.copytree(d, bad)
        os.unlink(bad / name)
        os.mkfifo(bad / name)
        with pytest.raises(CheckpointError, match=f"{what} must be a regular file, but this "
                                                  "is a FIFO"):
            load_checkpoint(bad)
        with pytest.raises(CheckpointError, match="this is a FIFO"):
            weights_signature(bad)
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="the model file must be a regular file"):
        load_model(fifo)
