"""Compile the lerp kernels for sm_90 on a machine without a GPU, as a launch would specialise them.

The interpreter runs kernels as Python, so code that only fails when Triton compiles it for a GPU
(for example calling ``.to`` on an argument that Triton turned into a constant because it equals
1) passes every CPU test. This script plans real calls with the planning code (``_Plan``, with a
fake 132-SM device), builds each kernel's signature the way Triton's launcher specialises it
(integers equal to 1 become constants, multiples of 16 and 16-byte-aligned pointers get the
divisibility hint) and compiles it to a cubin for sm_90. Run in a process without
TRITON_INTERPRET; ``tests/test_lerp_compile.py`` does that.

    python tests/lerp_compile_check.py    # prints one line per kernel, exits 1 on a failure
    python tests/lerp_compile_check.py --sass /tmp/sass   # also each kernel's SASS, registers and
                                          # the position of its first global load
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import importlib  # noqa: E402

from flowexec.kernels import _lerp_triton  # noqa: E402

L = importlib.import_module("flowexec.kernels.lerp")  # the module (``flowexec.kernels.lerp`` is the function)

L._device_property = lambda device, name, default: {"multi_processor_count": 132, "L2_cache_size": 50 << 20}[name]
L._kernels = lambda device: _lerp_triton

CASES = {  # name: (x, y, w or None, dtype, config changes)
    "case1": ((16, 102400), (16, 102400), (1,), torch.float32, {}),
    "case2": ((16, 204800), (16, 204800), (1,), torch.float64, {}),
    "case3": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32, {}),
    "case3 plane": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float16, {"fwd_plane": True}),
    "case4": ((16, 102400), (16, 102400), (16, 102400), torch.bfloat16, {}),
    "case4 float32": ((16, 102400), (16, 102400), (16, 102400), torch.float32, {}),
    "case4 float32, no evict-first loads": ((16, 102400), (16, 102400), (16, 102400), torch.float32,
                                            {"flat3_evict": {}}),
    "flat float weight": ((16, 102400), (16, 102400), None, torch.float32, {}),
    "case3 without cache hints": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32, {"bwd_stream": False}),
    "case3 dx, dw flushed apart": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float64,
                                   {"bwd_joint_flush": False}),
    "case3 runtime divisions": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32, {"fast_div": False}),
    "case3 forward in tiles": ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32, {"fwd_plane": False}),
    "joint flush, column weight": ((1, 1), (7, 333), (333,), torch.float64, {}),
    "float weight": ((7, 333), (333,), None, torch.float32, {}),
    "big flat": ((2**31 + 8,), (2**31 + 8,), None, torch.float16, {}),
    "big planes": ((2, 3, 2**29 + 1, 3), (2, 3, 2**29 + 1, 3), (3, 1, 3), torch.float16, {"fwd_plane": True}),
}
PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}


def signature(fn, args: tuple, dtype: torch.dtype, n_ptrs: int, ptr_dtypes: dict[int, str]) -> ASTSource:
    assert len(args) == len(fn.params), f"{fn.__name__}: {len(args)} arguments for {len(fn.params)} parameters"
    sig, consts, attrs = {}, {}, {}
    for i, (p, v) in enumerate(zip(fn.params, args)):
        if i < n_ptrs or i in ptr_dtypes:
            sig[p.name] = ptr_dtypes.get(i, PTR[dtype])
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, bool) or (isinstance(v, int) and v == 1):
            sig[p.name] = "constexpr"  # what Triton's launcher does with an integer equal to 1
            consts[(i,)] = v
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)


SASS_DIR: str | None = None  # --sass: where to write each kernel's disassembly


def describe_sass(label: str, cubin: bytes) -> str:
    """Disassemble a cubin with the tools Triton bundles: registers per thread and the index of
    the first global load (what a program does before its first DRAM request)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    path = os.path.join(SASS_DIR, name + ".cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    with open(os.path.join(SASS_DIR, name + ".sass"), "w") as f:
        f.write(sass)
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                           capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    instrs = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]
    first = next((i for i, ln in enumerate(instrs) if "LDG" in ln), None)
    return f"{regs.group(1) if regs else '?'} registers, {len(instrs)} instructions, first load at {first}"


def compile_one(label: str, launcher, args: tuple, dtype: torch.dtype, n_ptrs: int, ptr_dtypes=None,
                ptx_has: str | None = None) -> bool:
    try:
        k = triton.compile(signature(launcher.fn, args, dtype, n_ptrs, ptr_dtypes or {}), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": launcher.num_warps})
        if ptx_has is not None and ptx_has not in k.asm["ptx"]:
            raise AssertionError(f"the PTX has no {ptx_has!r}")
        extra = f"  ({describe_sass(label, k.asm['cubin'])})" if SASS_DIR else ""
        print(f"ok      {label}{extra}")
        return True
    except Exception as e:  # report every kernel, then fail
        lines = [ln.strip() for ln in str(e).splitlines() if any(c.isalpha() for c in ln)]
        print(f"FAILED  {label}: {type(e).__name__}: {' | '.join(lines[-3:])[:400]}")
        return False


def main() -> int:
    ok = True
    for name, (xs, ys, ws, dtype, changes) in CASES.items():
        with L.configured(**changes):
            plan = L._Plan(torch.Size(xs), torch.Size(ys), torch.Size(ws) if ws is not None else None, dtype,
                           torch.device("cuda", 0))
            assert plan.use_triton, name
            acc_arg = 6 + len(plan.fwd_tail)
            ok &= compile_one(f"{name}: forward ({plan.fwd.fn.__name__})", plan.fwd,
                              plan.forward_args(0, 0, 0, 0, 0.25, 0.0), dtype, 4, {acc_arg: PTR[dtype]},
                              "evict_first" if name == "case4 float32" else None)
            needs = (True, True, ws is not None)
            bw = plan.backward_plan(needs)
            part = PTR[plan.part_dtype]
            ok &= compile_one(f"{name}: backward", bw.main, bw.main_args(*(0,) * 8, 0.25, 0.0), dtype, 8,
                              {7: part})
            if bw.final is not None:
                ok &= compile_one(f"{name}: final pass", bw.final, bw.final_args(0, 0, 0, 0), dtype, 4, {0: part})
            layout = plan.acc_layout()
            if layout is not None:  # the forward that zeroes the backward's buffer, the atomic backward
                ok &= compile_one(f"{name}: forward zeroing {layout[0]} elements", plan.fwd_zero,
                                  plan.forward_args(0, 0, 0, 0, 0.25, 0.0, torch.empty(layout[0])), dtype, 4,
                                  {acc_arg: PTR[dtype]})
                bwa = plan.backward_plan(needs, atomic=True)
                ok &= compile_one(f"{name}: atomic backward", bwa.main, bwa.main_args(*(0,) * 8, 0.25, 0.0), dtype, 8,
                                  {7: PTR[dtype]})
    for name in ("case1", "case2", "case3"):  # the atomic scheme applies where a final pass is saved
        xs, ys, ws, dtype, changes = CASES[name]
        plan = L._Plan(torch.Size(xs), torch.Size(ys), torch.Size(ws), dtype, torch.device("cuda", 0))
        if plan.acc_layout() is None:
            print(f"FAILED  {name}: no atomic scheme planned")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    if "--sass" in sys.argv:
        SASS_DIR = sys.argv[sys.argv.index("--sass") + 1]
        os.makedirs(SASS_DIR, exist_ok=True)
    sys.exit(main())
