"""Compile the decode attention kernels for an H100/H200 (sm_90) on a machine without a GPU, and report what
ptxas says of each: registers per thread, spill bytes, shared memory. One JSON line per kernel config.

Triton compiles ahead of time for a GPUTarget, and its wheel carries ptxas, so a kernel that would not
compile, or that spills, shows here before any device time is spent on it (the interpreter, which the
CPU tests use, checks the logic, not the compiled code). The figures follow this machine's Triton, which
may differ from the device's.

    python3 scripts/compile_check.py                    # every config below
    python3 scripts/compile_check.py --kernels keys_once --warps 4 8
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout too

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inference.layers.triton_attention_kernels import _paged_attention_kernel
from inference.layers.verify_attention import _verify_attention_kernel

# (q heads per kv head, head_dim) of the two shapes the benchmarks use
SHAPES = {"qwen2-0.5b": (7, 64), "qwen2.5-7b": (7, 128)}
_COMMON = {"PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 8, "SPLIT_TILES": 2, "FUSED_COMBINE": True, "HAS_WINDOW": False,
           "DOT_PRECISION": "tf32", "DOT_UPCAST": False, "PDL": True}
KERNELS = {  # name: (kernel, its own constexprs besides _COMMON, GROUP and HEAD_DIM)
    "decode": (_paged_attention_kernel, {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_B": 1, "FUSED_STORE": True,
                                         "IS_DECODE": True, "MULTI_ROW": False}),
    "verify_rows": (_paged_attention_kernel, {"GROUP_PAD": 16, "BLOCK_Q": 1, "BLOCK_B": 1, "FUSED_STORE": True,
                                              "IS_DECODE": True, "MULTI_ROW": True}),
    "keys_once": (_verify_attention_kernel, {"GROUP_PAD": 8, "ROWS_PAD": 8, "NEW_PAD": 16}),
}


def signature(kernel: Any) -> dict[str, str]:
    """Argument types as the engine launches them: bf16 tensors, fp32 partials and rope table, int32 metadata."""
    types = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "k_ptr", "v_ptr"):
            types[name] = "*bf16"
        elif name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "cs_ptr"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        elif name == "qk_scale":
            types[name] = "fp32"
        else:
            types[name] = "constexpr" if name.isupper() else "i32"
    return types


def aligned(kernel: Any) -> dict[tuple[int], list[list[Any]]]:
    """The specialization the JIT gives these launches on the device: every tensor's address and every
    stride a multiple of 16 (Triton marks such arguments `tt.divisibility` 16 and then vectorizes and
    pipelines their loads; without the hint a compile here reads bf16 one element at a time)."""
    names = list(inspect.signature(kernel.fn).parameters)
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
            if n.endswith("_ptr") or n.startswith("stride")}


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


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rope", choices=["on", "off", "both"], default="both")
    args = ap.parse_args(argv)
    rows = []
    for name in args.kernels:
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
