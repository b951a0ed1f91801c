"""Issue 29: can a Triton GEMV stream the small decode projections closer to the copy bandwidth than cuBLAS?

A B=1 decode step of the Llama-3.2-1B shape spends 1065 µs in cuBLAS GEMVs; the small ones (q/k/v, o, the split-K
down projection) run at 1.6-2.1 TB/s against the 3.0 TB/s copy (NOTES.md, entry 44). This probe times, for each of
the model's projection shapes at M = 1 (and ``--m`` others), ``torch.nn.functional.linear`` (cuBLAS) and a plain
Triton GEMV over a small sweep of tiles: each program owns ``BLOCK_N`` output columns and walks K in ``BLOCK_K``
steps (``num_stages`` deep), optionally split over ``SPLIT_K`` programs whose fp32 partials a second reduction
adds (as cuBLAS's split-K does). Weights rotate over enough copies to exceed the 50 MB L2, so each call streams its
weight from HBM. Reported per shape: cuBLAS's µs and TB/s, the best Triton config's, and their ratio; the Triton
output is checked against cuBLAS's (max abs difference).

    python benchmarks/probes/gemv_sweep.py --out benchmarks/probes/results/gemv_sweep.json
    TRITON_INTERPRET=1 python benchmarks/probes/gemv_sweep.py --check   # correctness only, on the CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, K, N) of the Llama-3.2-1B shape's projections: y[M, N] = x[M, K] @ W[N, K]^T.
SHAPES = (
    ("qkv", 2048, 3072),
    ("o", 2048, 2048),
    ("gate_up", 2048, 16384),
    ("down", 8192, 2048),
    ("lm_head", 2048, 128256),
)
CONFIGS = [
    dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
    for bn, bk, sk, w, st in itertools.product((4, 8, 16), (256, 512), (1, 2, 4), (4,), (3, 4))
]
COPY_TB_PER_S = 3.0
L2_BYTES = 50 * 1024**2


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] (fp32) = sum over this split's K range of x[m, k] * w[n, k], for every m < M."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    k_per_split = tl.cdiv(K, SPLIT_K)
    k_start = split * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_start + k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < tl.minimum(k_start + k_per_split, K)
        w_mask = (cols[:, None] < N) & k_mask[None, :]
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
        for m in tl.static_range(BLOCK_M):
            x = tl.load(x_ptr + m * stride_xm + ks, mask=k_mask & ((ks * 0 + m) < M), other=0.0)
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    out = out_ptr + split * M * stride_om + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def triton_gemv(x: torch.Tensor, w: torch.Tensor, config: dict) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    split_k = config["SPLIT_K"]
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config["BLOCK_N"]), split_k)
    _gemv_kernel[grid](
        x, w, partials, m, n, k, x.stride(0), w.stride(0), n,
        BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], SPLIT_K=split_k, BLOCK_M=triton.next_power_of_2(m),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return (partials[0] if split_k == 1 else partials.sum(0)).to(x.dtype)


def check(device: torch.device, dtype: torch.dtype) -> float:
    """Max abs difference against an fp64 reference over small shapes and a few configs."""
    worst = 0.0
    for (m, k, n), config in itertools.product(((1, 96, 40), (3, 200, 17)), CONFIGS[::7]):
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        expected = (x.double() @ w.double().T).to(dtype)
        got = triton_gemv(x, w, dict(config, BLOCK_K=min(config["BLOCK_K"], 64)))
        worst = max(worst, (got.double() - expected.double()).abs().max().item())
    return worst


def time_us(fn, calls: list) -> float:
    from triton.testing import do_bench

    index = itertools.count()
    return 1e3 * do_bench(lambda: fn(*calls[next(index) % len(calls)]), warmup=50, rep=200, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--m", default="1", help="comma-separated M (rows of the batch)")
    parser.add_argument("--check", action="store_true", help="correctness only (the CPU interpreter)")
    args = parser.parse_args()
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        print(f"max abs error against fp64, fp32 inputs: {check(torch.device('cpu'), torch.float32):.2e}")
        return
    import harness

    device = torch.device("cuda")
    dtype = torch.bfloat16
    error = check(device, torch.float16)
    result = {"environment": harness.environment(device), "check_max_abs_error_fp16": error, "rows": []}
    for m, (name, k, n) in itertools.product([int(v) for v in args.m.split(",")], SHAPES):
        weight_bytes = n * k * 2
        copies = max(2, -(-3 * L2_BYTES // weight_bytes))  # enough that a weight is evicted before it comes back
        calls = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype) * 0.02)
                 for _ in range(copies)]  # fmt: skip
        row = {"shape": name, "M": m, "K": k, "N": n, "weight_mb": weight_bytes / 1e6}
        row["cublas_us"] = time_us(torch.nn.functional.linear, calls)
        best = None
        for config in CONFIGS:
            if config["SPLIT_K"] > 1 and k < 4096:
                continue
            try:
                us = time_us(lambda x, w, config=config: triton_gemv(x, w, config), calls)
            except Exception as error:  # noqa: BLE001  (a config that does not compile is skipped)
                print(f"  {name} {config}: {type(error).__name__}", flush=True)
                continue
            if best is None or us < best[0]:
                best = (us, config)
        x, w = calls[0]
        row["triton_max_abs_diff_vs_cublas"] = (
            (triton_gemv(x, w, best[1]).float() - torch.nn.functional.linear(x, w).float()).abs().max().item()
        )
        row.update(triton_us=best[0], triton_config=best[1])
        for side in ("cublas", "triton"):
            row[f"{side}_tb_per_s"] = weight_bytes / (row[f"{side}_us"] * 1e-6) / 1e12
            row[f"{side}_pct_of_copy"] = 100 * row[f"{side}_tb_per_s"] / COPY_TB_PER_S
        row["triton_over_cublas"] = row["cublas_us"] / row["triton_us"]
        result["rows"].append(row)
        print(f"M={m} {name}: cuBLAS {row['cublas_us']:.1f} us ({row['cublas_pct_of_copy']:.0f}%), Triton "
              f"{row['triton_us']:.1f} us ({row['triton_pct_of_copy']:.0f}%) {best[1]}", flush=True)  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    print("median Triton/cuBLAS speed:", statistics.median(r["triton_over_cublas"] for r in result["rows"]))


if __name__ == "__main__":
    main()
