"""Probe: one layer's attention call on the CPU, flashcore's path against stock transformers' (issue 26).

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head_dim 64, float32, one torch thread). Per case,
the median time of one call as each path makes it inside a decoder layer, the cache update included:

- ``stock``: ``DynamicCache.update`` (``torch.cat`` onto the cached prefix) and transformers'
  ``sdpa_attention_forward``;
- ``flashcore``: ``flashcore_attention`` on a ``FlashCoreCache`` (validation, dispatch, the in-place append and SDPA
  on the torch backend).

Cases: a prefill of 40 tokens into an empty cache, and the decode of one token after 40: the short context, where
the call's fixed costs are most of its time. The difference per call, times 30 layers, is what the attention path
adds to a forward of the model. (Long contexts are left out: a fresh cache per call leaves stock's just-concatenated
K/V in the CPU's caches and flashcore's not, which a forward through 30 layers does not.)

    python benchmarks/probes/cpu_attention_call.py --out DIR     # ~10 s on one core
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402

CASES = ((40, 0, 300), (1, 40, 2000))  # (new tokens, cached tokens, calls)
LAYERS = 30


class Layer(torch.nn.Module):
    layer_idx, is_causal, num_key_value_groups, training = 0, True, 3, False


def time_path(path: str, config, num_new: int, cached: int, calls: int) -> float:
    """Median seconds of one call; each call on a fresh cache holding ``cached`` tokens."""
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flashcore.integrations.attention import flashcore_attention
    from flashcore.integrations.cache import FlashCoreCache

    layer = Layer()

    def new(heads: int, tokens: int) -> torch.Tensor:  # HF's [B, S, H, D] storage seen as [B, H, S, D]
        return torch.randn(1, tokens, heads, 64).transpose(1, 2)

    query, key, value = new(9, num_new), new(3, num_new), new(3, num_new)
    times = []
    for _ in range(calls + calls // 10):  # the first tenth warms up
        if path == "stock":
            cache = DynamicCache(config=config)
            if cached:
                cache.update(new(3, cached), new(3, cached), 0)
            started = time.perf_counter()
            keys, values = cache.update(key, value, 0)
            sdpa_attention_forward(layer, query, keys, values, None, scaling=0.125)
        else:
            cache = FlashCoreCache(config, cached + num_new, max_batch_size=1, device="cpu")
            if cached:
                cache.append_and_attend(0, new(9, cached), new(3, cached), new(3, cached))
            started = time.perf_counter()
            flashcore_attention(layer, query, key, value, None, scaling=0.125, flashcore_cache=cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times[calls // 10 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import LlamaConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=1, head_dim=64
    )
    rows = []
    with torch.no_grad():
        for num_new, cached, calls in CASES:
            stock, flashcore = (time_path(path, config, num_new, cached, calls) for path in ("stock", "flashcore"))
            rows.append({
                "new_tokens": num_new, "cached_tokens": cached, "calls": calls,
                "stock_us": round(stock * 1e6, 1), "flashcore_us": round(flashcore * 1e6, 1),
                "flashcore_minus_stock_us": round((flashcore - stock) * 1e6, 1),
                "per_forward_ms": round((flashcore - stock) * LAYERS * 1e3, 3),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    result = {"commit": harness.git_commit(), "torch": torch.__version__, "threads": 1, "layers": LAYERS, "rows": rows}
    out = Path(args.out or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_attention_call.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
