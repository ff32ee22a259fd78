"""No 32-bit product of a token/page index and a stride in the compiled Triton kernels.

Both kernels are compiled for a CUDA target (sm_90) without a GPU, with every stride an i32
argument (the worst case: each stride fits in 32 bits, the product need not), and the TTIR is
checked by a small taint analysis: values derived from an index (a program id along an index
axis, a loop induction variable, an integer loaded from memory) and values derived from a stride
argument must never meet in an i32 ``arith.muli``. A deliberately bad kernel proves the check
can fail. The fp32 decode kernel's cubin is read with Triton's bundled cuobjdump: no stack
(register spills) at the launch config the wrapper picks. Runs in a subprocess so TRITON_INTERPRET is off and the cache is private.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

COMPILE = textwrap.dedent(r"""
    import json, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hicache.kernels.decode_attention import _latent_attn_kernel
    from hicache.kernels.page_copy import _page_copy_kernel

    @triton.jit
    def _bad_kernel(x_ptr, y_ptr, s_t, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + t * s_t + offs, tl.load(x_ptr + t * s_t + offs))

    def ttir(fn, types, consts):
        args = [a for a in fn.arg_names if a not in consts]
        sig = {a: types.get(a, "i32") for a in args}
        sig.update({a: "constexpr" for a in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        return {"ir": triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"],
                "args": args}

    def decode(indirect):  # indirect: keys are pool rows read through a row index
        return ttir(_latent_attn_kernel,
                    {"q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "kv_ptr": "*bf16",
                     "rows_ptr": "*i64", "q_pos_ptr": "*i64", "kv_pos_ptr": "*i64",
                     "o_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32"},
                    {"R": 512, "DR": 64, "BLOCK_H": 16, "BLOCK_R": 512, "BLOCK_DR": 64,
                     "BLOCK_N": 32, "DOT_FP32": False, "INDIRECT": indirect, "LOOP_LEN": 0})

    def stack_bytes(block_n, warps):  # fp32 decode kernel: bytes of stack (spills) per thread
        import os, subprocess, tempfile
        import triton.backends.nvidia as nv
        consts = {"R": 512, "DR": 64, "BLOCK_H": 16, "BLOCK_R": 512, "BLOCK_DR": 64,
                  "BLOCK_N": block_n, "DOT_FP32": True, "INDIRECT": False, "LOOP_LEN": 0}
        types = {"q_lat_ptr": "*fp32", "q_pe_ptr": "*fp32", "kv_ptr": "*fp32",
                 "rows_ptr": "*i64", "q_pos_ptr": "*i64", "kv_pos_ptr": "*i64",
                 "o_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32"}
        fn = _latent_attn_kernel
        sig = {a: types.get(a, "i32") for a in fn.arg_names if a not in consts}
        sig.update({a: "constexpr" for a in consts})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"),
                                  "-res-usage", f.name], capture_output=True, text=True,
                                 check=True).stdout
        return int(res.split("STACK:")[1].split()[0])

    from hicache.kernels.decode_attention import launch_config
    block_n, warps = launch_config(512, True)
    out = {
        "fp32_stack": stack_bytes(block_n, warps),
        "fp32_stack_4_warps": stack_bytes(32, 4),
        "decode": decode(False),
        "decode_indirect": decode(True),
        "page_copy": ttir(_page_copy_kernel,
                          {"src_ptr": "*bf16", "dst_ptr": "*bf16", "src_idx_ptr": "*i64",
                           "dst_idx_ptr": "*i64"}, {"BLOCK": 1024}),
        "bad": ttir(_bad_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 64}),
    }
    json.dump(out, sys.stdout)
