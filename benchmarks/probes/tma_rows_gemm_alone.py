"""Issue 29: the few-row GEMM on TMA copies (``kernels/gluon_sm90/rows_gemm.py``) alone, against cuBLAS and the
Triton few-row GEMM, on the projections of ``bench_generate``'s model at 16 rows (bf16).

Each program of the Gluon kernel keeps a ring of weight tiles in shared memory, filled by TMA copies; the Triton
kernel holds one tile in registers. Per shape (q/k/v fused, o, gate/up fused, down, LM head): the error of each
kernel against the fp32 product (rounded to bf16; on gate/up also with the SiLU-and-mul in the Gluon kernel's
epilogue, against it on the rounded gate and up), then ``triton.testing.do_bench`` medians (L2 flushed between
runs) of ``torch.nn.functional.linear``, the Triton kernel and the Gluon kernel at each K split and ring depth in
``--splits`` x ``--stages``, with TB/s of the weight's bytes.

    python benchmarks/probes/tma_rows_gemm_alone.py --out tma_rows_gemm_alone.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402
from flashcore.kernels.triton import rows_gemm  # noqa: E402

SHAPES = {
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "head": (128256, 2048),
}


def measure_shape(name: str, n: int, k: int, rows: int, splits: list[int], stages: list[int]) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    reference = (x.float() @ w.float().T).to(torch.bfloat16).float()
    gbytes = w.numel() * w.element_size() / 1e9
    row = dict(shape=name, n=n, k=k, weight_mb=round(gbytes * 1e3, 1))

    def error(out):
        return (out.float() - reference).abs().max().item()

    row["err_cublas"] = error(torch.nn.functional.linear(x, w))
    row["err_triton"] = error(rows_gemm.rows_gemm_triton(x, w, None))
    row["err_tma"] = error(tma.tma_rows_gemm(x, w, None))
    with_residual = tma.tma_rows_gemm(x, w, None, residual=residual)
    row["err_tma_residual"] = (with_residual.float() - (reference + residual.float())).abs().max().item()
    calls = {
        "cublas": lambda: torch.nn.functional.linear(x, w),
        "triton": lambda: rows_gemm.rows_gemm_triton(x, w, None),
    }
    tiles, blocks = k // tma.BLOCK_K, triton.cdiv(n, tma.BLOCK_N)
    for split in splits:
        for depth in stages:
            if tiles % split or blocks * split > 8192 or depth > tiles // split:
                continue
            out = tma.tma_rows_gemm(x, w, None, split_k=split, num_stages=depth)
            assert error(out) <= row["err_tma"] * 4 + 0.05, (name, split, depth, error(out))
            calls[f"tma_s{split}_st{depth}"] = functools.partial(
                tma.tma_rows_gemm, x, w, None, split_k=split, num_stages=depth
            )
    if name == "gate_up":  # and with the SiLU-and-mul in the epilogue, against it on the rounded gate and up
        gate, up = reference.to(torch.bfloat16).chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate.float()).to(torch.bfloat16).float() * up.float()).to(torch.bfloat16)
        for split, depth in ((1, 2), (1, 3), (2, 2), (2, 3)):
            out = tma.tma_rows_gemm(x, w, None, swiglu=True, split_k=split, num_stages=depth)
            row[f"err_tma_swiglu_s{split}_st{depth}"] = (out.float() - act.float()).abs().max().item()
            calls[f"tma_swiglu_s{split}_st{depth}"] = functools.partial(
                tma.tma_rows_gemm, x, w, None, swiglu=True, split_k=split, num_stages=depth
            )
    timings = {key: triton.testing.do_bench(call, return_mode="median") for key, call in calls.items()}
    row["us"] = {key: round(ms * 1e3, 2) for key, ms in timings.items()}
    row["tb_per_s"] = {key: round(gbytes / (ms * 1e-3) / 1e3, 3) for key, ms in timings.items()}
    row["best_tma"] = min((key for key in timings if key.startswith("tma_s")), key=timings.get)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--stages", default="2,4,6")
    args = parser.parse_args()
    torch.manual_seed(0)
    splits, stages = [int(s) for s in args.splits.split(",")], [int(s) for s in args.stages.split(",")]
    results = []
    for name, (n, k) in SHAPES.items():
        row = measure_shape(name, n, k, args.rows, splits, stages)
        best = row["best_tma"]
        print(name, {key: value for key, value in row.items() if key.startswith("err")}, flush=True)
        print(name, {key: row["us"][key] for key in ("cublas", "triton", best)}, flush=True)
        results.append(row)
    payload = dict(environment=harness.environment(torch.device("cuda")), settings=vars(args), rows=results)
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
