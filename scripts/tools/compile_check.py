"""Compile the decode attention kernels and the batch-invariant GEMM for an H100/H200 (sm_90) on a machine
without a GPU, and report what ptxas says of each: registers per thread, spill bytes, shared memory, and
whether the loads are pipelined (cp.async). One JSON line per kernel config.

Triton compiles ahead of time for a GPUTarget, and its wheel carries ptxas, so a kernel that would not
compile, or that spills, shows here before any device time is spent on it (the interpreter, which the
CPU tests use, checks the logic, not the compiled code). The figures follow this machine's Triton, which
may differ from the device's.

    python3 scripts/tools/compile_check.py                    # every config below
    python3 scripts/tools/compile_check.py --kernels verify_rows --warps 4 8
    pip install --target /tmp/t36 triton==3.6.0 && PYTHONPATH=/tmp/t36:. python3 scripts/tools/compile_check.py
                                                        # the device's Triton (docs/dev/benchmark-log.md's header)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inference.layers.gemm_invariant import BLOCK_M, pick_tiles
from inference.layers.gemm_invariant_kernels import _invariant_gemm_kernel
from inference.layers.triton_attention_kernels import _paged_attention_kernel

# (q heads per kv head, head_dim) of the two shapes the benchmarks use
SHAPES = {"qwen2-0.5b": (7, 64), "qwen2.5-7b": (7, 128)}
_COMMON = {"PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 8, "SPLIT_TILES": 2, "HAS_WINDOW": False,
           "DOT_PRECISION": "tf32", "DOT_UPCAST": False, "PDL": True, "SEGMENT": 0}
_MODE = {"SPLIT_TILES": 8, "SEGMENT": 8}  # the batch-invariant mode's key segments (TritonAttentionTiles.segment_tiles)
KERNELS = {  # name: (kernel, its own constexprs besides _COMMON, GROUP and HEAD_DIM)
    "decode": (_paged_attention_kernel, {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_B": 1,
                                         "IS_DECODE": True, "MULTI_ROW": False}),
    "verify_rows": (_paged_attention_kernel, {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_B": 1,
                                              "IS_DECODE": True, "MULTI_ROW": True}),
    # the mode: decode and verify split by segment (the fold merge), prefill folding the segments itself
    "mode_verify_rows": (_paged_attention_kernel, {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_B": 1,
                                                   "IS_DECODE": True, "MULTI_ROW": True, **_MODE}),
    "mode_prefill": (_paged_attention_kernel, {"GROUP_PAD": 8, "BLOCK_Q": 2, "BLOCK_B": 16, "NUM_SPLITS": 1,
                                               "IS_DECODE": False, "MULTI_ROW": False, **_MODE}),
}


_FP32 = ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "cs_ptr", "part_ptr")
_INT32 = ("counter_ptr", "slot_ptr", "ctx_ptr", "bt_ptr", "cu_q_ptr", "pos_ptr")
_GEMM_SHAPES = {"qwen2-0.5b": {"qkv": (1152, 896), "gate_up": (9728, 896), "down": (896, 4864)},
                "qwen2.5-7b": {"qkv": (4608, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}}
# batch-invariant GEMM configs: (projection, its own constexprs)
GEMMS = {"inv_gemm": ("qkv", {"HAS_BIAS": True})}


def signature(kernel: Any) -> dict[str, str]:
    """Argument types as the engine launches them: bf16 tensors, fp32 partials, rope table and eps, int32
    metadata and counters."""
    types = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if "constexpr" in str(param.annotation):
            types[name] = "constexpr"
        elif name in _FP32:
            types[name] = "*fp32"
        elif name in _INT32:
            types[name] = "*i32"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        elif name in ("qk_scale", "eps"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def aligned(kernel: Any) -> dict[tuple[int], list[list[Any]]]:
    """The specialization the JIT gives these launches on the device: every tensor's address and every
    stride a multiple of 16 (Triton marks such arguments `tt.divisibility` 16 and then vectorizes and
    pipelines their loads; without the hint a compile here reads bf16 one element at a time)."""
    names = list(inspect.signature(kernel.fn).parameters)
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
            if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "k_per_split")}


def compile_report(kernel: Any, constexprs: dict[str, Any], warps: int, stages: int = 2) -> dict[str, Any]:
    """Compile for sm_90 and run the wheel's ptxas -v on the PTX: registers, spills, shared memory."""
    names = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(fn=kernel, signature=signature(kernel),
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned(kernel))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    bin_dir = Path(nvidia.__file__).parent / "bin"
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    ptx_text = compiled.asm["ptx"]
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else 0,
            "spill_load_bytes": int(spill.group(2)) if spill else 0, "shared_bytes": compiled.metadata.shared,
            # pipelined loads (cp.async into shared memory) against loads through registers
            "async_copies": len(re.findall(r"cp\.async\.c[ag]", ptx_text)),
            "global_loads": len(re.findall(r"ld\.global", ptx_text))}


def gemm_constexprs(name: str, shape: str, num_sms: int = 132) -> tuple[dict[str, Any], int, int]:
    """The batch-invariant GEMM's constexprs for `name`'s projection of `shape`, as its launch picks them
    on an H200 (132 SMs): (constexprs, num_warps, num_stages)."""
    proj, own = GEMMS[name]
    n, k = _GEMM_SHAPES[shape][proj]
    t = pick_tiles(n, k, num_sms)
    flags = {"HAS_BIAS": False, **own}
    return ({**flags, "PARTIAL": t.split_k > 1, "BLOCK_M": BLOCK_M,
             "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": t.group_m, "PDL": True}, t.num_warps, t.num_stages)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", default=[*KERNELS, *GEMMS], choices=[*KERNELS, *GEMMS])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rope", choices=["on", "off", "both"], default="both")
    args = ap.parse_args(argv)
    rows = []
    for name in [k for k in args.kernels if k in GEMMS]:  # at their own tiles and warps
        for shape in args.shapes:
            const, warps, stages = gemm_constexprs(name, shape)
            split = pick_tiles(*_GEMM_SHAPES[shape][GEMMS[name][0]], 132).split_k
            row = {"bench": "compile_check", "kernel": name, "shape": shape, "num_warps": warps, "target": "sm_90a",
                   "triton": triton.__version__, "split": split, "block_n": const["BLOCK_N"],
                   **compile_report(_invariant_gemm_kernel, const, warps, stages)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    for name in [k for k in args.kernels if k in KERNELS]:
        kernel, own = KERNELS[name]
        for shape in args.shapes:
            group, dim = SHAPES[shape]
            for rope in {"on": [True], "off": [False], "both": [True, False]}[args.rope]:
                for warps in args.warps:
                    const = {**_COMMON, **own, "GROUP": group, "HEAD_DIM": dim, "HEAD_DIM_PAD": dim, "ROPE": rope}
                    row = {"bench": "compile_check", "kernel": name, "shape": shape, "rope": rope, "num_warps": warps,
                           "target": "sm_90a", "triton": triton.__version__, **compile_report(kernel, const, warps)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


if __name__ == "__main__":
    main()
