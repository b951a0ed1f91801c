"""Issue 29: the host time of an eager GEMV whose weight is an ``nn.Parameter``, through Triton's JIT or the direct
launch.

``CachedLauncher`` (``flashcore/kernels/launch.py``) calls a compiled kernel directly once it has seen its launch
signature; an argument type it does not key sends every launch through Triton's JIT, which costs host time per
call. Until entry 57 ``nn.Parameter`` was such a type, and every projection's weight is one, so each eager GEMV of
a B=1 step (the layer kernels' one-token forward outside a CUDA graph: eager ``generate``, and HF's compiled
``generate``, where the GEMV runs as a custom op) went through the JIT. This probe compares, on ``bench_generate``'s
model (the Llama-3.2-1B shape, bf16, ``fuse_projections`` and ``layer_kernels``), one variant per way:

- ``direct``: the launcher as it is (a Parameter keyed as its tensor);
- ``jit``: the launcher's signature answering None for a launch with a Parameter argument, as before entry 57.

Measured: the wall time per call of 500 back-to-back eager ``layer_ops.gemv`` calls on the o projection's weight
(one synchronize at the end: the host is the bound), and HF's ``generate`` of ``--new-tokens`` tokens from a
512-token prompt at B=1, eager (``disable_compile=True``) and with HF's automatic compile, in ms per generated
token; the variants alternate over ``--rounds`` rounds (after one untimed compiled call that compiles).

    python benchmarks/probes/gemv_direct_launch.py --out gemv_direct_launch.json
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
from bench_generate import build_config, build_model  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.kernels import launch  # noqa: E402


def jit_for_parameters():
    """Makes the launcher's signature None for a launch with an ``nn.Parameter`` argument; returns the undo."""
    signature = launch.CachedLauncher._signature

    def old_signature(self, grid, args, constexprs, options, device):
        if any(type(arg) is torch.nn.Parameter for arg in args):
            return None
        return signature(self, grid, args, constexprs, options, device)

    launch.CachedLauncher._signature = old_signature
    return lambda: setattr(launch.CachedLauncher, "_signature", signature)


def us_per_gemv(model, calls: int = 500) -> float:
    weight = model.model.layers[0].self_attn.o_proj.weight
    x = torch.randn(1, 1, weight.shape[1], device=weight.device, dtype=weight.dtype)
    layer_ops.gemv(x, weight)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        layer_ops.gemv(x, weight)
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - started) / calls


def ms_per_token(model, input_ids, cache, new_tokens: int, compiled: bool) -> float:
    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    cache.reset()
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, do_sample=False,
        disable_compile=not compiled, **{CACHE_ARGUMENT_NAME: cache},
    )  # fmt: skip
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - started) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    from flashcore.integrations.llama import FlashCoreCache, apply_flashcore_to_llama

    device = torch.device("cuda")
    config = build_config(is_tiny=False)
    model = apply_flashcore_to_llama(build_model(config, device), fuse_projections=True, layer_kernels=True)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, config.vocab_size, (1, 512), generator=generator).to(device)
    cache = FlashCoreCache(config, 512 + args.new_tokens, max_batch_size=1, device=device, dtype=torch.bfloat16)
    samples = {
        f"{variant}_{what}": [] for variant in ("direct", "jit") for what in ("gemv_us", "eager_ms", "compiled_ms")
    }
    with torch.inference_mode():
        ms_per_token(model, input_ids, cache, args.new_tokens, compiled=True)  # compiles
        for _ in range(args.rounds):
            for variant in ("direct", "jit"):
                undo = jit_for_parameters() if variant == "jit" else (lambda: None)
                try:
                    samples[f"{variant}_gemv_us"].append(us_per_gemv(model))
                    samples[f"{variant}_eager_ms"].append(ms_per_token(model, input_ids, cache, args.new_tokens, False))
                    samples[f"{variant}_compiled_ms"].append(
                        ms_per_token(model, input_ids, cache, args.new_tokens, True)
                    )
                finally:
                    undo()
                print(variant, {name: values[-1] for name, values in samples.items() if name.startswith(variant)})
    medians = {name: statistics.median(values) for name, values in samples.items()}
    result = {
        "environment": harness.environment(device),
        "settings": vars(args),
        "medians": medians,
        "samples": samples,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(medians)


if __name__ == "__main__":
    main()
