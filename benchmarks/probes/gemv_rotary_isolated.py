"""Issue 29: the q/k/v GEMV with and without the rotary embedding in its epilogue, alone (entry 56).

In a B=1 session the RoPE fold made the q/k/v GEMV's advance grow by about 2.5 µs (``decode_step_kernels``), more
than the RoPE launch it saves. This probe times the GEMV by itself on the Llama-3.2-1B q/k/v shape (N 3072 = 32 + 8
+ 8 heads of 64, K 2048, bf16, the RMSNorm folded in as in a decode step; ``rotated`` 2560, the q and k rows) with
``triton.testing.do_bench`` (median, L2 flushed before each call), with each tile config the GEMV has used, and reads
the compiled kernels' registers and spills.

    python benchmarks/probes/gemv_rotary_isolated.py --out benchmarks/probes/results/gemv_rotary_isolated.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import gemv as gemv_kernels  # noqa: E402

N, K, HEAD_DIM, ROTATED = 3072, 2048, 64, 2560
CONFIGS = {
    "whole_row_8_warps": dict(block_n=8, block_k=2048, num_warps=8),  # the default with the norm folded
    "two_steps_4_warps": dict(block_n=8, block_k=1024, num_warps=4),  # the default without it
    "whole_row_16_warps": dict(block_n=8, block_k=2048, num_warps=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)

    x, weight, norm_weight = randn(K), randn(N, K) / K**0.5, 1 + randn(K) / 4
    angles = torch.rand(HEAD_DIM // 2, generator=generator, device=device) * 500
    cos, sin = (f(torch.cat([angles, angles])).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    rows = []
    for name, config in CONFIGS.items():
        for rotary in (False, True):
            rotation = dict(cos=cos, sin=sin, rotated=ROTATED) if rotary else {}

            def call(config=config, rotation=rotation):
                return gemv_kernels.gemv_triton(x, weight, None, config, norm_weight=norm_weight, eps=1e-5, **rotation)

            call()  # compiles: each config and rotary pair is a new launch signature, remembered last
            kernel = list(gemv_kernels._launch_gemv._compiled.values())[-1][0]
            us = 1e3 * triton.testing.do_bench(call, warmup=50, rep=500, return_mode="median")
            row = {
                "config": name, "rotary": rotary, "us": us, "tb_per_s": N * K * 2 / (us * 1e-6) / 1e12,
                "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    result = {"environment": harness.environment(device), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
