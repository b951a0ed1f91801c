"""Issue 29 / entry 56: which floating-point instructions the RoPE compiles to, read from the PTX (no GPU needed).

HF's RoPE rounds each product and the sum to the dtype. With Triton's default FMA contraction the compiler may fuse a
product and the sum after it into one FMA (in bf16 after narrowing both, ``fma.rn.bf16x2``), one rounding instead of
two. This probe compiles, for sm_90, the standalone RoPE kernel and the q/k/v GEMV with the RoPE in its epilogue (D 64,
bf16, the norm folded in, 8 warps), each with ``EXACT`` off (plain ``*`` and ``+``, what the interpreter runs) and on
(PTX ``mul.rn.f32``/``add.rn.f32``, what CUDA runs), and counts the float multiply, add and FMA instructions. On this
machine's triton, which is not the H100's 3.6, the counts show the mechanism; the H100's tests showed the effect.

    python benchmarks/probes/rope_ptx_ops.py --out benchmarks/probes/results/rope_ptx_ops.json
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashcore.kernels.triton import gemv, layer_kernels

FLOAT_OPS = re.compile(r"^\s*((?:mul|add|fma)\.(?:rn\.)?(?:ftz\.)?(?:f32|bf16x2|bf16|f16x2|f16))\b", re.M)


def compile_ptx(kernel, signature: dict, constexprs: dict, num_warps: int, **options) -> str:
    source = ASTSource(
        fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs
    )
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps, num_stages=1, **options)).asm["ptx"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rope_signature = dict.fromkeys(["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr"], "*bf16")
    rope_signature |= dict.fromkeys(
        ["stride_q_b", "stride_q_h", "stride_q_s", "stride_k_b", "stride_k_h", "stride_k_s", "stride_cos_b",
         "stride_cos_s", "num_tokens", "num_q_heads", "num_kv_heads"], "i32",
    )  # fmt: skip
    gemv_signature = {name: "*bf16" for name in ["x_ptr", "up_ptr", "norm_weight_ptr", "weight_ptr", "bias_ptr"]}
    gemv_signature |= {name: "*bf16" for name in ["residual_ptr", "cos_ptr", "sin_ptr", "out_ptr"]}
    gemv_signature |= dict(n="i32", k="i32", stride_weight_n="i32", eps="fp32", rotated="i32")
    rows = []
    for exact in (False, True):
        rope = compile_ptx(
            layer_kernels._rotary_embedding_kernel, rope_signature,
            dict(HALF=32, HALF_PAD=32, EXACT=exact, USE_PDL=True), num_warps=1, launch_pdl=True,
        )  # fmt: skip
        fused = compile_ptx(
            gemv._gemv_kernel, gemv_signature,
            dict(BLOCK_N=8, BLOCK_K=2048, SWIGLU=False, NORM=True, HAS_BIAS=False, HAS_RESIDUAL=False, ROTARY=True,
                 HALF=32, EXACT_ROTARY=exact, USE_PDL=True),
            num_warps=8, launch_pdl=True, maxnreg=128,
        )  # fmt: skip
        for kernel, ptx in (("rope_kernel", rope), ("qkv_gemv_with_rope", fused)):
            row = {"kernel": kernel, "exact": exact, "float_ops": dict(sorted(Counter(FLOAT_OPS.findall(ptx)).items()))}
            rows.append(row)
            print(row, flush=True)
    Path(args.out).write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
