"""Issue 29: the B=16 prefill's gate/up GEMM with the SiLU-and-mul in its epilogue, against cuBLAS and the
SiLU-and-mul's own launch.

A B=16 prefill of ``bench_generate``'s model (16 x 512 tokens) runs, per layer, the fused gate/up GEMM on cuBLAS
(8192 x 2048 by 2048 x 16384) and then ``layer_kernels.silu_and_mul_triton`` over its 268 MB output: 2.2 ms of the
prefill's 28 ms over 16 layers (entry 84), a launch bound by the copy. cuBLAS's epilogues take no gated
activation. This probe times, with ``triton.testing.do_bench`` (L2 flushed, medians), on random bf16 data of that
shape:

- ``cublas``: the GEMM alone (``torch.mm``);
- ``cublas_then_silu``: the GEMM and the SiLU-and-mul launch (what the prefill runs);
- ``triton_<config>``: a Triton GEMM whose programs compute a tile of both halves (gate rows ``j`` and up rows
  ``I + j`` of the fused weight) and write ``silu_and_mul(gate, up)`` with the layer kernels' roundings; on
  pointers (the first run, bcf61f5, also had 64-wide tiles, 4 warps and 32-wide K steps: all slower), or on TMA
  descriptors (``tma_``), in a persistent grid (``persistent``) with Triton's warp specialization (``ws``).

For each Triton variant: µs, TFLOP/s (the GEMM's 2 M N K), and the largest difference from ``cublas_then_silu``'s
output in ulps of its largest value (the sums run in another order).

    python benchmarks/probes/prefill_gate_up_silu.py --out prefill_gate_up_silu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton.layer_kernels import silu_and_mul, silu_and_mul_triton  # noqa: E402


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, out_ptr, m, intermediate, k, stride_x, stride_w, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(m, BLOCK_M), tl.cdiv(intermediate, BLOCK_N)
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    block_m = first_m + (pid % (GROUP_M * blocks_n)) % group_size
    block_n = (pid % (GROUP_M * blocks_n)) // group_size
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    g_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    u_tile = g_tile + intermediate * stride_w
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        a = tl.load(x_tile + start)
        acc_g = tl.dot(a, tl.load(g_tile + start), acc_g)
        acc_u = tl.dot(a, tl.load(u_tile + start), acc_u)
    out = silu_and_mul(acc_g.to(out_ptr.dtype.element_ty), acc_u.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :], out)


@triton.jit
def _gate_up_silu_tma_kernel(
    x_desc, w_desc, out_desc, m, intermediate, k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The same tiles on TMA descriptors, a persistent grid of ``NUM_PROGRAMS`` walking the tiles in steps of it."""
    blocks_m, blocks_n = tl.cdiv(m, BLOCK_M), tl.cdiv(intermediate, BLOCK_N)
    tiles = blocks_m * blocks_n
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        group = tile // (GROUP_M * blocks_n)
        first_m = group * GROUP_M
        group_size = tl.minimum(blocks_m - first_m, GROUP_M)
        block_m = first_m + (tile % (GROUP_M * blocks_n)) % group_size
        block_n = (tile % (GROUP_M * blocks_n)) // group_size
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in tl.range(0, k, BLOCK_K, num_stages=STAGES):
            a = x_desc.load([block_m * BLOCK_M, start])
            acc_g = tl.dot(a, w_desc.load([block_n * BLOCK_N, start]).T, acc_g)
            acc_u = tl.dot(a, w_desc.load([intermediate + block_n * BLOCK_N, start]).T, acc_u)
        out = silu_and_mul(acc_g.to(out_desc.dtype), acc_u.to(out_desc.dtype))
        out_desc.store([block_m * BLOCK_M, block_n * BLOCK_N], out)


TMA_CONFIGS = {  # name: BLOCK_M, BLOCK_N (each half), BLOCK_K, GROUP_M, num_warps, stages, persistent, warp_specialize
    "tma_m128_n128_k64_w8_s3": (128, 128, 64, 8, 8, 3, False, False),
    "tma_m128_n128_k64_w8_s4": (128, 128, 64, 8, 8, 4, False, False),
    "tma_persistent_m128_n128_k64_w8_s3": (128, 128, 64, 8, 8, 3, True, False),
    "tma_persistent_ws_m128_n128_k64_w8_s3": (128, 128, 64, 8, 8, 3, True, True),
    "tma_persistent_ws_m128_n128_k64_w4_s3": (128, 128, 64, 8, 4, 3, True, True),
    "tma_persistent_ws_m128_n64_k64_w4_s4": (128, 64, 64, 8, 4, 4, True, True),
}


def gate_up_silu_tma(x, weight, config):
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, group_m, warps, stages, persistent, warp_specialize = config
    m, k = x.shape
    intermediate = weight.shape[0] // 2
    out = torch.empty(m, intermediate, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(intermediate, block_n)
    programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count) if persistent else tiles
    _gate_up_silu_tma_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]), m, intermediate, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, NUM_PROGRAMS=programs,
        WARP_SPECIALIZE=warp_specialize, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return out


CONFIGS = {  # name: BLOCK_M, BLOCK_N (each half), BLOCK_K, GROUP_M, num_warps, num_stages
    "m128_n128_k64_w8_s3": (128, 128, 64, 8, 8, 3),
    "m128_n128_k64_w8_s4": (128, 128, 64, 8, 8, 4),
}


def gate_up_silu(x, weight, config):
    block_m, block_n, block_k, group_m, warps, stages = config
    m, k = x.shape
    intermediate = weight.shape[0] // 2
    out = torch.empty(m, intermediate, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(intermediate, block_n),)
    _gate_up_silu_kernel[grid](
        x, weight, out, m, intermediate, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16 * 512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    weight = torch.randn(2 * args.intermediate, args.hidden, device=device, dtype=torch.bfloat16) / args.hidden**0.5
    flop = 2 * args.tokens * 2 * args.intermediate * args.hidden

    def cublas_then_silu():
        gate_up = torch.mm(x, weight.T)
        return silu_and_mul_triton(gate_up[:, : args.intermediate], gate_up[:, args.intermediate :])

    reference = cublas_then_silu()
    ulp = torch.finfo(torch.bfloat16).eps * float(reference.abs().max())
    rows = [
        {"variant": "cublas", "us": 1e3 * triton.testing.do_bench(lambda: torch.mm(x, weight.T), rep=200)},
        {"variant": "cublas_then_silu", "us": 1e3 * triton.testing.do_bench(cublas_then_silu, rep=200)},
    ]
    variants = [(name, gate_up_silu, config) for name, config in CONFIGS.items()]
    variants += [(name, gate_up_silu_tma, config) for name, config in TMA_CONFIGS.items()]
    for name, run, config in variants:
        try:
            out = run(x, weight, config)
            us = 1e3 * triton.testing.do_bench(lambda run=run, config=config: run(x, weight, config), rep=200)
            rows.append(
                {"variant": f"triton_{name}", "us": us, "max_diff_ulps": float((out - reference).abs().max()) / ulp}
            )
        except Exception as error:  # a config past the shared memory: recorded, not fatal
            rows.append({"variant": f"triton_{name}", "error": str(error)[:300]})
    for row in rows:
        if "us" in row:
            row["tflops"] = flop / row["us"] / 1e6
        print(row, flush=True)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
