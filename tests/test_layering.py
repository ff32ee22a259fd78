"""The layering, checked in fresh interpreters: each part is imported alone and the hicache
modules it pulled in are compared with what it may depend on.

- the tiers (l1, l2, l3) never import the controller, the service or the engine;
- the controller imports no tier (page ids come from the neutral ``hicache.pages``);
- the service never imports the engine (the engine reaches the cache through ``hicache.kvport``);
- the neutral modules (errors, checks, ids, pages, layout, kvport, page_format) import no tier, no
  controller, no service;
- the policy file (``hicache.config``), the L3 guard, the L3 package and the service import no
  L3 backend (neither a backend's module nor ``lmdb`` / ``redis``): a backend is imported when
  it is used (``hicache.l3.registry``).
"""

import json
import subprocess
import sys

import pytest

PROBE = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
         "print(json.dumps(sorted(m for m in sys.modules "
         "if m.split('.')[0] in ('hicache', 'lmdb', 'redis'))))")

ROOTS = ("hicache.errors", "hicache.checks", "hicache.ids", "hicache.pages",
         "hicache.layout", "hicache.kvport", "hicache.page_format", "hicache.l1", "hicache.l2",
         "hicache.l3", "hicache.controller", "hicache.service", "hicache.config",
         "hicache.l3.guard")


@pytest.fixture(scope="module")
def loaded() -> dict:
    """root -> the hicache modules a fresh interpreter holds after ``import root`` (all roots
    probed at once, each in its own interpreter)."""
    procs = {r: subprocess.Popen([sys.executable, "-c", PROBE, r], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for r in ROOTS}
    out = {}
    for root, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)  # 13 interpreters on a busy box
        assert p.returncode == 0, f"import {root} failed:\n{stderr}"
        out[root] = set(json.loads(stdout.strip().splitlines()[-1]))
    return out


def under(modules: set, *packages: str) -> list:
    return sorted(m for m in modules for p in packages if m == p or m.startswith(p + "."))


def test_the_probe_sees_what_a_module_imports(loaded):
    # the service holds every tier and the controller: the probe does see transitive imports
    assert under(loaded["hicache.service"], "hicache.controller")
    assert under(loaded["hicache.service"], "hicache.l1") and \
        under(loaded["hicache.service"], "hicache.l2")
    assert "hicache.pages" in loaded["hicache.controller"]


@pytest.mark.parametrize("tier", ["hicache.l1", "hicache.l2", "hicache.l3"])
def test_tiers_never_import_the_controller_service_or_engine(loaded, tier):
    assert under(loaded[tier], "hicache.controller", "hicache.service", "hicache.engine") == []


def test_the_controller_imports_no_tier(loaded):
    mods = loaded["hicache.controller"]
    assert under(mods, "hicache.l1", "hicache.l2", "hicache.l3", "hicache.service",
                 "hicache.engine") == []


def test_the_service_never_imports_the_engine(loaded):
    assert under(loaded["hicache.service"], "hicache.engine", "hicache.serving",
                 "hicache.pcp") == []


@pytest.mark.parametrize("neutral", ["hicache.errors", "hicache.checks",
                                     "hicache.ids", "hicache.pages", "hicache.layout",
                                     "hicache.kvport", "hicache.page_format"])
def test_neutral_modules_import_no_tier_controller_or_service(loaded, neutral):
    assert under(loaded[neutral], "hicache.l1", "hicache.l2", "hicache.l3",
                 "hicache.controller", "hicache.service", "hicache.engine") == []


def test_page_format_imports_only_errors_and_checks(loaded):
    # every tier reads its sizes from it: it must stay a leaf (pure, nothing heavier than torch)
    assert loaded["hicache.page_format"] <= {"hicache", "hicache.page_format", "hicache.errors",
                                             "hicache.checks"}


def l3_backends() -> tuple:
    """The modules of the L3 backends (registrations and stores) and their clients."""
    from hicache.l3 import registry
    return (*registry.BUILTIN.values(), "hicache.l3.store", "hicache.l3.redis_store",
            "hicache.l3.lmdb_check", "lmdb", "redis")


@pytest.mark.parametrize("root", ["hicache.config", "hicache.l3.guard", "hicache.l3",
                                  "hicache.service"])
def test_no_l3_backend_is_imported_before_it_is_used(loaded, root):
    assert under(loaded[root], *l3_backends()) == []


# ---- static rules: every import statement, lazy ones inside functions included ----------------

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

PKG = Path(__file__).resolve().parents[1] / "hicache"


def static_imports(part: str) -> dict[str, set[str]]:
    """module -> the hicache modules its import statements name (anywhere in the file), for
    ``part`` (a module like ``config`` or a package like ``engine``)."""
    target = PKG / part
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]
    out = {}
    for f in files:
        mod = "hicache." + ".".join(f.relative_to(PKG).with_suffix("").parts)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        names = set()
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - n.level + 1]
                                    + ([base] if base else []))
                names.update([base] + [f"{base}.{a.name}" for a in n.names])
        out[mod] = {m for m in names if m.split(".")[0] == "hicache"}
    return out


def reaches(part: str, *forbidden: str) -> list[str]:
    return sorted(f"{mod} -> {m}" for mod, names in static_imports(part).items() for m in names
                  for f in forbidden if m == f or m.startswith(f + "."))


def test_the_static_probe_sees_lazy_imports():
    # commands/decode imports the runner inside a function: the static probe must see it
    assert reaches("commands/decode", "hicache.engine.runner")


def test_the_kernels_import_no_engine():
    assert reaches("kernels", "hicache.engine", "hicache.pcp", "hicache.service") == []


def test_the_engine_core_imports_no_pcp_checkpoint_loader_or_cli():
    assert reaches("engine", "hicache.pcp", "hicache.checkpoints", "hicache.commands",
                   "hicache.service") == []


def test_pcp_imports_no_cli():
    assert reaches("pcp", "hicache.commands") == []


def test_checkpoint_config_reading_needs_no_engine():
    # config.json -> fields is pure (the policy file reads it for model.path)
    assert reaches("checkpoints/hf_config", "hicache.engine") == []


def test_the_soak_never_imports_the_bench_command():
    # the bench command runs the soak; what both need (the engine's model, the L3 backend) is
    # in the neutral hicache.commands.bench_model, so the arrow runs one way only
    assert reaches("commands/soak", "hicache.commands.bench") == []
    assert reaches("commands/bench_model", "hicache.commands.bench", "hicache.commands.soak") == []


def test_the_policy_file_imports_nothing_heavier_than_itself():
    # config.py may name the L3 registry (names only) and read config.json (pure): never the
    # engine, a tier, the controller, the service or an L3 backend's module
    assert reaches("config", "hicache.engine", "hicache.l1", "hicache.l2", "hicache.controller",
                   "hicache.service", "hicache.l3.store", "hicache.l3.redis_store",
                   "hicache.l3.lmdb_backend", "hicache.l3.redis_backend",
                   "hicache.checkpoints.hf") == []


def test_the_companions_import_no_service_engine_or_serving_loop():
    # a companion reaches its service only through the Host it is given: the service loops
    # over companions, never the other way round
    assert reaches("companions", "hicache.service", "hicache.facade", "hicache.tier_io",
                   "hicache.engine", "hicache.serving", "hicache.serving.hybrid") == []
    assert reaches("facade", "hicache.service", "hicache.engine", "hicache.serving") == []
