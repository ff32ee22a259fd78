"""Every bad input a user can give the commands: exit 2, one line naming what is wrong, no
traceback, decided before any rank is spawned (the table runs the commands in process: an
escaping exception fails the test; a few cases also run as real subprocesses)."""

import os
import subprocess
import sys

import pytest

from hicache.commands import bench as bench_cli, cli

from helpers import policy_toml


@pytest.fixture
def files(tmp_path):
    """Named inputs the table refers to as {name}."""
    f = {"tmp": str(tmp_path)}

    def put(name, data, text=True):
        p = tmp_path / name
        (p.write_text if text else p.write_bytes)(data)
        f[name.replace(".", "_")] = str(p)

    base = policy_toml(tmp_path / "l3", page_size=8)
    put("policy.toml", base)
    put("a_file", "x")
    for name, extra in [
        ("rope0.toml", "[model]\nrope_dim = 0\n"),
        ("ropeodd.toml", "[model]\nrope_dim = 7\n"),
        ("heads.toml", "[model]\nnum_heads = 3\n[parallel]\ntp = 2\ndcp = 2\n"),
        ("pin.toml", '[l2]\npin = "on"\n'),
        ("l3file.toml", f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/a_file"\n'),
        ("l3proc.toml", '[l3]\nenabled = true\n[l3.lmdb]\npath = "/proc/self/l3"\n'),
        ("l3empty.toml", '[l3]\nenabled = true\n[l3.lmdb]\npath = ""\n'),
        ("l3nul.toml", '[l3]\nenabled = true\n[l3.lmdb]\npath = "x\\u0000y"\n'),
        ("rationan.toml", "[l2]\nratio = nan\n"),
        ("timeoutnan.toml", "[policy]\nprefetch_timeout_s = nan\n"),
        ("huge.toml", "[model]\nnum_layers = 1024\nkv_lora_rank = 65536\n[l1]\nnum_pages = 1000000\n"),
        ("l3small.toml", "[model]\nnum_layers = 64\nkv_lora_rank = 4096\n[l3]\nenabled = true\n[l3.lmdb]\n"
                         f'size_bytes = 1048576\npath = "{tmp_path}/l3s"\n'),
        ("preset.toml", '[model]\npreset = "deepseek-r1"\n[l1]\nnum_pages = 10000000\n'),
    ]:
        put(name, extra)
    put("latin1.toml", "[l3.lmdb]\npath = 'caf\u00e9'\n".encode("latin-1"), text=False)
    put("nol2.toml", policy_toml(tmp_path / "l3", page_size=8, l2_ratio=0.0))
    put("latin1.jsonl", '{"tokens": [1]}\n{"session": "caf\u00e9"}\n'.encode("latin-1"),
        text=False)
    put("len11.jsonl", '{"length": 1e11}\n')
    put("lenhuge.jsonl", '{"length": 100000000000}\n')
    put("bigid.jsonl", '{"tokens": [1, 100000000000000000000000]}\n')
    put("toolong.jsonl", '{"length": 20}\n{"length": 5000, "output_len": 4}\n')
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nothing ever writes to it: reading it must not block
    f["fifo"] = str(fifo)
    return f


def bench(*args):
    return ("bench", ["--config", "{policy_toml}", "--no-progress", "--workload", "chat",
                      "--scale", "0.01", *args])


def hc(*args):
    return ("hicache", list(args))


CASES = [
    # check-config checks what the service checks
    (hc("check-config", "{rope0_toml}"), 2, "model.rope_dim: 0 is out of range"),
    (hc("check-config", "{ropeodd_toml}"), 2, "model.rope_dim: 7 is odd"),
    (hc("check-config", "{heads_toml}"), 2, "model.num_heads: 3 is not divisible by parallel.dcp"),
    (hc("check-config", "{pin_toml}"), 2, 'l2.pin: "on" needs CUDA'),
    (hc("check-config", "{l3file_toml}"), 2, "exists and is not a directory"),
    (hc("check-config", "{l3proc_toml}"), 2, "is under /proc"),
    (hc("check-config", "{l3empty_toml}"), 2, "l3.lmdb.path: is empty"),
    (hc("check-config", "{l3nul_toml}"), 2, "l3.lmdb.path: 'x\\x00y' contains a NUL"),
    (hc("check-config", "{rationan_toml}"), 2, "l2.ratio: nan is out of range"),
    (hc("check-config", "{timeoutnan_toml}"), 2, "policy.prefetch_timeout_s: nan is out of range"),
    (hc("check-config", "{huge_toml}"), 2, "memory: 1 rank(s) on this node need"),
    (hc("check-config", "{l3small_toml}"), 2, "l3.lmdb.size_bytes: 1048576 is smaller than one page"),
    (hc("check-config", "{preset_toml}"), 2, "memory: 1 rank(s) on this node need"),
    (hc("check-config", "{latin1_toml}"), 2, "the policy file is not UTF-8 text"),
    (hc("check-config", "{fifo}"), 2, "must be a regular file, but this is a FIFO"),
    (hc("check-config", "/dev/zero"), 2, "must be a regular file, but this is a device"),
    (hc("check-config", "{nol2_toml}"), 0, "warning: l3.enabled with 0 L2 pages (l2.ratio"),
    (hc("check-config", "--ranks", "0", "{policy_toml}"), 2, "--ranks must be in [1, 4096]"),
    # plan and decode arguments
    (hc("plan", "--model", "deepseek-r1", "--tp", "8", "--memory", "nan"), 2,
     "--memory (GiB) must be in (0, 1073741824], got nan"),
    (hc("plan", "--model", "deepseek-r1", "--tp", "8", "--memory", "0"), 2, "--memory (GiB)"),
    (hc("decode", "--timeout", "0"), 2, "--timeout must be a number of seconds in (0, 86400]"),
    (hc("decode", "--timeout", "-1"), 2, "--timeout must be"),
    (hc("decode", "--timeout", "nan"), 2, "got nan"),
    (hc("decode", "--page-size", "100000000"), 2, "--page-size must be in [1, 65536]"),
    # hicache-bench arguments: all decided before the run
    (bench("--modes", ","), 2, "--modes: no name given in ','"),
    (bench("--workload", ","), 2, "--workload: no name given in ','"),
    (bench("--seed", "-1"), 2, "--seed must be in [0, 9223372036854775807], got -1"),
    (bench("--seed", str(10 ** 26)), 2, "--seed must be in [0, 9223372036854775807]"),
    (bench("--duration", "nan"), 2, "--duration (seconds) must be in [0, 2592000], got nan"),
    (bench("--l3-path", ""), 2, "l3.lmdb.path: is empty"),
    (bench("--scale", "5"), 2, "--scale must be in (0, 4], got 5.0"),
    (bench("--max-output", "-1"), 2, "--max-output must be in [0,"),
    (bench("--plot", "{tmp}"), 2, "is a directory; give a file name"),
    (bench("--plot", "{tmp}/plot"), 2, "has no supported extension; use one of .png"),
    (bench("--plot", "/proc/self/x.png"), 2, "--plot: '/proc/self/x.png' is under /proc"),
    (bench("--out", "{tmp}"), 2, "--out: '{tmp}' is a directory"),
    (bench("--out", "/proc/x.json"), 2, "--out: '/proc/x.json' is under /proc"),
    (bench("--out", "{a_file}/x.json"), 2, "--out: cannot create directory"),
    (bench("--out", "{fifo}"), 2, "the --out file must be a regular file, but this is a FIFO"),
    (bench("--plot", "{fifo}"), 2, "the --plot file must be a regular file, but this is a FIFO"),
    (bench("--trace", "{latin1_jsonl}"), 2, "latin1.jsonl:2: not UTF-8 text"),
    (bench("--trace", "/dev/zero"), 2, "a trace must be a regular file, but this is a device"),
    (bench("--trace", "{fifo}"), 2, "a trace must be a regular file, but this is a FIFO"),
    (bench("--trace", "{len11_jsonl}"), 2, "len11.jsonl:1: 'length' must be an int"),
    (bench("--trace", "{lenhuge_jsonl}"), 2, "'length' must be an int in [1, 16777216]"),
    (bench("--trace", "{bigid_jsonl}"), 2, "'tokens'[1] = 100000000000000000000000 is outside"),
    (bench("--trace", "{toolong_jsonl}"), 2,
     "request 2: request needs 5004 tokens of KV (prompt 5000 + output 4) but L1 holds 192"),
    (bench("--config", "{preset_toml}"), 2, "memory: 1 rank(s) on this node need"),
]


def _run(kind, argv, capsys):
    main = cli.main if kind == "hicache" else bench_cli.main
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command, code, line", CASES,
                         ids=[" ".join(c[0][1][-2:]) for c in CASES])