""")

_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=\s*\"?([\w.]+)\"?(.*)$")
_REF = re.compile(r"%[\w.$-]+")
_AXES = {"x": 0, "y": 1, "z": 2}


def _strip_locs(line: str) -> str:
    # loc(...) may nest one level of parentheses: loc("name"(#loc3))
    return re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", line)


def narrow_index_stride_products(ir: str, arg_names: list, strides: set,
                                 index_axes: set) -> tuple[list, int]:
    """(i32 products of an index and a stride, count of such products done in i64)."""
    lines = [_strip_locs(line) for line in ir.splitlines() if not line.startswith("#loc")]
    taint: dict[str, set] = {}
    func = next(line for line in lines if "tt.func" in line)
    params = re.findall(r"(%[\w.$-]+):", func)
    for name, ssa in zip(arg_names, params):
        taint[ssa] = {"stride"} if name in strides else set()
    bad, wide = [], 0
    for line in lines:
        m = _DEF.match(line)
        if not m:
            continue
        res, op, rest = m.groups()
        body, _, typ = rest.rpartition(" : ") if " : " in rest else (rest, "", "")
        refs = [r for r in _REF.findall(body)]
        t: set = set()
        if op == "scf.for":  # %r = scf.for %iv = %lb to %ub step %s iter_args(%a = %init, ...)
            iv = re.match(r"\s*(%[\w.$-]+)\s*=\s*(%[\w.$-]+)\s+to\s+(%[\w.$-]+)", rest)
            taint[iv.group(1)] = {"index"} | taint.get(iv.group(2), set()) \
                | taint.get(iv.group(3), set())
            for a, init in re.findall(r"(%[\w.$-]+)\s*=\s*(%[\w.$-]+)", rest.split("iter_args")[-1]):
                taint[a] = set(taint.get(init, set()))
            continue
        for r in refs:
            t |= taint.get(r.split("#")[0], set())
        if op == "tt.get_program_id":
            axis = rest.split()[0]
            t = {"index"} if axis in index_axes else set()
        elif op == "tt.load" and "!tt.ptr<i" in typ:  # an integer read from memory (page ids)
            t = t | {"index"}
        taint[res] = t
        if op == "arith.muli" and len(refs) == 2:
            a, b = (taint.get(r, set()) for r in refs)
            if ("index" in a and "stride" in b) or ("stride" in a and "index" in b):
                if re.search(r"(^|x)i32>?\s*$", typ.strip()) or typ.strip() == "i32":
                    bad.append(line.strip())
                else:
                    wide += 1
    return bad, wide


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    work = tmp_path_factory.mktemp("kernel-ir")
    env["TRITON_CACHE_DIR"] = str(work / "cache")
    script = work / "compile_kernels.py"  # @triton.jit needs its source in a file
    script.write_text(COMPILE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_the_check_finds_a_32_bit_index_stride_product(compiled):
    c = compiled["bad"]
    bad, wide = narrow_index_stride_products(c["ir"], c["args"], {"s_t"}, {"x"})
    assert len(bad) >= 1 and wide == 0, (bad, wide)


@pytest.mark.parametrize("variant", ["decode", "decode_indirect"])
def test_decode_attention_kernel_offsets_are_64_bit(compiled, variant):
    c = compiled[variant]
    strides = {a for a in c["args"] if a.startswith("s_")} | {"split_len"}
    bad, wide = narrow_index_stride_products(c["ir"], c["args"], strides, {"x", "z"})
    assert bad == [], "32-bit index x stride products:\n" + "\n".join(bad)
    # t*s_qt, t*s_pt, sp*split_len, offs_n*s_kn, sp*s_os, t*s_ot, sp*s_ls, t*s_lt
    assert wide >= 8


def test_page_copy_kernel_offsets_are_64_bit(compiled):
    c = compiled["page_copy"]
    bad, wide = narrow_index_stride_products(c["ir"], c["args"], {"s_b", "s_r", "d_b", "d_r"},
                                             {"x", "y", "z"})
    assert bad == [], "32-bit index x stride products:\n" + "\n".join(bad)
    assert wide >= 4  # bb*s_b, si*s_r, bb*d_b, di*d_r


def test_fp32_decode_kernel_does_not_spill(compiled):
    """The fp32 (exact dot) decode kernel at the launch config the wrapper picks keeps its
    [16, 512] tiles in registers on sm_90: no stack; with 4 warps at 32 keys it spills KBs per
    thread (the measurement sees spills)."""
    assert compiled["fp32_stack"] == 0, compiled["fp32_stack"]
    assert compiled["fp32_stack_4_warps"] > 1024, compiled["fp32_stack_4_warps"]
