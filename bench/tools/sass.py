"""Static SASS instructions per element of the conversion kernels, compiled for sm_90a on any machine.

    python bench/tools/sass.py                                  # every kernel below, both paths and each alone
    python bench/tools/sass.py fp8_to_mxfp4 --path fast --dump out.sass

No GPU needed: Triton compiles for GPUTarget("cuda", 90, 32) with the divisibility a real launch
specializes on (pointers and strides divisible by 16) and disassembles with its bundled cuobjdump.
Instructions per element = SASS lines / elements per thread of one program at the launcher's default
configuration, with the integer arguments marked divisible by 16 where they are at 32768 x 7168 (as
a launch of that shape specializes them). For a kernel with a per-program fast path and a general path,
``--path fast`` / ``general`` compiles a copy of its module with the branch condition replaced by
True / False, so the
count is the one path's straight-line code (the kernels have no loops). Static counts are a proxy:
the executed count (``bench/tools/instructions.py``, on a GPU) is what moves bandwidth, and it is higher by
the path test and the program-wide reductions (Triton 3.6, common path static vs executed on the
H100: MXFP4 -> FP8 6.3 vs 9.5, MXFP4 -> BF16 10.7 vs 11.2). Also reported: the TTGIR's layout
conversions, the elements of the largest tensor one of them moves (a data tile there is a round trip
through shared memory), the shared memory, the registers per thread (``cuobjdump -res-usage``: with
one-warp programs they set how many fit on an SM, 65536 / (32 x registers) up to 32), and the
local-memory loads and stores (register spills: at 10087 they made the one-warp column kernel 4.5x
slower, bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # what a launch uses (Triton 3.9 warns when unset)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

I32 = "i32"
# name: (module, kernel, pointer/int signature, constexprs, num_warps, elements per program, fast-path
# branch line (its start, inside the kernel), or per path the branch lines and their values (see
# path_branches), or None). Constexprs and warps are the launchers' defaults.
KERNELS = {
    "fp8_to_mxfp4": ("moe_fp4.kernels.mxfp4", "_fp8_to_mxfp4_kernel",
                     dict(q_ptr="*i32", s_ptr="*fp32", data_ptr="*i32", scale_ptr="*u8", M=I32, KB=I32, stride_qm=I32,
                          stride_sm=I32, stride_st=I32, stride_dm=I32, stride_om=I32),
                     dict(BLOCK_M=4, BLOCK_K=1024, ASM=True), 4, 4 * 1024, "    if tl.max(slow"),
    "mxfp4_to_fp8": ("moe_fp4.kernels.fp8", "_mxfp4_to_fp8_kernel",
                     dict(d_ptr="*i16", s_ptr="*u8", o_ptr="*i32", os_ptr="*fp32", M=I32, NT=I32, stride_dm=I32,
                          stride_sm=I32, stride_om=I32),
                     # its fast-path branch lives in triton_numerics.e2m1_words_to_e4m3:
                     # counted as a whole (the per-path copy swaps lines of the kernel's own module)
                     dict(BLOCK_M=4, TILES=4, ASM=True), 2, 4 * 4 * 128, None),
    "mxfp4_to_bf16": ("moe_fp4.kernels.mxfp4", "_dequantize_mxfp4_bf16_kernel",
                      dict(data_ptr="*u8", scale_ptr="*u8", out_ptr="*i32", M=I32, KB=I32, stride_dm=I32,
                           stride_sm=I32, stride_om=I32),
                      dict(BLOCK_M=2, BLOCK_K=1024), 2, 2 * 1024, "    if (tl.min(s_fin)"),
    "bf16_to_mxfp4": ("moe_fp4.kernels.mxfp4", "_quantize_mxfp4_kernel",
                      dict(x_ptr="*i32", data_ptr="*u8", scale_ptr="*u8", M=I32, KB=I32, stride_xm=I32,
                           stride_dm=I32, stride_sm=I32),
                      dict(IN_DTYPE=tl.bfloat16, BLOCK_M=4, BLOCK_K=1024, ASM=True), 2, 4 * 1024, None),
    "bf16_to_mxfp4_sr": ("moe_fp4.kernels.mxfp4", "_quantize_mxfp4_stochastic_kernel",
                         dict(x_ptr="*i32", data_ptr="*u8", scale_ptr="*u8", M=I32, KB=I32, stride_xm=I32,
                              stride_dm=I32, stride_sm=I32, seed="i64", step=I32, rank=I32),
                         dict(IN_DTYPE=tl.bfloat16, BLOCK_M=4, BLOCK_K=512), 4, 4 * 512, None),
    "bf16_to_nvfp4": ("moe_fp4.kernels.nvfp4", "_quantize_nvfp4_kernel",
                      dict(x_ptr="*i32", xs_ptr="*i32", data_ptr="*u8", scale_ptr="*u8", st_ptr="*fp32", M=I32,
                           KB=I32, stride_xm=I32, stride_xsm=I32, stride_xst=I32, stride_dm=I32, stride_sm=I32,
                           seed="i64", step=I32, rank=I32),
                      dict(IN_DTYPE=tl.bfloat16, STOCHASTIC=False, BLOCK_M=4, BLOCK_K=512), 4, 4 * 512, None),
    "fp8_to_nvfp4": ("moe_fp4.kernels.nvfp4", "_quantize_nvfp4_kernel",
                     dict(x_ptr="*i16", xs_ptr="*fp32", data_ptr="*u8", scale_ptr="*u8", st_ptr="*fp32", M=I32,
                          KB=I32, stride_xm=I32, stride_xsm=I32, stride_xst=I32, stride_dm=I32, stride_sm=I32,
                          seed="i64", step=I32, rank=I32),
                     dict(IN_DTYPE=tl.float8e4nv, STOCHASTIC=False, BLOCK_M=4, BLOCK_K=512), 4, 4 * 512, None),
    "nvfp4_to_fp8": ("moe_fp4.kernels.nvfp4", "_nvfp4_to_fp8_kernel",
                     dict(d_ptr="*u8", s_ptr="*u8", st_ptr="*fp32", o_ptr="*i16", os_ptr="*fp32", M=I32, NT=I32,
                          stride_dm=I32, stride_sm=I32, stride_om=I32, stride_st=I32),
                     dict(BLOCK_M=4, TILES=4, ASM=True), 4, 4 * 4 * 128, None),
    "nvfp4_to_fp8_colwise": ("moe_fp4.kernels.nvfp4", "_nvfp4_to_fp8_colwise_kernel",
                             dict(d_ptr="*u8", s_ptr="*u8", st_ptr="*fp32", o_ptr="*u8", os_ptr="*fp32", M=I32,
                                  K=I32, KB=I32, stride_dm=I32, stride_sm=I32, stride_st=I32),
                             dict(NB=4), 4, 128 * 4 * 16, None),
    "bf16_to_fp8": ("moe_fp4.kernels.fp8", "_quantize_fp8_kernel",
                    dict(x_ptr="*i32", fp8_ptr="*i16", fscale_ptr="*fp32", mx_ptr="*u8", mscale_ptr="*u8", M=I32,
                         NT=I32, stride_xm=I32, stride_fm=I32, stride_fsm=I32, stride_fst=I32, stride_mm=I32,
                         stride_msm=I32),
                    dict(IN_DTYPE=tl.bfloat16, WRITE_MXFP4=False, BLOCK_M=4, TILES=8, ASM=True), 2, 4 * 8 * 128, None),
    "bf16_to_fp8_mxfp4": ("moe_fp4.kernels.fp8", "_quantize_fp8_kernel",
                          dict(x_ptr="*i32", fp8_ptr="*i16", fscale_ptr="*fp32", mx_ptr="*u8", mscale_ptr="*u8",
                               M=I32, NT=I32, stride_xm=I32, stride_fm=I32, stride_fsm=I32, stride_fst=I32,
                               stride_mm=I32, stride_msm=I32),
                          dict(IN_DTYPE=tl.bfloat16, WRITE_MXFP4=True, BLOCK_M=2, TILES=8, ASM=True), 1, 2 * 8 * 128,
                          None),
    "mxfp4_to_fp8_colwise": ("moe_fp4.kernels.transpose", "_mxfp4_to_fp8_colwise_kernel",
                             dict(d_ptr="*u8", s_ptr="*u8", r_ptr="*i64", o_ptr="*u8", os_ptr="*fp32", M=I32, M4=I32,
                                  K=I32, KB=I32, stride_dm=I32, stride_sm=I32),
                             dict(NB=2, ASM=True, GATHER=False), 1, 128 * 64, "    if tl.min(e_low - e_top)"),
    "fp8_to_fp8_colwise": ("moe_fp4.kernels.transpose", "_fp8_to_fp8_colwise_kernel",
                           dict(q_ptr="*u8", s_ptr="*fp32", o_ptr="*u8", os_ptr="*fp32", M=I32, M4=I32, K=I32,
                                K4=I32),
                           dict(G=4, ASM=True), 1, 128 * 64,
                           # the float16 path runs first and the general path may rewrite its tile
                           {"fast": [("    if (not ok) or bad", "False")],
                            "general": [("    if ok", "False"), ("    if (not ok) or bad", "True")]}),
    "bf16_to_fp8_rows_cols": ("moe_fp4.kernels.transpose", "_cast_transpose_fp8_kernel",
                              dict(x_ptr="*i16", r_ptr="*u8", rs_ptr="*fp32", c_ptr="*u8", cs_ptr="*fp32", M=I32,
                                   K=I32),
                              dict(IN_DTYPE=tl.bfloat16, WRITE_ROWS=True, WRITE_COLS=True, TILE=128, SUB=128, TILES_K=1,
                                   ASM=True), 8, 128 * 128, None),
    # SwiGLU backward, h in bf16 / in MXFP4 decoded in registers: BLOCK_M rows x one chunk of BLOCK_W pairs
    "swiglu_bwd": ("moe_fp4.kernels.swiglu", "_swiglu_backward_kernel",
                   dict(h_ptr="*i32", da_ptr="*i32", w_ptr="*fp32", dh_ptr="*i32", dw_ptr="*fp32", M=I32, NT=I32,
                        stride_w=I32),
                   dict(HAS_W=True, BLOCK_M=2, BLOCK_W=256), 4, 2 * 2048 * 2, None),
    "swiglu_bwd_mxfp4": ("moe_fp4.kernels.swiglu", "_swiglu_backward_mxfp4_kernel",
                         dict(h_ptr="*u8", hs_ptr="*u8", da_ptr="*i32", w_ptr="*fp32", dh_ptr="*i32", dw_ptr="*fp32",
                              M=I32, NT=I32, stride_w=I32),
                         dict(HAS_W=True, BLOCK_M=2, BLOCK_W=256), 4, 2 * 2048 * 2, None),
    # Weights, one 128x128 block per program (16 warps): the quantizer, and AdamW fused with it (float32
    # weights and moments, bf16 gradient)
    "fp8_weight": ("moe_fp4.kernels.fp8", "_quantize_fp8_weight_kernel",
                   dict(w_ptr="*bf16", q_ptr="*u8", qt_ptr="*u8", s_ptr="*fp32", N=I32, K=I32, NB=I32, KB=I32),
                   dict(WRITE_Q=True, WRITE_T=True, BLOCK=128, ASM=True), 16, 128 * 128, None),
    "adamw_fp8_weight": ("moe_fp4.kernels.adamw", "_adamw_fp8_weight_kernel",
                         dict(p_ptr="*fp32", g_ptr="*bf16", m_ptr="*fp32", v_ptr="*fp32", q_ptr="*u8", qt_ptr="*u8",
                              s_ptr="*fp32", N=I32, K=I32, NB=I32, KB=I32, decay="fp32", beta1="fp32",
                              one_minus_beta1="fp32", beta2="fp32", one_minus_beta2="fp32", step_size="fp32",
                              bc2_sqrt="fp32", eps="fp32"),
                         dict(MAXIMIZE=False, BLOCK=128, CHUNK=32, ASM=True, WRITE_T=False), 16, 128 * 128, None),
}
# Integer arguments at the shape bench/tools/instructions.py profiles (32768 x 7168). A launch specializes
# an integer divisible by 16 (and the compiler then proves wider vector stores, e.g. the column
# kernels' rows of M bytes), so these are marked divisible exactly when their value is.
ARG_VALUES = {"M": 32768, "M4": 32768 // 4, "K": 7168, "K4": 7168 // 4, "KB": 7168 // 32, "NT": 7168 // 128}


def _module(name: str, branches: list[tuple[str, str]]):
    """The kernel module, or a copy of it with each (branch line start, value) condition replaced by
    value."""
    mod = importlib.import_module(name)
    if not branches:
        return mod
    src = open(mod.__file__).read()
    for branch, value in branches:
        at = src.index(branch)
        colon = src.index(":\n", at)
        src = src[:at] + re.match(r"\s*if ", branch).group(0) + value + src[colon:]
    value = "_".join(v for _, v in branches)
    path = os.path.join(tempfile.mkdtemp(), f"sass_{name.rsplit('.', 1)[1]}_{value}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"sass_{value}", path)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def path_branches(name: str, path: str) -> list[tuple[str, str]]:
    """The (branch line start, value) replacements that leave only ``path`` ("both", "fast" or
    "general") of kernel ``name``: a plain branch line is the fast path's test (True / False), a dict
    lists them per path."""
    branch = KERNELS[name][6]
    if path == "both":
        return []
    if branch is None:
        raise SystemExit(f"{name} has no fast/general branch; use --path both")
    if isinstance(branch, dict):
        return branch[path]
    return [(branch, {"fast": "True", "general": "False"}[path])]


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int):
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("stride") or ARG_VALUES.get(n, 1) % 16 == 0}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _cuobjdump(kernel, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass_text(kernel) -> str:
    return _cuobjdump(kernel, "--dump-sass")


def registers(kernel) -> int:
    """Registers per thread of the compiled kernel (-1 if cuobjdump does not say)."""
    m = re.search(r"REG:(\d+)", _cuobjdump(kernel, "-res-usage"))
    return int(m.group(1)) if m else -1


def count(name: str, path: str, dump: str | None = None) -> dict:
    mod_name, fn_name, sig, cx, warps, elems, branch = KERNELS[name]
    k = compile_sm90(getattr(_module(mod_name, path_branches(name, path)), fn_name), sig, cx, warps)
    text = sass_text(k)
    lines = [ln for ln in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+[A-Z@]", ln)]
    lines = [ln for ln in lines if not re.search(r"\*/\s+NOP\b", ln)]
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    per_thread = elems / (32 * warps)
    ttgir = k.asm["ttgir"]
    # Elements of the largest tensor a layout conversion moves: per-block values are small; a data
    # tile here means a round trip of the data through shared memory.
    moved = [math.prod(int(d) for d in m.group(1).split("x")[:-1])
             for m in re.finditer(r"ttg\.convert_layout %\S+ : tensor<([0-9x]+[a-z0-9]+),", ttgir)]
    return {"kernel": name, "path": path, "sass": len(lines), "elements_per_thread": per_thread,
            "per_element": len(lines) / per_thread, "convert_layout": ttgir.count("convert_layout"),
            "largest_convert": max(moved, default=0), "shared_bytes": k.metadata.shared, "registers": registers(k),
            "local": sum(1 for ln in lines if re.search(r"\*/\s+(@!?U?P\w+\s+)?(LDL|STL)\b", ln)),
            "triton": triton.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="*", metavar="KERNEL", help=f"any of {', '.join(KERNELS)} (default: all)")
    ap.add_argument("--path", choices=["both", "fast", "general", "all"], default="all")
    ap.add_argument("--dump", default=None, help="write the SASS of the (single) kernel and path here")
    a = ap.parse_args()
    unknown = [k for k in a.kernels if k not in KERNELS]
    if unknown:
        ap.error(f"unknown kernel(s) {unknown}; choose from {list(KERNELS)}")
    a.kernels = a.kernels or list(KERNELS)
    print(f"triton {triton.__version__}, sm_90a; SASS instructions without NOPs, per element of one thread's share")
    print(f"{'kernel':<21} {'path':<8} {'SASS':>6} {'elem/thread':>11} {'per elem':>8} {'convert_layout':>14} "
          f"{'largest':>8} {'shared B':>8} {'regs':>5} {'local':>6}")
    for name in a.kernels:
        paths = ["both", "fast", "general"] if a.path == "all" else [a.path]
        if KERNELS[name][6] is None:
            paths = ["both"]
        for p in paths:
            r = count(name, p, a.dump)
            print(f"{name:<21} {p:<8} {r['sass']:>6} {r['elements_per_thread']:>11.0f} {r['per_element']:>8.2f} "
                  f"{r['convert_layout']:>14} {r['largest_convert']:>8} {r['shared_bytes']:>8} {r['registers']:>5} "
                  f"{r['local']:>6}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
