"""Issue 29: which form of a 16-row GEMM makes cuBLAS choose a faster kernel for the 1B model's weight shapes.

A B=16 decode step's projections are cuBLAS GEMMs of 16 rows, and the small ones run far from the copy bandwidth:
the q/k/v and o GEMMs at about 1.5 TB/s (``nvjet ... 64x8``, entry 52). cuBLAS picks its kernel from the call's
shape, layout and epilogue, and ``torch.cuda.tunable`` cannot choose among cuBLAS's algorithms on CUDA (it lists
rocBLAS's and hipBLASLt's alone). So this probe times the same product in the forms a model could call, each
graph-replayed over enough copies of the weight to exceed the L2 (``do_bench_cudagraph``, µs a call):

- ``linear``: ``F.linear(x, w)``, what the model runs (``x`` 16 rows);
- ``linear_bias``: with a zero bias, which torch sends to cuBLASLt's bias epilogue;
- ``lt``: ``linear`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``swapped``: ``torch.mm(w, x.T)``, the output transposed (``[N, 16]``; the transpose back is not timed);
- ``rows32`` and ``rows64``: ``linear`` with the rows padded to 32 and 64.

Also each form's kernels (one call under ``torch.profiler``) and its worst error against fp64, in ulps of the
largest output.

    python benchmarks/probes/cublas_forms_b16.py --out cublas_forms_b16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

SHAPES = {  # bench_generate's Llama-3.2-1B shape, fused projections: [N, K]
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "lm_head": (128256, 2048),
}
COPY_BYTES = 256 * 2**20  # weight copies a timing streams: well past the 50 MB L2
ROWS = 16


def forms(x: torch.Tensor) -> dict:
    """name: (function of a weight giving the ``[16, N]`` product (or its transpose), BLAS library preference)."""
    zero_bias = {}
    padded = {
        rows: torch.cat([x, torch.zeros(rows - ROWS, x.shape[1], dtype=x.dtype, device=x.device)]) for rows in (32, 64)
    }
    x_t = x.t().contiguous().t()  # [16, K] seen through a [K, 16] buffer: mm(w, x.T) reads it contiguously

    def linear_bias(w):
        bias = zero_bias.setdefault(w.shape[0], torch.zeros(w.shape[0], dtype=w.dtype, device=w.device))
        return F.linear(x, w, bias)

    return {
        "linear": (lambda w: F.linear(x, w), "cublas"),
        "linear_bias": (linear_bias, "cublas"),
        "lt": (lambda w: F.linear(x, w), "cublaslt"),
        "swapped": (lambda w: torch.mm(w, x_t.t()), "cublas"),
        "rows32": (lambda w: F.linear(padded[32], w)[:ROWS], "cublas"),
        "rows64": (lambda w: F.linear(padded[64], w)[:ROWS], "cublas"),
    }


def kernels_of(run) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def time_shape(name: str, n: int, k: int, generator: torch.Generator) -> dict:
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) / k**0.5
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16, generator=generator)
    nbytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(max(0, -(-COPY_BYTES // nbytes) - 1))]
    expected = x.double() @ weight.double().T
    ulp = torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    row = {"shape": name, "weight": [n, k], "copies": len(copies)}
    for form, (product, library) in forms(x).items():
        torch.backends.cuda.preferred_blas_library(library)
        try:
            out = product(weight)
            out = out.t() if out.shape[0] == n else out
            row[f"{form}_ulps"] = (out.double() - expected).abs().max().item() / ulp
            row[f"{form}_kernels"] = kernels_of(lambda product=product: product(weight))
            us = (
                1e3
                * triton.testing.do_bench_cudagraph(lambda product=product: [product(w) for w in copies], rep=200)
                / len(copies)
            )
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        row[f"{form}_us"] = us
        row[f"{form}_tb_per_s"] = nbytes / us / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            rows.append(time_shape(name, n, k, generator))
            print({key: value for key, value in rows[-1].items() if not key.endswith("_kernels")}, flush=True)
    result = {"environment": harness.environment(device), "settings": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
