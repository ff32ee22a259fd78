"""Loud L3 failures: a run whose configured L3 failed says so in one warning line per rank
group (the store's URL without its password, the first error), counts the errors in the
table, exits 3 under ``--require-l3``; ``rediss://`` against a plaintext server turns L3 off at
the first handshake; passwords reach neither ``--out`` nor the logs; ``localserver`` refuses a
port that is in use."""

import json
import subprocess
import sys

import pytest

from hicache.commands import bench as bench_cli
from hicache.l3.localserver import free_port

from helpers import policy_toml, secret_file

PASSWORD = "hunter2-not-for-logs"


@pytest.fixture
def cfg_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_L3_SECRET_FILE", secret_file(tmp_path))
    f = tmp_path / "policy.toml"
    f.write_text(policy_toml(tmp_path / "l3", page_size=8, l2_ratio=1.0,
                             policy={"prefetch": "wait_complete", "l3_cost_model": False}))
    return f


def bench(cfg_file, tmp_path, url, *args):
    out = tmp_path / "run.json"
    rc = bench_cli.main(["--config", str(cfg_file), "--workload", "chat", "--scale", "0.01",
                         "--max-output", "2", "--no-progress", "--modes", "l1,l1+l2+l3",
                         "--l3-url", url, "--out", str(out), *args])
    return rc, out.read_text() if out.exists() else ""


def test_a_failed_l3_is_one_warning_line_an_error_count_and_exit_3(cfg_file, tmp_path, capsys,
                                                                 caplog):
    url = f"redis://hicache:{PASSWORD}@127.0.0.1:{free_port()}/0"  # nobody listens there
    rc, text = bench(cfg_file, tmp_path, url)
    cap = capsys.readouterr()
    assert rc == 0
    warn = [ln for ln in cap.err.splitlines() if ln.startswith("warning: L3")]
    assert len(warn) == 1, cap.err  # one line for the one rank group that used L3
    assert "redis://hicache:***@127.0.0.1" in warn[0] and "l1+l2+l3" in warn[0]
    assert "first error: " in warn[0] and "refused" in warn[0].lower()
    header = next(ln for ln in cap.out.splitlines() if "ttft p50" in ln)
    assert "l3 err" in header
    report = json.loads(text)
    row = {m["name"]: m for m in report["modes"]}["l1+l2+l3"]
    assert row["l3_errors"] > 0 and row["l3_problem"]["ranks"] == [0]
    l1 = {m["name"]: m for m in report["modes"]}["l1"]
    assert l1.get("l3_errors", 0) == 0 and "l3_problem" not in l1
    for where in (text, cap.out, cap.err, caplog.text):
        assert PASSWORD not in where
    assert report["config"]["l3"]["redis"]["url"] == "redis://hicache:***@127.0.0.1:" \
        + url.rsplit(":", 1)[1]
    rc, _ = bench(cfg_file, tmp_path, url, "--require-l3")
    assert rc == 3
    assert "FAIL --require-l3" in capsys.readouterr().err


def test_rediss_against_a_plaintext_server_turns_l3_off_at_the_first_handshake(
        cfg_file, tmp_path, capsys, redis_factory):
    srv = redis_factory()  # plaintext, on a TCP port
    rc, text = bench(cfg_file, tmp_path, f"rediss://127.0.0.1:{srv.port}/0", "--require-l3")
    err = capsys.readouterr().err
    assert rc == 3
    warn = [ln for ln in err.splitlines() if ln.startswith("warning: L3")]
    assert len(warn) == 1 and "TLS handshake failed" in warn[0], err
    row = {m["name"]: m for m in json.loads(text)["modes"]}["l1+l2+l3"]
    # one failed handshake, then L3 is off: not one timeout per call for the whole run
    assert 1 <= row["l3_errors"] <= 2 and row["hit_tokens"]["l3"] == 0
    stats = row["final_stats"][0]
    assert stats["l3_failures"] == 1


def test_localserver_refuses_a_port_in_use(redis_factory):
    srv = redis_factory()
    r = subprocess.run([sys.executable, "-m", "hicache.l3.localserver", "--port", str(srv.port),
                        "--dir", srv.dir + "-second"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert f"port {srv.port} is in use" in line
    assert srv.proc.poll() is None  # the server that had the port is untouched
