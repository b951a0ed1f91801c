"""Probe: ``F.linear`` on the CPU with the weight row-major (``[out, in]`` contiguous, PyTorch's layout) against
input-major (the transpose of a contiguous ``[in, out]`` tensor), on SmolLM2-135M's projection shapes.

At batch 1 a decode step's projections are GEMVs that stream their weights; this times each shape at 1 row (decode),
40 and 3,000 rows (the prefills of ``bench_cpu.py``), in fp32, bf16 and fp16, one torch thread. Each timing walks
over enough copies of the weight (at least 64 MB) that every call reads it from memory, not from the 32 MB L3,
and takes the median of ``--rounds`` walks. Also times the embedding lookup of a tied LM head stored input-major,
which then gathers strided rows. ``integrations/weight_layout.py`` takes its default from these numbers.

    python benchmarks/probes/cpu_weight_layout.py --out DIR
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
                x = torch.randn(1, tokens, in_features).to(dtype)
                walk = row_major if tokens == 1 else row_major[:2]  # a prefill GEMM is compute-bound
                walk_t = input_major if tokens == 1 else input_major[:2]
                row_us = time_us(lambda weight, x=x: F.linear(x, weight), walk, rounds)
                input_us = time_us(lambda weight, x=x: F.linear(x, weight), walk_t, rounds)
                row = {"dtype": dtype_name, "weight": shape_name, "shape": [out_features, in_features],
                       "tokens": tokens, "row_major_us": round(row_us, 1), "input_major_us": round(input_us, 1),
                       "speedup": round(row_us / input_us, 3)}  # fmt: skip
                if tokens == 1:
                    row["row_major_gb_s"] = round(nbytes / row_us / 1e3, 1)
                    row["input_major_gb_s"] = round(nbytes / input_us / 1e3, 1)
                rows.append(row)
                print(row, flush=True)
    return rows


def embedding_rows(rounds: int) -> list[dict]:
    """The lookup of a tied LM head's rows, row-major against input-major, per prompt length."""
    vocab, hidden = SHAPES["lm_head"]
    weight = torch.randn(vocab, hidden)
    weight_t = weight.t().contiguous().t()
    rows = []
    for tokens in (1, 40, 3000):
        ids = torch.randint(0, vocab, (1, tokens))
        row_us = time_us(lambda w, ids=ids: F.embedding(ids, w), [weight] * 4, rounds)
        input_us = time_us(lambda w, ids=ids: F.embedding(ids, w), [weight_t] * 4, rounds)
        rows.append({"tokens": tokens, "row_major_us": round(row_us, 1), "input_major_us": round(input_us, 1)})
        print(rows[-1], flush=True)
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
            "embedding_lookup": embedding_rows(args.rounds),
        }
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_weight_layout.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
