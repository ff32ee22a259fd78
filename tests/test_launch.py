"""The launcher when a rank fails: it names the rank and how (exception, signal, exit code),
stops the others at once (they would wait on the dead peer until the group timeout), and ranks
that finish leave without interpreter teardown noise."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hicache.distributed import all_reduce, launch
from hicache.errors import ConfigError, RankError

GROUP_TIMEOUT = 120  # the survivor would block this long in its collective without the launcher


def _one_rank_fails(rank: int, world: int, how: str) -> int:
    if rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        if how == "user":
            raise ConfigError("l1.num_pages: made up for the test")
        raise RuntimeError("boom")
    t = torch.ones(1)
    all_reduce(t)  # rank 0 waits for the peer that never comes
    return int(t.item())


@pytest.mark.parametrize("how, words, cause", [
    ("sigkill", "rank 1 was killed by SIGKILL (the kernel's OOM killer", None),
    ("exit", "rank 1 exited with code 3 without a result", None),
    ("user", "rank 1 failed: ConfigError: l1.num_pages: made up", ConfigError),
])
def test_a_dead_rank_is_named_and_the_others_stopped(how, words, cause):
    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        launch(2, _one_rank_fails, how, timeout_s=GROUP_TIMEOUT)
    assert e.value.rank == 1 and words in str(e.value)
    assert "\n" not in str(e.value)
    assert (type(e.value.cause) if e.value.cause else None) is cause
    if cause:
        assert "Traceback" in e.value.detail  # kept for HICACHE_DEBUG, not printed by default
    # rank 0 was killed, not left to hit the group timeout
    assert time.monotonic() - t0 < GROUP_TIMEOUT / 2


def _rank_sum(rank: int, world: int) -> int:
    t = torch.tensor([rank + 1.0])
    all_reduce(t)
    return int(t.item())


def test_a_store_port_taken_before_rank_0_listens_is_tried_again(monkeypatch):
    # free_port() hands out a port another process binds before rank 0's store listens on
    # it (a parallel test, say): the ranks start again on a fresh port instead of failing
    import socket

    import hicache.distributed as hd
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = hd.free_port
        monkeypatch.setattr(hd, "free_port", lambda: ports.pop() if ports else real())
        assert launch(2, _rank_sum, timeout_s=60) == [3, 3]
        assert ports == []  # the taken port was handed out first


def test_run_guarded_prints_one_line_per_failure(capsys):
    from hicache.commands.cli import run_guarded

    def dies(_):
        raise RankError(1, "was killed by SIGKILL")

    def user(_):
        raise RankError(0, "failed: ConfigError: x", "Traceback ...", ConfigError("l1.x: bad"))

    assert run_guarded(dies, None) == 1
    assert capsys.readouterr().err == \
        "error: rank 1 was killed by SIGKILL; the other ranks were stopped\n"
    assert run_guarded(user, None) == 2
    assert capsys.readouterr().err == "error: rank 0: l1.x: bad\n"


def test_clean_exit_prints_nothing():
    """Finished ranks exit 0 without "terminate called" or "Fatal Python error" (ranks leave
    with os._exit after destroying the group); run in a child so its stderr can be read."""
    code = textwrap.dedent("""
        from hicache.distributed import launch
        from tests.test_launch import _busy_rank
        print(launch(2, _busy_rank, timeout_s=60))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       cwd=root, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[2, 2]"
    for bad in ("terminate called", "Fatal Python error", "Traceback"):
        assert bad not in r.stderr


def _busy_rank(rank: int, world: int) -> int:
    import threading
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a thread still alive at exit
    t = torch.ones(1)
    all_reduce(t)
    return int(t.item())
