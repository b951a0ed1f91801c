"""Probe: where a CPU forward of flashcore's path differs from stock transformers' (issue 26).

A 30-layer model with SmolLM2-135M's attention (hidden 576, 9 query heads over 3 KV heads, head_dim 64, float32) but
an MLP of width 64 and a vocabulary of 256, so that the parts both paths share (the MLP's and the LM head's weight
streams) shrink and what differs (the attention call, the cache, the masks) is a larger share of each forward. One
torch thread; stock is ``attn_implementation="sdpa"`` with a ``DynamicCache``, flashcore is
``apply_flashcore_to_llama`` with a ``FlashCoreCache``; the two run interleaved, ``--rounds`` times. CPU time of the
thread (``time.thread_time``), medians.

- ``decode``: one forward of one new token after ``cached`` tokens (the cache is cropped back after each), for
  flashcore also with the two-GEMM long decode turned off (``sdpa_only``), and the time inside
  ``F.scaled_dot_product_attention`` per call on each path;
- ``prefill``: one forward of ``tokens`` tokens into a fresh cache, for flashcore also with the cache allocated
  before the clock starts (``preallocated``);
- ``prefill_attention``: SDPA's causal call at 3,000 tokens on the keys as HF's projection leaves them (``[B, S,
  H, D]`` storage) and on the same keys copied into a cache's ``[B, H, S_max, D]`` rows.

    python benchmarks/probes/cpu_forward_host_work.py --out DIR     # ~4 min on one core
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

LAYERS = 30


class SdpaClock:
    """Wraps ``F.scaled_dot_product_attention`` (both paths call it through the module) and sums its CPU time."""

    def __init__(self):
        self.original, self.seconds, self.calls = F.scaled_dot_product_attention, 0.0, 0

    def __call__(self, *args, **kwargs):
        started = time.thread_time()
        out = self.original(*args, **kwargs)
        self.seconds += time.thread_time() - started
        self.calls += 1
        return out


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576, intermediate_size=64, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        num_hidden_layers=LAYERS, vocab_size=256, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def use_path(model, path: str, capacity: int, *, preallocated: bool = False):
    """Patches (or unpatches) the model for ``path`` and returns a fresh cache for it."""
    from transformers import DynamicCache

    from flashcore.integrations.llama import FlashCoreCache, apply_flashcore_to_llama, remove_flashcore

    if path == "stock":
        remove_flashcore(model)
        return DynamicCache(config=model.config)
    apply_flashcore_to_llama(model)
    dtype = torch.float32 if preallocated else None
    return FlashCoreCache(model.config, capacity, max_batch_size=1, device="cpu", dtype=dtype)


def decode_ms(model, path: str, cached: int, steps: int, clock: SdpaClock) -> tuple[float, float]:
    """Median ms of a one-token forward after ``cached`` tokens, and SDPA's mean µs per call in those forwards."""
    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    prompt = torch.randint(0, 256, (1, cached))
    mask = torch.ones(1, cached + 1, dtype=torch.long)
    cache = use_path(model, path, cached + 8)
    model(prompt, attention_mask=mask[:, :cached], **{CACHE_ARGUMENT_NAME: cache})
    token, position = prompt[:, -1:], torch.tensor([[cached]])
    times = []
    clock.seconds, clock.calls = 0.0, 0
    for _ in range(steps):
        started = time.thread_time()
        model(token, attention_mask=mask, position_ids=position, logits_to_keep=1, **{CACHE_ARGUMENT_NAME: cache})
        times.append(time.thread_time() - started)
        cache.crop(-1)
    return 1e3 * statistics.median(times[steps // 10 :]), 1e6 * clock.seconds / max(clock.calls, 1)


def prefill_ms(model, path: str, tokens: int, calls: int, preallocated: bool = False) -> float:
    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    prompt = torch.randint(0, 256, (1, tokens))
    times = []
    for _ in range(calls):
        cache = use_path(model, path, tokens + 16, preallocated=preallocated)
        started = time.thread_time()
        model(prompt, attention_mask=torch.ones_like(prompt), logits_to_keep=1, **{CACHE_ARGUMENT_NAME: cache})
        times.append(time.thread_time() - started)
    return 1e3 * statistics.median(times[1:])


def prefill_attention_ms(rounds: int) -> dict:
    tokens, times = 3000, {"hf_keys": [], "cache_rows": []}
    for _ in range(rounds):
        query, key, value = (torch.randn(1, tokens, heads, 64).transpose(1, 2) for heads in (9, 3, 3))
        k_cache, v_cache = torch.empty(1, 3, tokens + 16, 64), torch.empty(1, 3, tokens + 16, 64)
        k_cache[:, :, :tokens], v_cache[:, :, :tokens] = key, value
        rows = (k_cache.narrow(2, 0, tokens), v_cache.narrow(2, 0, tokens))
        for name, (keys, values) in (("hf_keys", (key, value)), ("cache_rows", rows)):
            started = time.thread_time()
            F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.125, enable_gqa=True)
            times[name].append(time.thread_time() - started)
    return {name: round(1e3 * statistics.median(samples), 2) for name, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from flashcore.kernels.torch import sdpa as torch_sdpa

    torch.set_num_threads(1)
    model = build_model()
    clock = SdpaClock()
    F.scaled_dot_product_attention = clock
    samples: dict[str, list] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for cached, steps in ((40, 200), (3000, 30)):
                for variant in ("stock", "flashcore", "flashcore_sdpa_only"):
                    threshold = torch_sdpa.MATMUL_DECODE_MIN_KV_LEN
                    if variant == "flashcore_sdpa_only":
                        torch_sdpa.MATMUL_DECODE_MIN_KV_LEN = 1 << 30
                    path = "stock" if variant == "stock" else "flashcore"
                    step, sdpa_us = decode_ms(model, path, cached, steps, clock)
                    torch_sdpa.MATMUL_DECODE_MIN_KV_LEN = threshold
                    samples.setdefault(f"decode_{cached}_{variant}_ms", []).append(step)
                    if variant != "flashcore_sdpa_only":
                        samples.setdefault(f"decode_{cached}_{variant}_sdpa_us_per_call", []).append(sdpa_us)
            for variant in ("stock", "flashcore", "flashcore_preallocated"):
                path = "stock" if variant == "stock" else "flashcore"
                ms = prefill_ms(model, path, 40, 30, preallocated=variant.endswith("preallocated"))
                samples.setdefault(f"prefill_40_{variant}_ms", []).append(ms)
        F.scaled_dot_product_attention = clock.original
        attention = prefill_attention_ms(2 * args.rounds + 1)
    medians = {key: round(statistics.median(values), 3) for key, values in samples.items()}
    for key, value in medians.items():
        print(f"{key}: {value}", flush=True)
    print(f"prefill_attention_3000_ms: {attention}", flush=True)
    result = {
        "commit": harness.git_commit(),
        "torch": torch.__version__,
        "threads": 1,
        "layers": LAYERS,
        "rounds": args.rounds,
        "medians": medians,
        "prefill_attention_3000_ms": attention,
        "samples": {key: [round(value, 3) for value in values] for key, values in samples.items()},
    }
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_forward_host_work.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
