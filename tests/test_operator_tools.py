"""Operator tools that never crash: ``l3 purge`` on an LMDB store whose map is full, ``l3 ls`` /
``l3 purge`` on a cluster with a dead master (one line, exit 3, what was reachable), ``l3 ls``
against planted namespace records (escaped, cut; ``--json`` raw), secret files that are kernel
files or too long, ``check-config`` with several errors, a closed pipe, and every metric name the
docs give against the metrics endpoint."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from hicache.commands import cli
from hicache.errors import ConfigError
from hicache.l3 import Namespace, auth, open_store, page_keys
from hicache.l3.auth import Trust
from hicache.l3.localserver import start_cluster

from helpers import secret_file

ROOT = Path(__file__).resolve().parents[1]
NS = Namespace("tools-test", num_layers=4, kv_dim=1024, dtype="float32", page_size=4,
               dcp_size=1)
OFF = Trust(authenticate=False)


def fill(where, pages: int, ns=NS, **kw) -> list:
    keys = page_keys(list(range(pages * ns.page_tokens)), ns.page_tokens, ns, 0)
    with open_store(where, ns, 0, trust=OFF, **kw) as s:
        for i in range(0, pages, 50):
            part = keys[i:i + 50]
            assert s.put(part, [torch.full(ns.shard_shape, float(j)) for j in
                                range(len(part))]).written == len(part)
    return keys


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_purge_of_a_full_lmdb_store_deletes_and_reports_the_space(tmp_path, capsys):
    """The bench's stores fill their map: opened with a map the size of the file, a delete had
    no room for its copy-on-write pages (MapFullError, nothing deleted)."""
    d = str(tmp_path / "l3")
    keys = fill(d, 300, capacity_bytes=64 << 20)
    size = os.path.getsize(os.path.join(d, "data.mdb"))
    assert size > 16 << 20
    rc, out, err = run_cli(capsys, "l3", "purge", d, "--namespace", NS.digest.hex())
    assert rc == 0 and err == "" and "300 keys" in out and "bytes freed" in out, (out, err)
    freed = int(re.search(r"([\d,]+) bytes freed", out).group(1).replace(",", ""))
    assert freed >= 300 * NS.shard_bytes
    with open_store(d, NS, 0, trust=OFF) as s:
        assert s.exists_prefix(keys) == 0
    rc, out, _ = run_cli(capsys, "l3", "ls", d)
    assert rc == 0 and out.strip() == "no namespaces"


def test_cluster_with_a_dead_master_is_one_line_and_exit_3(tmp_path, capsys):
    cl = start_cluster(str(tmp_path / "cluster"), masters=3)
    try:
        urls = ",".join(cl.urls)
        keys = fill(cl.urls, 60, ns=Namespace("cl", 2, 8, "float32", 4, 1))
        assert len(keys) == 60
        dead = cl.nodes[2]
        dead.kill()
        alive = [f"127.0.0.1:{n.port}" for n in cl.nodes[:2]]
        rc, out, err = run_cli(capsys, "l3", "ls", "--url", urls)
        assert rc == 3 and len(err.strip().splitlines()) == 1, err
        assert f"127.0.0.1:{dead.port} (refused) unreachable" in err
        assert all(a in err for a in alive) and "Traceback" not in err
        listed = int(out.split()[-2].replace(",", ""))  # keys column of the one namespace
        assert 0 < listed < 60  # what the two live masters hold
        rc, out, err = run_cli(capsys, "l3", "ls", "--url", urls, "--json")
        assert rc == 3 and json.loads(out)[0]["keys"] == listed
        digest = json.loads(out)[0]["namespace"]
        rc, out, err = run_cli(capsys, "l3", "purge", "--url", urls, "--namespace", digest)
        assert rc == 3 and len(err.strip().splitlines()) == 1 and "purge covered only" in err
        assert f"{listed} keys" in out
        for n in cl.nodes[:2]:
            with redis.Redis(port=n.port) as c:
                assert not [k for k in c.scan_iter(match=b"hicache:*")]
    finally:
        cl.stop()


def test_ls_escapes_and_cuts_what_others_wrote(tmp_path, redis_url, capsys):
    """A namespace record is written by anyone with write access: terminal escapes and a
    4 MiB name reach the screen escaped and cut; ``--json`` gives the record as written."""
    evil = "\x1b]0;pwned\x07\x1b[2J" + "m" * (4 << 20)
    ns = Namespace(evil, 2, 8, "float32", 4, 1)
    fill(redis_url, 3, ns=ns)
    rc, out, err = run_cli(capsys, "l3", "ls", "--url", redis_url)
    assert rc == 0 and "\x1b" not in out and "\x07" not in out, out[:200]
    assert "\\x1b]0;pwned\\x07" in out and len(out) < 2000
    assert f"({len(evil)} chars)" in out
    rc, out, _ = run_cli(capsys, "l3", "ls", "--url", redis_url, "--json")
    assert rc == 0 and json.loads(out)[0]["model"] == evil


def test_secret_files_are_real_files_read_whole(tmp_path):
    for path, says in (("/proc/self/environ", "on a proc file system"),
                       ("/proc/self/status", "on a proc file system")):
        with pytest.raises(ConfigError, match=says) as e:
            auth.read_secret(path, "l3.secret_file")
        assert "\n" not in str(e.value)
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        with pytest.raises(ConfigError, match="sysfs file system|not a regular file"):
            auth.read_secret("/sys/kernel/mm/transparent_hugepage/enabled", "x")
    with pytest.raises(ConfigError, match="not a regular file"):
        auth.read_secret("/dev/null", "x")
    long = tmp_path / "long.secret"
    long.write_bytes(b"k" * (auth.MAX_SECRET_BYTES + 1))
    os.chmod(long, 0o600)
    with pytest.raises(ConfigError, match=f"is {auth.MAX_SECRET_BYTES + 1} bytes; a secret is "
                                          f"at most {auth.MAX_SECRET_BYTES}"):
        auth.read_secret(str(long), "x")
    edge = tmp_path / "edge.secret"
    edge.write_bytes(b"a" * (auth.MAX_SECRET_BYTES - 1) + b"b")
    os.chmod(edge, 0o600)
    one_less = tmp_path / "one-less.secret"
    one_less.write_bytes(b"a" * (auth.MAX_SECRET_BYTES - 1) + b"c")
    os.chmod(one_less, 0o600)
    # read whole: the last byte counts
    assert auth.read_secret(str(edge), "x") != auth.read_secret(str(one_less), "x")
    assert auth.file_system(secret_file(tmp_path)) not in auth.PSEUDO_FS


def test_check_config_reports_every_error_at_once(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[policy]\nwrite = "sometimes"\n[l1]\nnum_pages = -3\nbogus = 1\n'
                   '[nosuch]\nx = 1\n')
    rc, out, err = run_cli(capsys, "check-config", str(bad))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    for says in ("4 errors", "policy.write: 'sometimes'", "l1.num_pages: -3 is out of range",
                 "l1.bogus: unknown key", "nosuch: unknown section"):
        assert says in err, (says, err)


@pytest.mark.parametrize("argv", [["check-config", "--json"], ["check-config"],
                                  ["plan", "--model", "deepseek-v3", "--tp", "8"]])
def test_a_closed_pipe_ends_quietly(argv):
    r, w = os.pipe()
    os.close(r)  # the reader (`| head`) is gone before the first write
    try:
        p = subprocess.run([sys.executable, "-m", "hicache.commands.cli", *argv], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(w)
    assert p.stderr == "" and p.returncode == 141, p.stderr[-500:]


# ---- every metric name the docs give exists where the docs say -------------------------------
def _doc_names(pattern: str, files) -> dict:
    """``{name: [file, ...]}`` of the metric names ``pattern`` finds in the docs, leaving out
    a paragraph that lists renamed (retired) series."""
    out: dict = {}
    for f in files:
        for para in Path(f).read_text().split("\n\n"):
            if "renamed" in para.lower():
                continue
            for m in re.finditer(pattern, para):
                out.setdefault(m.group(0), []).append(Path(f).name)
    return out


def _served_names(tmp_path) -> set:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hicache.engine.model import MLAModel
    from hicache.metrics import HiCacheMetrics
    from hicache.serving import Server, model_config
    from hicache.service import HiCache

    from helpers import make_cfg
    from test_service import revisit_trace
    cfg = make_cfg(tmp_path / "l3", l1_pages=24, l2_ratio=1.0, prefetch="wait_complete")
    torch.manual_seed(0)
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
        Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16, max_running=2) \
            .run(revisit_trace()[:4])
        cache.drain()
        text = generate_latest(HiCacheMetrics(cache).registry).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def test_every_metric_name_in_the_docs_is_served(tmp_path):
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    service = {n: f for n, f in _doc_names(r"(?<![\w:])hicache_[a-z0-9_]+", docs).items()
               if "integrations.md" not in f or len(f) > 1}
    served = _served_names(tmp_path)
    missing = {n: f for n, f in service.items() if n not in served}
    assert not missing, f"the docs name series the metrics endpoint does not serve: {missing}"
    # the engine adapters' series (docs/integrations.md) against the names their code registers
    sglang = (ROOT / "hicache/integrations/sglang.py").read_text()
    vllm = (ROOT / "hicache/integrations/vllm.py").read_text()
    own = {f"{n}_total" for n in re.findall(r'Counter\("(hicache_l3_\w+)"', sglang)}
    own |= {n for n in re.findall(r'"(vllm:kv_offload_hicache_l3_\w+)"', vllm)}
    own |= {f"{n}_total" for n in own if n.startswith("vllm:")} | \
        {f"{n}_bucket" for n in own if n.startswith("vllm:")}
    integ = _doc_names(r"(?:vllm:kv_offload_)?hicache_l3_[a-z0-9_]+(?!\*)",
                       [ROOT / "docs/integrations.md"])
    wrong = [n for n in integ if n not in own and n not in served and not n.endswith("_")]
    assert len(own) > 10 and not wrong, wrong
