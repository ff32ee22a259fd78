import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import HiCacheConfig, describe, load_config, loads
from hicache.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "policy.toml"


def test_example_loads_and_documents_every_key():
    cfg = load_config(EXAMPLE)
    assert cfg.parallel.dcp == 2 and cfg.page_tokens == 32
    text = EXAMPLE.read_text()
    for key, _default, _help in describe():
        section, name = key.rsplit(".", 1)
        assert f"[{section}]" in text and name in text, key


def test_defaults_and_derived():
    cfg = HiCacheConfig()
    assert cfg.policy.write == "write_through" and cfg.l2.layout == "page_first"
    assert cfg.model.kv_dim == 80
    assert cfg.l2_num_pages == 2 * cfg.l1.num_pages
    sized = cfg.replace(l2={"size_bytes": cfg.page_bytes_per_rank * 7})
    assert sized.l2_num_pages == 7
    r1 = loads('[model]\npreset = "deepseek-r1"\n[parallel]\ntp = 8\ndcp = 8')
    assert r1.model.num_layers == 61 and r1.model.kv_dim == 576
    assert r1.page_tokens == 128


@pytest.mark.parametrize("text, key, words", [
    ("[polcy]\nwrite='write_back'", "polcy", "did you mean 'policy'"),
    ("[policy]\nwrit='write_back'", "policy.writ", "did you mean 'write'"),
    ("[policy]\nwrite='write_backk'", "policy.write", "is not one of"),
    ("[l1]\nnum_pages='10'", "l1.num_pages", "expected int"),
    ("[l1]\nnum_pages=true", "l1.num_pages", "expected int"),
    ("[l3]\nenabled=1", "l3.enabled", "expected bool"),
    ("[l1]\nnum_pages=0", "l1.num_pages", "out of range"),
    ("[l2]\nratio=-1.0", "l2.ratio", "out of range"),
    ("[parallel]\ntp=8\ndcp=3", "parallel.dcp", "containment"),
    ("[parallel]\ntp=64\nattn_dp=4\ndcp=32", "parallel.dcp", "containment"),
    ("[parallel]\ntp=6\nattn_dp=4", "parallel.attn_dp", "tp % attn_dp"),
    ("[parallel]\ninterleave=3", "parallel.interleave", "multiple of interleave"),
    ("[model]\npreset='deepseek-r1'\nnum_layers=3", "model.num_layers", "conflicts"),
    ("[model]\npreset='gpt'", "model.preset", "is not one of"),
    ("policy = 3", "policy", "must be a table"),
    ("[policy\nwrite='x'", "TOML syntax error", "line 1"),
])
def test_bad_input_names_the_key(text, key, words):
    with pytest.raises(ConfigError) as e:
        loads(text)
    assert key in str(e.value) and words in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


def test_frozen():
    cfg = HiCacheConfig()
    with pytest.raises(Exception):
        cfg.l1.num_pages = 3  # type: ignore[misc]


class Ran:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run_cli(capsys):
    from hicache.commands.cli import main

    def run(*args):
        rc = main(list(args))
        out = capsys.readouterr()
        return Ran(rc, out.out, out.err)
    return run


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "hicache.commands.cli", "plan", "--model", "kimi-k2",
                        "--tp", "16", "--dcp", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "kimi-k2" in r.stdout


def test_cli_check_config_and_bad_input(tmp_path, run_cli):
    ok = run_cli("check-config", str(EXAMPLE))
    assert ok.returncode == 0, ok.stderr
    assert "effective_page_size: 32" in ok.stdout and "policy.write" in ok.stdout
    bad = tmp_path / "bad.toml"
    for text, key in [("[policy]\nwrite='often'", "policy.write"),
                      ("[l1]\nnum_pags=3", "l1.num_pags"),
                      ("[cache\n", "TOML syntax error"),
                      ("[parallel]\ntp=4\ndcp=8", "parallel.dcp")]:
        bad.write_text(text)
        r = run_cli("check-config", str(bad))
        assert r.returncode == 2, (text, r.stdout, r.stderr)
        assert key in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_cli_plan_table_and_json(run_cli):
    import json
    r = run_cli("plan", "--model", "deepseek-r1", "--tp", "8", "--memory", "40", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dcp_range"] == [1, 8] and out["duplication_without_dcp"] == 8
    rows = {row["dcp"]: row for row in out["rows"]}
    assert rows[8]["duplication"] == 1
    assert rows[8]["tokens_in_budget"] == 8 * rows[1]["tokens_in_budget"] or \
        abs(rows[8]["tokens_in_budget"] - 8 * rows[1]["tokens_in_budget"]) < 8
    t = run_cli("plan", "--shape", "gqa:94:4:128", "--tp", "8")
    assert t.returncode == 0 and "valid dcp in [1, 2]" in t.stdout
    for args, words in [(["--model", "qwen3-235b-a22b", "--tp", "8", "--dcp", "4"], "adds no GPUs"),
                        (["--shape", "mla:x", "--tp", "8"], "--shape"),
                        (["--tp", "8"], "--model"),
                        (["--model", "gpt", "--tp", "8"], "unknown model")]:
        r = run_cli("plan", *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
