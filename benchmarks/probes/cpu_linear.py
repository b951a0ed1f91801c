"""Probe: a linear's GEMM on the CPU, ``F.linear`` (PyTorch's BLAS, MKL in the PyPI wheels) against oneDNN
(``torch.ops.mkldnn._linear_pointwise``, what ``onednn_linears`` runs), on SmolLM2-135M's projection shapes.

Per shape, three ways: ``F.linear`` with the weight row-major (``[out, in]`` contiguous, PyTorch's layout), with it
input-major (the transpose of a contiguous ``[in, out]`` tensor, an alternative tried first: NOTES.md, entry 50),
and oneDNN with the weight row-major. At 1 row (a decode step's GEMV), 40 and 3,000 rows (the prefills of
``bench_cpu.py``), in fp32; at 1 row in bf16 and fp16 too. One torch thread. Each timing walks over enough copies of
the weight (at least 64 MB) that every GEMV reads it from memory, not from the 32 MB L3 (a prefill's GEMM, which is
compute-bound, walks two), and takes the median of ``--rounds`` walks.

    python benchmarks/probes/cpu_linear.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

# [out, in] of SmolLM2-135M's weights: hidden 576, 9 query and 3 KV heads of dim 64, intermediate 1536, vocab 49152.
SHAPES = {
    "q_proj, o_proj": (576, 576),
    "k_proj, v_proj": (192, 576),
    "gate_proj, up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STREAMED_BYTES = 64 << 20


def time_us(fn, weights: list[torch.Tensor], rounds: int) -> float:
    """Median over ``rounds`` of the mean µs per call of one walk over ``weights``."""
    for weight in weights:
        fn(weight)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for weight in weights:
            fn(weight)
        samples.append((time.perf_counter() - started) / len(weights))
    return 1e6 * statistics.median(samples)


def linear_rows(rounds: int) -> list[dict]:
    onednn = torch.ops.mkldnn._linear_pointwise
    ways = {
        "f_linear_us": lambda x, weight: F.linear(x, weight),
        "f_linear_input_major_us": lambda x, weight: F.linear(x, weight),  # given the input-major copies
        "onednn_us": lambda x, weight: onednn(x, weight, None, "none", [None], ""),
    }
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for shape_name, (out_features, in_features) in SHAPES.items():
            nbytes = out_features * in_features * dtype.itemsize
            copies = max(2, -(-STREAMED_BYTES // nbytes))
            row_major = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
            input_major = [weight.t().contiguous().t() for weight in row_major]
            # generate computes the LM head for the last position only, so a prefill's GEMMs are the layers'.
            prefills = (40, 3000) if dtype_name == "fp32" and shape_name != "lm_head" else ()
            for tokens in (1, *prefills):
                x = torch.randn(tokens, in_features).to(dtype)
                shape = [out_features, in_features]
                row = {"dtype": dtype_name, "weight": shape_name, "shape": shape, "tokens": tokens}
                for way, fn in ways.items():
                    weights = input_major if way == "f_linear_input_major_us" else row_major
                    weights = weights if tokens == 1 else weights[:2]
                    try:
                        row[way] = round(time_us(lambda weight, fn=fn, x=x: fn(x, weight), weights, rounds), 1)
                    except RuntimeError as error:  # oneDNN has no fp16 kernel for a CPU without AVX-512-FP16
                        row[way], row[way.replace("_us", "_error")] = None, str(error).splitlines()[0]
                for way in ways:
                    if row[way] is not None:
                        row[way.replace("_us", "_speedup")] = round(row["f_linear_us"] / row[way], 3)
                        if tokens == 1:
                            row[way.replace("_us", "_gb_s")] = round(nbytes / row[way] / 1e3, 1)
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.inference_mode():
        result = {
            "commit": harness.git_commit(),
            "torch": torch.__version__,
            "threads": 1,
            "rounds": args.rounds,
            "linear": linear_rows(args.rounds),
        }
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_linear.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
