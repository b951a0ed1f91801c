"""Issue 29: does a B=1 GEMV that loads its weight before it waits on the kernel before it hide its latency?

Entry 44: inside a replayed B=1 step of the Llama-3.2-1B shape the small GEMVs (o 8.4 MB, q/k/v 12.6 MB) stream
at about 1.6 TB/s against the 3.0 TB/s copy, and entry 44's Triton GEMV was no faster in isolation: one wave of
short programs is bound by its load latency. Under programmatic dependent launch (PDL) a kernel may start while the
one before it runs, and its weights do not depend on that kernel. This probe builds a chain like a decode step's
and captures it in one CUDA graph: per layer, a small Triton kernel that writes the GEMV's input (an RMSNorm of a
``[K]`` row, waiting on the kernel before it, as a norm after a residual add must, and releasing its dependents at
its start), then the layer's GEMV; 16 layers of distinct weights, more than the 50 MB L2. The GEMVs:

- ``cublas``: ``torch.mm`` of the weight and the row (cuBLAS's GEMV, as ``F.linear`` runs it);
- ``triton``: each program owns ``BLOCK_N`` outputs and loads its whole ``[BLOCK_N, K]`` weight tile at once,
  after ``gdc_wait`` (launched with PDL, so only its launch overlaps the norm);
- ``triton_prefetch``: the same program, loading its weight tile before ``gdc_wait``, so that the loads overlap the
  norm kernel too.

Per shape and GEMV: µs per layer (one replay of the 16-layer graph over 16; median of ``--timings`` timings of
``--replays`` replays), the weights' TB/s over that time, and the largest difference from cuBLAS's output.

    python benchmarks/probes/gemv_pdl_prefetch.py --out benchmarks/probes/results/gemv_pdl_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

LAYERS = 16
SHAPES = {"o": (2048, 2048), "qkv": (3072, 2048)}  # [N, K] of the Llama-3.2-1B shape's weights
CONFIGS = [(8, 4), (16, 8), (16, 16), (32, 16)]  # (BLOCK_N, num_warps)


@triton.jit
def _norm_kernel(h_ptr, gamma_ptr, x_ptr, eps, K: tl.constexpr):
    gdc_wait()  # the row comes from the kernel before (a residual add, in a model)
    gdc_launch_dependents()
    offs = tl.arange(0, K)
    h = tl.load(h_ptr + offs).to(tl.float32)
    x = h * tl.rsqrt(tl.sum(h * h) / K + eps) * tl.load(gamma_ptr + offs).to(tl.float32)
    tl.store(x_ptr + offs, x.to(x_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K)
    tile = w_ptr + rows[:, None] * K + cols[None, :]
    if PREFETCH:
        w = tl.load(tile)  # independent of the kernel before: in flight while it runs
        gdc_wait()
    else:
        gdc_wait()
        w = tl.load(tile)
    gdc_launch_dependents()
    x = tl.load(x_ptr + cols).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))


def chain(kind: str, weights, h, gamma, x, y, config):
    """One replay's work: LAYERS x (norm, GEMV)."""
    n, k = weights[0].shape
    for weight in weights:
        _norm_kernel[(1,)](h, gamma, x, 1e-5, K=k, num_warps=8, launch_pdl=True)
        if kind == "cublas":
            torch.mm(weight, x[:, None], out=y[:, None])
        else:
            block_n, warps = config
            _gemv_kernel[(n // block_n,)](
                weight, x, y, K=k, BLOCK_N=block_n, PREFETCH=kind == "triton_prefetch", num_warps=warps,
                launch_pdl=True,
            )  # fmt: skip


def time_chain(kind, weights, h, gamma, x, y, config, replays: int, timings: int) -> tuple[float, torch.Tensor]:
    chain(kind, weights, h, gamma, x, y, config)  # compile, warm
    torch.cuda.synchronize()
    out = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(kind, weights, h, gamma, x, y, config)
    samples = []
    for _ in range(timings):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end) / replays / len(weights))
    return statistics.median(samples), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--timings", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": []}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
        h, gamma = torch.randn(k, device=device, dtype=torch.bfloat16), torch.rand(k, device=device) + 0.5
        x, y = torch.empty(k, device=device, dtype=torch.bfloat16), torch.empty(n, device=device, dtype=torch.bfloat16)
        reference = None
        for kind, configs in (("cublas", [None]), ("triton", CONFIGS), ("triton_prefetch", CONFIGS)):
            for config in configs:
                us, out = time_chain(kind, weights, h, gamma, x, y, config, args.replays, args.timings)
                reference = out if reference is None else reference
                row = {
                    "shape": name, "n": n, "k": k, "gemv": kind, "block_n_warps": config,
                    "us_per_layer": round(us, 2), "weight_tb_s": round(n * k * 2 / us / 1e6, 3),
                    "max_abs_diff_vs_cublas": float((out.float() - reference.float()).abs().max()),
                }  # fmt: skip
                result["rows"].append(row)
                print(row, flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
