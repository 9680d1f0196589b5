"""Compiles every Triton kernel variant the backend launches to an sm_90 cubin, no GPU needed.

Run in its own process (triton must be imported without TRITON_INTERPRET); prints one line
per kernel with its register and stack use, and exits non-zero if a kernel fails to
compile or spills more than a few bytes. Used by tests/test_triton_backend.py.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from layernorm.backends import _triton_dropout, triton_

TARGET = GPUTarget("cuda", 90, 32)
#: the kernels' scalar arguments that are not i32 (strides are i64 too)
SCALARS = {"n_f": "fp32", "eps": "fp32", "p": "fp32", "eps_bits": "i64", "s_bits": "i64",
           "seed": "i64"}  # fmt: skip
MAX_STACK = 32  # bytes: a kernel may keep a few values on the stack
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def specialized_to_one(fn, pointers: dict[str, str], constexprs: dict) -> dict:
    """``constexprs`` plus every integer argument as the constant 1, as a launch that
    passes 1 (one row, one chunk, a unit stride) compiles it: Triton specializes an
    integer equal to 1 to a constexpr unless the kernel lists it in ``do_not_specialize``,
    and a method call on it (``M.to(tl.int64)``) then fails to compile."""
    ones = dict(constexprs)
    for param in fn.params:
        name = param.name
        if name in constexprs or name in pointers or SCALARS.get(name) == "fp32":
            continue
        if not param.do_not_specialize:
            ones[name] = 1
    return ones


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, num_warps: int) -> str:
    """Compiles ``fn``; returns cuobjdump's resource line (or "" without cuobjdump)."""
    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("stride"):
            signature[name] = "i64"
        elif name in SCALARS:
            signature[name] = SCALARS[name]
        else:
            signature[name] = pointers.get(name, "i32")
    names = list(signature)
    source = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    compiled = triton.compile(source, target=TARGET, options=options)
    if not os.path.exists(CUOBJDUMP):
        return ""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True
        )
    finally:
        os.unlink(f.name)
    return next((line.strip() for line in out.stdout.splitlines() if "REG:" in line), "")


