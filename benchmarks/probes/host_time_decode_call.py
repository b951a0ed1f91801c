"""Probe: host time of one eager decode attention call at HF generate's shape, flashcore against stock's path.

One layer of the random-weight Llama-3.2-1B shape at B 1 (32/8 heads, D 64, ~600 cached tokens), bf16, on CUDA. Each
side is called eagerly in a loop with nothing else queued, and the host time of each call is read with
``time.perf_counter`` (the GPU runs far ahead of the host here, so this is the Python and dispatch cost):

- ``flashcore check=False``: what the HF integration calls per layer (query_lens given, as generate passes a mask);
- ``flashcore check=True``: the same with the op's value check, one host sync per call;
- ``stock``: ``DynamicCache``'s two ``torch.cat`` and ``F.scaled_dot_product_attention`` with ``enable_gqa``.

Medians and 10th percentiles over ``--calls`` calls per side, sides interleaved in rounds.

    python benchmarks/probes/host_time_decode_call.py --out DIR
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

import flashcore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for host_time_decode_call.json")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per side")
    parser.add_argument("--cached", type=int, default=600, help="tokens already in the cache")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q, k, v = randn(1, 32, 1, 64), randn(1, 8, 1, 64), randn(1, 8, 1, 64)
    cache = flashcore.allocate_kv_cache(1, 8, args.cached + 64, 64, dtype=dtype, device=device)
    query_lens = torch.ones(1, dtype=torch.int32, device=device)
    past_k, past_v = randn(1, 8, args.cached, 64), randn(1, 8, args.cached, 64)

    def flashcore_call(check: bool):
        def call():
            cache[2].fill_(args.cached)
            start = time.perf_counter()
            flashcore.attention_with_kv_cache(q, k, v, cache, query_lens=query_lens, check=check)
            return time.perf_counter() - start

        return call

    def stock_call():
        start = time.perf_counter()
        keys, values = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        return time.perf_counter() - start

    sides = {"flashcore check=False": flashcore_call(False), "flashcore check=True": flashcore_call(True),
             "stock cat+cat+sdpa": stock_call}  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.calls // 20 + 2):
        for name, call in sides.items():
            for _ in range(20):
                elapsed = call()
                if round_index >= 2:  # two rounds of warm-up: compilation, caches, allocator
                    samples[name].append(elapsed * 1e6)
            torch.cuda.synchronize()
    rows = [
        dict(side=name, calls=len(values), host_us_median=round(statistics.median(values), 2),
             host_us_p10=round(sorted(values)[len(values) // 10], 2))
        for name, values in samples.items()
    ]  # fmt: skip
    for row in rows:
        print(json.dumps(row), flush=True)
    payload = dict(environment=harness.environment(device), cached=args.cached, rows=rows)
    harness.write_json(harness.resolve_out_dir(args.out) / "host_time_decode_call.json", payload)


if __name__ == "__main__":
    main()
