"""A non-editable install works: the wheel built from this tree, installed in a fresh venv, runs
``hicache check-config`` and ``hicache-bench`` with the policy it ships; a missing optional
dependency is one line saying what to install; the weights signature writes nothing (never in the
model directory)."""

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import policy_toml

ROOT = Path(__file__).resolve().parent.parent
PIP_LINE = "pip install 'hicache[redis]'"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh venv holding hicache from its wheel only (its dependencies, torch included,
    come from this interpreter's site-packages by path; the source tree is not on its path)."""
    d = tmp_path_factory.mktemp("pkg")
    wheels = d / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   cwd=d, timeout=300)
    whl = next(wheels.glob("hicache-*.whl"))
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # without PYTHONPATH: a source tree on it holds hicache.egg-info (the wheel build above
    # writes it), and pip would take hicache as installed already and skip the wheel
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(whl)], check=True, timeout=300, env=_no_pythonpath())
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path("
                              "'purelib'))"], capture_output=True, text=True,
                             check=True, env=_no_pythonpath()).stdout.strip()
    deps = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")]
            if os.path.isdir(p)]
    # plain path lines: the editable install's own .pth hook there is not run
    (Path(purelib) / "zz_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    return venv, whl, d


def _no_pythonpath() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def run(venv, *args, cwd):
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], capture_output=True,
                          text=True, cwd=cwd, env=_no_pythonpath(), timeout=600)


def test_wheel_ships_the_policy_and_runs_both_commands(fresh):
    venv, whl, d = fresh
    import zipfile
    names = zipfile.ZipFile(whl).namelist()
    assert "hicache/policy.toml" in names
    assert zipfile.ZipFile(whl).read("hicache/policy.toml") == \
        (ROOT / "examples" / "policy.toml").read_bytes()
    where = run(venv, "python", "-c", "import hicache, hicache.paths as p; "
                "print(hicache.__file__); print(p.default_policy())", cwd=d)
    assert where.returncode == 0, where.stderr
    mod, policy = where.stdout.split()
    assert mod.startswith(str(venv)) and policy.startswith(str(venv))  # not the source tree
    cc = run(venv, "hicache", "check-config", "--json", cwd=d)
    assert cc.returncode == 0, cc.stderr
    info = json.loads(cc.stdout)
    assert info["file"] == policy and info["policy"]["parallel"]["dcp"] >= 1
    out = d / "bench.json"
    b = run(venv, "hicache-bench", "--dcp", "1", "--modes", "l1", "--workload", "chat",
            "--scale", "0.01", "--max-output", "2", "--no-progress", "--l3-path",
            str(d / "l3"), "--out", str(out), cwd=d)
    assert b.returncode == 0, b.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [m["name"] for m in report["modes"]] == ["l1"]
    assert report["modes"][0]["prompt_tokens"] > 0


def test_check_config_without_a_file_uses_the_example(capsys):
    from hicache.commands.cli import main
    from hicache.paths import default_policy
    assert main(["check-config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == str(default_policy())
    assert default_policy().read_bytes() == (ROOT / "examples" / "policy.toml").read_bytes()


@pytest.fixture
def no_redis(monkeypatch):
    """The optional redis client as if not installed (``import redis`` raises ImportError)."""
    for name in list(sys.modules):
        if name == "redis" or name.startswith("redis."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)


def test_missing_redis_client_is_one_line_from_preflight(tmp_path, no_redis, capsys):
    from hicache.commands.cli import main
    f = tmp_path / "policy.toml"
    f.write_text(policy_toml(tmp_path / "l3", l3={"backend": "redis",
                                                 "url": "redis://127.0.0.1:6379/0"}))
    assert main(["check-config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and PIP_LINE in err[0] and "l3.backend" in err[0]


def test_missing_redis_client_is_one_line_from_the_adapters(tmp_path, no_redis):
    from hicache.errors import L3Error
    from hicache.integrations.common import open_stores
    from hicache.l3 import Namespace
    ns = Namespace(model="m", num_layers=1, kv_dim=8, dtype="uint8", page_size=1, dcp_size=1)
    with pytest.raises(L3Error, match=r"pip install 'hicache\[redis\]'"):
        open_stores("redis://127.0.0.1:6379/0", ns, [0])
    open_stores(str(tmp_path / "l3"), ns, [0])[0].close()  # LMDB needs no extra


def _checkpoint(d: Path) -> Path:
    from safetensors.torch import save_file
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"w": torch.arange(16, dtype=torch.float32)}, str(d / "model.safetensors"))
    return d


def test_weights_signature_writes_nothing(tmp_path, monkeypatch):
    """A read-only model directory and an unwritable cache directory: the signature (headers
    and sampled bytes, no cache) writes nowhere and is the same each time."""
    from hicache.checkpoints import hf
    model = _checkpoint(tmp_path / "model")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("HICACHE_CACHE_DIR", str(blocked / "cache"))
    os.chmod(model, 0o555)  # a read-only model directory
    try:
        sig = hf.weights_signature(model)
        assert sig.startswith("xxh3-128:") and hf.weights_signature(model) == sig
    finally:
        os.chmod(model, 0o755)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