def test_bad_input_is_one_line(files, capsys, command, code, line):
    kind, argv = command
    argv = [a.format(**files) for a in argv]
    line = line.format(**files)
    rc, out, err = _run(kind, argv, capsys)
    assert rc == code, (argv, out, err)
    assert "Traceback" not in out + err
    errs = [x for x in err.splitlines() if x.strip()]
    if code == 2:
        assert len(errs) == 1, errs
    assert any(line in x for x in errs), (line, errs)


@pytest.mark.parametrize("argv, line", [
    (["hicache.commands.cli", "check-config", "{fifo}"], "this is a FIFO"),
    (["hicache.commands.bench", "--trace", "/dev/zero"], "this is a device"),
    (["hicache.commands.cli", "decode", "--timeout", "nan"], "--timeout must be"),
])
def test_bad_input_as_a_real_process(files, argv, line):
    argv = [a.format(**files) for a in argv]
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                       timeout=120, cwd=files["tmp"])
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    (err,) = r.stderr.strip().splitlines()
    assert line in err


def test_out_parent_is_made_before_the_run(files, capsys):
    # a missing parent is created up front (a bad trace then stops the run before it starts)
    out = os.path.join(files["tmp"], "new", "dir", "r.json")
    rc, _, err = _run("bench", ["--config", files["policy_toml"], "--trace",
                                files["len11_jsonl"], "--out", out], capsys)
    assert rc == 2 and "len11.jsonl:1" in err
    assert os.path.isdir(os.path.dirname(out)) and not os.path.exists(out)
