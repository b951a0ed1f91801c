"""Probe: does the Gluon sm_90 prefill kernel pay at head dim 64, as it does at 128?

Causal prefill of S new tokens into an empty cache (B 1), the append included, for the Llama-3.2-1B heads (32/8,
D 64), SmolLM2's (9/3, D 64) and the D 128 GQA shape bench_attention reports. Three sides in one run, each checked
against SDPA first: flashcore's dispatch as shipped (Gluon where it supports the call), flashcore with the Triton
kernel forced (the Gluon kernels removed from the dispatch table), and torch SDPA (is_causal, enable_gqa). Device
time only: medians of ``triton.testing.do_bench_cudagraph`` over a captured call, which on every side includes the
one-element reset of ``seq_lens`` that lets the prefill repeat. TFLOP/s counts the causal half,
``4 * H_q * S * S * D / 2``.

    python benchmarks/probes/prefill_gluon_head_dims.py --out DIR
    python benchmarks/probes/prefill_gluon_head_dims.py --shapes "llama1b 32/8,smol 9/3" --lengths 1024,4096 \
        --gluon-block-n 64 --out DIR    # also the Gluon prefill with 64-key tiles
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

import flashcore  # noqa: E402
import flashcore.kernels  # noqa: E402
from flashcore.kernels.gluon_sm90 import prefill as gluon_prefill  # noqa: E402

SHAPES = [("llama1b 32/8", 32, 8, 64), ("smol 9/3", 9, 3, 64), ("gqa 32/8", 32, 8, 128)]
LENGTHS = [512, 2048, 8192]


def measure(label, num_q_heads, num_kv_heads, head_dim, seq_len, generator, tables, block_n_sides) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    q = torch.randn(1, num_q_heads, seq_len, head_dim, generator=generator).to(device, dtype)
    k = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator).to(device, dtype)
    v = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator).to(device, dtype)
    cache = flashcore.allocate_kv_cache(1, num_kv_heads, seq_len, head_dim, dtype=dtype, device=device)
    seq_lens = cache[2]

    def run_flashcore():
        seq_lens.zero_()
        return flashcore.attention_with_kv_cache(q, k, v, cache, check=False)[0]

    def run_sdpa():
        seq_lens.zero_()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    reference = run_sdpa().float()
    row = dict(shape=label, H_q=num_q_heads, H_kv=num_kv_heads, D=head_dim, S=seq_len)
    flops = 4 * num_q_heads * seq_len * seq_len * head_dim / 2
    for side, table in (*tables.items(), ("sdpa", None)):
        fn = run_sdpa
        shipped_config = gluon_prefill.CONFIG
        if side in block_n_sides:
            gluon_prefill.CONFIG = dataclasses.replace(shipped_config, block_n=block_n_sides[side])
        if table is not None:
            flashcore.kernels.ATTENTION_KERNELS.update(table)
            call = flashcore.kernels.KernelCall(q, k, v, *cache, None, True, head_dim**-0.5, 0)
            row[f"{side}_kernel"] = flashcore.kernels.select_kernel(call, "triton").NAME
            row[f"{side}_max_err"] = (run_flashcore().float() - reference).abs().max().item()
            fn = run_flashcore
        ms = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
        gluon_prefill.CONFIG = shipped_config
        row[f"{side}_us"] = round(ms * 1e3, 2)
        row[f"{side}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
    flashcore.kernels.ATTENTION_KERNELS.update(tables["shipped"])
    row["shipped_vs_triton"] = round(row["triton_us"] / row["shipped_us"], 3)
    row["shipped_vs_sdpa"] = round(row["sdpa_us"] / row["shipped_us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for prefill_gluon_head_dims.json")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated prompt lengths S")
    parser.add_argument("--shapes", default=",".join(shape[0] for shape in SHAPES), help="comma-separated labels")
    parser.add_argument(
        "--gluon-block-n", default="", help="also time the Gluon prefill with these keys per tile (e.g. 64)"
    )
    args = parser.parse_args()
    generator = torch.Generator(device="cpu").manual_seed(0)
    shipped = dict(flashcore.kernels.ATTENTION_KERNELS)
    tables = {"shipped": shipped, "triton": {**shipped, "triton": (flashcore.kernels.triton_attention,)}}
    block_n_sides = {f"gluon_bn{n}": int(n) for n in args.gluon_block_n.split(",") if n}
    tables.update({side: shipped for side in block_n_sides})
    rows = []
    for label, num_q_heads, num_kv_heads, head_dim in SHAPES:
        if label not in args.shapes.split(","):
            continue
        for seq_len in (int(n) for n in args.lengths.split(",")):
            rows.append(measure(label, num_q_heads, num_kv_heads, head_dim, seq_len, generator, tables, block_n_sides))
            print(json.dumps(rows[-1]), flush=True)
    payload = dict(environment=harness.environment(torch.device("cuda")), rows=rows)
    harness.write_json(harness.resolve_out_dir(args.out) / "prefill_gluon_head_dims.json", payload)


if __name__ == "__main__":
    main()
