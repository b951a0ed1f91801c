"""Three small flashcore calls for compute-sanitizer: a decode (split-KV), a prefill and a mixed batch.

Each call runs on bf16 CUDA tensors whose unused cache slots hold NaN, and is checked against fp32 SDPA on the
same data (per row, bottom-right causal mask) and for the append itself. Sizes are tiny because Triton's JIT
and every kernel run crawl under memcheck. Exit status 1 if any check fails.

    python3 benchmarks/sanitize_calls.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \
        --report-api-errors no --error-exitcode 99 python3 benchmarks/sanitize_calls.py   # as gpu_round.sh does
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import flashcore

# bf16 output against an fp32 reference: the test suite's bf16 bound (tests/conftest.py TOLERANCES).
ATOL = 3e-2


def run_case(name, device, *, lens_before, new_lens, num_new, s_max, num_q_heads=8, num_kv_heads=2, head_dim=64, check):
    generator = torch.Generator(device="cpu").manual_seed(len(name))
    batch = len(lens_before)

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    q = randn(batch, num_q_heads, num_new, head_dim)
    k = randn(batch, num_kv_heads, num_new, head_dim)
    v = randn(batch, num_kv_heads, num_new, head_dim)
    k_cache = torch.full((batch, num_kv_heads, s_max, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, length in enumerate(lens_before):
        k_cache[b, :, :length] = randn(num_kv_heads, length, head_dim)
        v_cache[b, :, :length] = randn(num_kv_heads, length, head_dim)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    seq_lens = torch.tensor(lens_before, dtype=torch.int32, device=device)
    is_padded = any(n != num_new for n in new_lens)
    query_lens = torch.tensor(new_lens, dtype=torch.int32, device=device) if is_padded else None

    out, _ = flashcore.attention_with_kv_cache(
        q, k, v, (k_cache, v_cache, seq_lens), is_causal=True, query_lens=query_lens, check=check
    )
    if device.type == "cuda":
        torch.cuda.synchronize()

    failures = []
    expected = torch.zeros(out.shape, dtype=torch.float32, device=device)
    for b, (length, n) in enumerate(zip(lens_before, new_lens, strict=True)):
        if n == 0:
            continue
        keys = torch.cat([k_before[b, :, :length], k[b, :, :n]], dim=1).float()
        values = torch.cat([v_before[b, :, :length], v[b, :, :n]], dim=1).float()
        visible = torch.ones(n, length + n, dtype=torch.bool, device=device).tril(diagonal=length)
        expected[b, :, :n] = F.scaled_dot_product_attention(
            q[b, :, :n].float(), keys, values, attn_mask=visible, enable_gqa=True
        )
        for cache, new in ((k_cache, k), (v_cache, v)):
            if not torch.equal(cache[b, :, length : length + n], new[b, :, :n]):
                failures.append(f"row {b}: appended slots differ from the new K/V")
            if length + n < s_max and not bool(torch.isnan(cache[b, :, length + n :]).all()):
                failures.append(f"row {b}: a slot past the new end was written")
    if not torch.equal(seq_lens.cpu(), torch.tensor([a + n for a, n in zip(lens_before, new_lens, strict=True)])):
        failures.append(f"seq_lens {seq_lens.tolist()} != lens_before + new_lens")
    if not bool(torch.isfinite(out).all()):
        failures.append("output has NaN/inf")
    max_err = float((out.float() - expected).abs().max())
    if not max_err <= ATOL:
        failures.append(f"max abs err {max_err:.3e} > {ATOL}")
    status = "PASS" if not failures else "FAIL: " + "; ".join(failures)
    print(f"{name}: max_abs_err {max_err:.3e} {status}", flush=True)
    return not failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default); cpu runs the torch backend, to test this file"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sanitize_calls.py needs a CUDA GPU", flush=True)
        return 2
    results = [
        # S_max 1024 over 2 KV heads leaves most SMs idle, so the launcher splits the cached prefix: this
        # exercises the split kernel, its merge, and empty splits (row 0 holds 5 tokens).
        run_case("decode", device, lens_before=[5, 300, 900], new_lens=[1, 1, 1], num_new=1, s_max=1024, check=True),
        run_case("prefill", device, lens_before=[0], new_lens=[70], num_new=70, s_max=80, check=False),
        run_case("mixed", device, lens_before=[0, 20, 7], new_lens=[9, 1, 0], num_new=9, s_max=40, check=False),
    ]
    print(f"sanitize_calls: {sum(results)} passed, {len(results) - sum(results)} failed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