def variants():
    k = triton_._kernels()
    for dt in ("bf16", "fp32"):
        p = {
            name: f"*{dt}" for name in ("X", "R", "W", "B", "Y", "RES_OUT", "Z", "DY", "DRES", "DX")
        }
        p.update(dict.fromkeys(
            ("MEAN", "RSTD"),
            "*fp32",
        ))  # fmt: skip
        p["FLAGS"] = p["CHUNK_FLAGS"] = p["WEIGHT_FLAGS"] = "*i32"
        for name in ("PART_A", "PART_B", "PART_C", "PART", "DW_PART", "DB_PART", "SCALARS"):
            p[name] = "*fp64"
        for rms in (False, True):
            flags = {"HAS_WEIGHT": True, "HAS_BIAS": not rms, "RMS": rms}
            for block, residual in ((triton_.FUSED_FORWARD_N, True), (1024, False)):
                rows, cols = triton_._tile_shape(block)
                yield (
                    k.forward_fused_kernel,
                    p,
                    {**flags, "HAS_RESIDUAL": residual, "ROWS": rows, "COLS": cols},
                    triton_._num_warps_forward(block),
                )
            chunk = triton_.CHUNK_N
            rows, cols = triton_._tile_shape(chunk)
            tile = {"ROWS": rows, "COLS": cols}
            yield (
                k.forward_sums_kernel,
                p,
                {"HAS_RESIDUAL": True, "RMS": rms, **tile},
                triton_._num_warps_forward(chunk),
            )
            if not rms:
                yield (
                    k.forward_centered_kernel,
                    p,
                    {"CHUNKS_P2": 256, **tile},
                    triton_._num_warps_forward(chunk),
                )
            for kernel in (k.forward_output_kernel, k.forward_precise_kernel):
                yield (
                    kernel,
                    p,
                    {**flags, "CHUNKS_P2": 256, **tile},
                    triton_._num_warps_forward(chunk),
                )
            rows, cols = triton_._tile_shape(triton_.BACKWARD_CHUNK_N)
            yield (
                k.backward_sums_kernel,
                p,
                {"HAS_WEIGHT": True, "RMS": rms, "ROWS": rows, "COLS": cols},
                triton_._num_warps_backward(triton_.BACKWARD_CHUNK_N),
            )
            bwd = {
                "HAS_WEIGHT": True,
                "HAS_DRES": True,
                "NEED_DW": True,
                "NEED_DB": not rms,
                "RMS": rms,
            }
            yield (
                k.backward_scalars_kernel,
                p,
                {"HAS_WEIGHT": True, "RMS": rms, "CHUNKS_P2": 256, "ROWS": rows, "COLS": cols},
                triton_._num_warps_backward(triton_.BACKWARD_CHUNK_N),
            )
            yield (
                k.backward_precise_kernel,
                p,
                {"HAS_WEIGHT": True, "HAS_DRES": True, "RMS": rms, "CHUNKS_P2": 256,
                 "ROWS": rows, "COLS": cols},
                triton_._num_warps_backward(triton_.BACKWARD_CHUNK_N),
            )  # fmt: skip
            backward_chunk = triton_.BACKWARD_CHUNK_N
            for block, fused, chunks in (
                (triton_.FUSED_BACKWARD_N, True, 1),
                (backward_chunk, False, 256),
            ):
                rows, cols = triton_._tile_shape(block)
                yield (
                    k.backward_kernel,
                    p,
                    {
                        **bwd,
                        "FUSED": fused,
                        "WEIGHT_TERMS": True,
                        "CHUNKS_P2": chunks,
                        "ROWS": rows,
                        "COLS": cols,
                    },
                    triton_._num_warps_backward(block),
                )


def dropout_variants():
    k = _triton_dropout._kernels()
    p = {name: "*fp32" for name in ("X0", "X1", "RES", "RS", "H", "DH", "DX0", "DX1", "DRES")}
    p.update({"M0": "*i1", "M1": "*i1"})
    every = {"HAS_X1": True, "HAS_RES": True, "HAS_RS": True, "BLOCK": _triton_dropout.MAX_BLOCK}
    for fn, own in (
        (k.forward_kernel, {"WANT_MASKS": True, "NEAREST": False}),
        (k.backward_kernel, {"NEAREST0": False, "NEAREST1": False}),
    ):
        yield fn, p, {**every, **own}, _triton_dropout.LAUNCH["num_warps"]


def main() -> int:
    assert not triton_._triton_interprets(), "run without TRITON_INTERPRET"
    failures = 0
    seen = set()
    for fn, pointers, constexprs, num_warps in (*variants(), *dropout_variants()):
        if fn not in seen:  # each kernel once more, as a launch with M = 1 compiles it
            seen.add(fn)
            ones = specialized_to_one(fn, pointers, constexprs)
            label = f"{fn.__name__} with {sorted(set(ones) - set(constexprs))} = 1"
            try:
                compile_kernel(fn, pointers, ones, num_warps)
                print(f"ok {label}")
            except Exception as error:
                print(f"FAIL {label}: {type(error).__name__}: {str(error)[-300:]}")
                failures += 1
        label = f"{fn.__name__} {pointers.get('X', '')} {constexprs} warps={num_warps}"
        try:
            usage = compile_kernel(fn, pointers, constexprs, num_warps)
        except Exception as error:
            print(f"FAIL {label}: {type(error).__name__}: {error}")
            failures += 1
            continue
        fields = dict(f.split(":", 1) for f in usage.split() if ":" in f)
        spilled = int(fields.get("STACK", 0)) > MAX_STACK or int(fields.get("LOCAL", 0)) > 0
        failures += spilled
        print(f"{'SPILL' if spilled else 'ok'} {label}: {usage}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
