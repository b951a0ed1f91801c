"""Probe: do Triton compiles run side by side in threads of one process? (NOTES.md, entry 91)

A `DecodeSession` with the layer kernels compiles six kernels in series before its first token from a cold cache.
Threads could overlap them only as far as Triton's compile leaves the GIL. This probe compiles ``--kernels``
variants of a small matmul kernel (a different constexpr each, so nothing is shared) for sm_90 with
``triton.compile``, which needs no GPU: first one after another, then the same number of new variants in a thread
pool of that size, each run with an empty ``TRITON_CACHE_DIR``. If the compile ran outside the GIL, the pool would
take the serial time over ``min(kernels, cores)``.

    python benchmarks/probes/parallel_compile_cpu.py --out benchmarks/probes/results/parallel_compile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

SIGNATURE = {"a": "*bf16", "b": "*bf16", "c": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
SIGNATURE.update({name: "constexpr" for name in ("BM", "BN", "BK", "SCALE")})


@triton.jit
def _matmul_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr):
    pid = tl.program_id(0)
    rm = (pid // tl.cdiv(N, BN)) * BM + tl.arange(0, BM)
    rn = (pid % tl.cdiv(N, BN)) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0.0)
        acc += tl.dot(x, y)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c + rm[:, None] * N + rn[None, :], (acc * SCALE).to(tl.bfloat16), mask=mask)


def compile_variant(scale: int) -> float:
    """Seconds to compile one variant (``SCALE`` makes it a kernel of its own) for sm_90."""
    constexprs = {"BM": 128, "BN": 128, "BK": 64, "SCALE": scale}
    source = triton.compiler.ASTSource(fn=_matmul_kernel, signature=SIGNATURE, constexprs=constexprs)
    started = time.perf_counter()
    triton.compile(source, target=GPUTarget("cuda", 90, 128), options={"num_warps": 8, "num_stages": 3})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=4, help="variants per run, and the pool's threads")
    parser.add_argument("--repeats", type=int, default=3, help="serial and threaded runs, alternating")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")  # empty: every variant compiles
    compile_variant(10_000)  # the first compile loads the backend; not timed
    runs, scale = [], 0
    for _ in range(args.repeats):
        for mode in ("serial", "threads"):
            scales = list(range(scale, scale + args.kernels))
            scale += args.kernels
            started = time.perf_counter()
            if mode == "serial":
                each = [compile_variant(s) for s in scales]
            else:
                with ThreadPoolExecutor(args.kernels) as pool:
                    each = list(pool.map(compile_variant, scales))
            runs.append({"mode": mode, "wall_s": time.perf_counter() - started, "each_s": each})
            print(f"{mode}: {runs[-1]['wall_s']:.2f} s for {args.kernels} compiles", flush=True)
    result = {
        "triton": triton.__version__,
        "cpu_cores": os.cpu_count(),
        "kernels": args.kernels,
        "runs": runs,
        "median_wall_s": {
            mode: sorted(r["wall_s"] for r in runs if r["mode"] == mode)[args.repeats // 2]
            for mode in ("serial", "threads")
        },
    }
    print(json.dumps(result["median_wall_s"]))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
