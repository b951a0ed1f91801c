"""Issue 29: which tile of flashcore's one-row GEMV (``flashcore/kernels/triton/gemv.py``) is fastest on each
projection of the Llama-3.2-1B shape, inside a chain like a decode step's, against cuBLAS?

Entry 53's probe found a GEMV under programmatic dependent launch (PDL) that loads its weight before it waits 2.0-2.5
µs per layer faster than cuBLAS on the o and q/k/v shapes. This probe runs flashcore's own kernels: per layer,
flashcore's RMSNorm of a ``[1, K]`` row (it waits on the kernel before it and then releases its dependents), then the
layer's GEMV; 16 layers of distinct weights, more than the 50 MB L2, in one CUDA graph, bf16. The GEMVs: cuBLAS
(``torch.mm``, as ``F.linear`` runs it) and flashcore's GEMV with each tile of ``CONFIGS`` (outputs per program,
K per step, warps) that fits the shape, and the default :func:`gemv_config` picks.

Per shape and GEMV: µs per layer (one replay of the 16-layer graph over 16; median of ``--timings`` timings of
``--replays`` replays), the weights' TB/s over that time, and the largest difference from cuBLAS's output.

    python benchmarks/probes/gemv_configs_in_chain.py --out benchmarks/probes/results/gemv_configs_in_chain.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

from flashcore.kernels.triton.gemv import gemv_config, gemv_triton  # noqa: E402
from flashcore.kernels.triton.layer_kernels import rms_norm_triton  # noqa: E402

LAYERS = 16
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # [N, K]
CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps)
    (8, 2048, 4), (8, 2048, 8), (16, 1024, 4), (8, 1024, 4), (4, 2048, 4), (4, 4096, 4), (4, 4096, 8),
    (2, 8192, 8), (4, 8192, 8), (16, 2048, 8),
]  # fmt: skip


def chain(config, weights, h, gamma, y) -> torch.Tensor:
    """One replay's work, LAYERS x (norm, GEMV); config None is cuBLAS (into ``y``). Returns the last output."""
    for weight in weights:
        x = rms_norm_triton(h, gamma, 1e-5)
        if config is None:
            torch.mm(weight, x.view(-1, 1), out=y.view(-1, 1))
        else:
            y = gemv_triton(x.view(-1), weight, None, config)
    return y


def time_chain(config, weights, h, gamma, replays: int, timings: int) -> tuple[float, torch.Tensor]:
    n = weights[0].shape[0]
    y = torch.empty(n, device=h.device, dtype=h.dtype)
    chain(config, weights, h, gamma, y)  # compile, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(config, weights, h, gamma, y)
    graph.replay()
    torch.cuda.synchronize()
    result = out.clone()
    samples = [1e3 * ms / len(weights) for ms in harness.ms_per_call_repeated(graph.replay, replays, timings)]
    return statistics.median(samples), result


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
        h = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        gamma = (torch.rand(k, device=device) + 0.5).to(torch.bfloat16)
        default = gemv_config(n, k)
        default = (default["block_n"], default["block_k"], default["num_warps"])
        fitting = [c for c in CONFIGS if c[1] <= triton.next_power_of_2(k)]
        reference = None
        for config in [None, *dict.fromkeys([default, *fitting])]:
            tile = None if config is None else dict(block_n=config[0], block_k=config[1], num_warps=config[2])
            us, out = time_chain(tile, weights, h, gamma, args.replays, args.timings)
            reference = out if reference is None else reference
            row = {
                "shape": name, "n": n, "k": k, "gemv": "cublas" if config is None else "flashcore",
                "block_n_k_warps": config, "default": config == default,
                "us_per_layer": round(us, 2), "weight_tb_s": round(n * k * 2 / us / 1e6, 3),
                "max_abs_diff_vs_cublas": float((out.float() - reference.float()).abs().max()),
            }  # fmt: skip
            result["rows"].append(row)
            print(row, flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
