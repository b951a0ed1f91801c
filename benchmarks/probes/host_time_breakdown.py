"""Probe: where the host time of one eager decode attention call goes, stage by stage, against stock's path.

One layer of the random-weight Llama-3.2-1B shape (32/8 heads, D 64, ~600 cached tokens), bf16, on CUDA, at B 1 and
B 16. Each stage is called eagerly in a loop with nothing else queued and timed with ``time.perf_counter`` (the GPU
runs ahead of the host, so this is Python and dispatch cost). Stages, each including the ones below it:

- ``integration``: ``flashcore_attention`` on a ``FlashCoreCache`` layer in the middle of the model (what
  ``generate`` calls per layer), against ``stock integration``: ``DynamicCache.update`` and transformers'
  ``sdpa_attention_forward``;
- ``op``: ``attention_with_kv_cache(check=False)`` with ``query_lens``, against ``stock op``: cat + cat + SDPA;
- ``validate``: the op's metadata checks alone; ``select``: building the ``KernelCall`` and asking the table;
- ``kernel run``: the selected kernel's ``run(call)``; ``launcher``: its ``CachedLauncher`` call with the
  arguments ``run`` built; ``signature``: the launcher's signature key alone; ``compiled run``: the compiled
  kernel's own launcher, which encodes the TMA descriptors, called as the ``CachedLauncher`` calls it; ``kernel
  run unbound``: ``run`` without its bound launch (what every eager call did before); ``raw run, descriptors
  encoded once``: on triton 3.6, the C launcher under that compiled launcher, given descriptors encoded once.

Medians and 10th percentiles over ``--calls`` calls per stage, stages interleaved in rounds. ``--dump-triton`` also
copies the installed triton's NVIDIA launcher source next to the JSON (how a descriptor argument is encoded).

    python benchmarks/probes/host_time_breakdown.py --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import harness  # noqa: E402
from transformers import DynamicCache, LlamaConfig  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import flashcore  # noqa: E402
from flashcore import kernels, ops  # noqa: E402
from flashcore.integrations.attention import flashcore_attention  # noqa: E402
from flashcore.integrations.cache import FlashCoreCache  # noqa: E402
from flashcore.kernels import launch  # noqa: E402

NUM_LAYERS = 16


class _Layer(torch.nn.Module):
    """What the attention functions read of an attention module."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_value_groups = 4
        self.is_causal = True


def stages_for(batch: int, cached: int, device, dtype, generator) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q, k, v = randn(batch, 32, 1, 64), randn(batch, 8, 1, 64), randn(batch, 8, 1, 64)
    query_lens = torch.ones(batch, dtype=torch.int32, device=device)
    cache = flashcore.allocate_kv_cache(batch, 8, cached + 4096, 64, dtype=dtype, device=device)
    cache[2].fill_(cached)
    k_cache, v_cache, seq_lens = cache
    scale = 0.125

    config = LlamaConfig(num_hidden_layers=NUM_LAYERS, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048)
    fc_cache = FlashCoreCache(config, max_cache_len=cached + 4096, max_batch_size=batch, device=device, dtype=dtype)
    for layer_idx in range(NUM_LAYERS):
        fc_cache.layers[layer_idx].seq_lens.fill_(cached)
    fc_cache.in_patched_forward = True
    mask = torch.ones(batch, 1, dtype=torch.int32, device=device)
    middle = _Layer(NUM_LAYERS // 2)

    stock_cache = DynamicCache(config=config)
    past = randn(batch, 8, cached, 64)
    for layer_idx in range(NUM_LAYERS):
        stock_cache.update(past, past, layer_idx)

    call = kernels.KernelCall(q, k, v, k_cache, v_cache, seq_lens, query_lens, True, scale, 0)
    kernel = kernels.select_kernel(call, "triton")
    captured = {}
    original = launch.CachedLauncher.__call__

    def capture(self, grid, args, constexprs, **options):
        captured.update(launcher=self, grid=grid, args=args, constexprs=constexprs, options=options)
        return original(self, grid, args, constexprs, **options)

    launch.CachedLauncher.__call__ = capture
    try:
        for _ in range(3):  # compile, then enter the signature cache
            kernel.run(call)
    finally:
        launch.CachedLauncher.__call__ = original
    launcher, grid, args = captured["launcher"], captured["grid"], captured["args"]
    constexprs, options = captured["constexprs"], captured["options"]
    opts = dict(num_warps=options["num_warps"], num_stages=options["num_stages"])
    if options.get("launch_pdl"):
        opts["launch_pdl"] = True
    if options.get("maxnreg") is not None:
        opts["maxnreg"] = options["maxnreg"]
    device_index = torch.cuda.current_device()
    key = launcher._signature(grid, args, constexprs, opts, device_index)
    compiled, constexpr_values = launcher._compiled[key]

    def compiled_run():
        stream = launch.triton.runtime.driver.active.get_current_stream(device_index)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *constexpr_values)  # fmt: skip

    # Triton 3.6's CudaLauncher wraps its C launcher in a closure that encodes each host TMA descriptor on every
    # launch; the raw stage calls the C launcher with descriptors encoded once (what pre-encoding would save).
    raw_run = None
    closure = getattr(compiled.run.launch, "__closure__", None)
    if closure is not None and compiled.run.launch.__name__ == "inner":
        from triton.backends.nvidia import driver as nvidia_driver

        names = compiled.run.launch.__code__.co_freevars
        cells = dict(zip(names, (cell.cell_contents for cell in closure), strict=True))
        raw, indices, meta = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        expanded, descriptor_index = [], 0
        for position, arg in enumerate((*args, *constexpr_values)):
            if position in indices:
                expanded.extend(nvidia_driver.make_tensordesc_arg(arg, meta[descriptor_index]))
                descriptor_index += 1
            else:
                expanded.append(arg)
        run = compiled.run

        def raw_run():
            stream = launch.triton.runtime.driver.active.get_current_stream(device_index)
            raw(grid[0], grid[1], grid[2], stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl,
                None, None, compiled.packed_metadata, None, None, None, *expanded)  # fmt: skip

    def reset():
        seq_lens.fill_(cached)
        for layer_idx in range(NUM_LAYERS):
            fc_cache.layers[layer_idx].seq_lens.fill_(cached)
            stock_cache.layers[layer_idx].keys = stock_cache.layers[layer_idx].keys[:, :, :cached]
            stock_cache.layers[layer_idx].values = stock_cache.layers[layer_idx].values[:, :, :cached]

    def stock_integration():
        keys, values = stock_cache.update(k, v, middle.layer_idx)
        sdpa_attention_forward(middle, q, keys, values, None, scaling=scale)

    return dict(
        stages={
            "integration": lambda: flashcore_attention(middle, q, k, v, mask, scaling=scale, flashcore_cache=fc_cache),
            "stock integration": stock_integration,
            "op": lambda: flashcore.attention_with_kv_cache(
                q, k, v, cache, query_lens=query_lens, scale=scale, check=False
            ),
            "stock op": lambda: F.scaled_dot_product_attention(
                q, torch.cat([past, k], dim=2), torch.cat([past, v], dim=2), enable_gqa=True
            ),
            "validate": lambda: ops._validate_metadata(q, k, v, k_cache, v_cache, seq_lens, query_lens, scale, None),
            "select": lambda: kernels.select_kernel(
                kernels.KernelCall(q, k, v, k_cache, v_cache, seq_lens, query_lens, True, scale, 0), "triton"
            ),
            "kernel run": lambda: kernel.run(call),
            "kernel run unbound": lambda: kernel._launch(call, q.new_empty(q.shape), True, None),
            "launcher": lambda: launcher(grid, args, constexprs, **options),
            "signature": lambda: launcher._signature(grid, args, constexprs, opts, device_index),
            "compiled run": compiled_run,
            **({"raw run, descriptors encoded once": raw_run} if raw_run is not None else {}),
        },
        kernel=kernel.NAME,
        reset=reset,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for host_time_breakdown.json")
    parser.add_argument("--calls", type=int, default=600, help="timed calls per stage")
    parser.add_argument("--cached", type=int, default=600, help="tokens already in the cache")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--dump-triton", action="store_true", help="copy triton's NVIDIA driver.py next to the JSON")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator(device="cpu").manual_seed(0)
    out_dir = harness.resolve_out_dir(args.out)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        setup = stages_for(batch, args.cached, device, dtype, generator)
        samples: dict[str, list[float]] = {name: [] for name in setup["stages"]}
        for round_index in range(args.calls // 20 + 2):
            for name, call in setup["stages"].items():
                setup["reset"]()
                torch.cuda.synchronize()
                for _ in range(20):
                    start = time.perf_counter()
                    call()
                    elapsed = time.perf_counter() - start
                    if round_index >= 2:  # two rounds of warm-up
                        samples[name].append(elapsed * 1e6)
                torch.cuda.synchronize()
        for name, values in samples.items():
            row = dict(batch=batch, stage=name, kernel=setup["kernel"], calls=len(values),
                       host_us_median=round(statistics.median(values), 2),
                       host_us_p10=round(sorted(values)[len(values) // 10], 2))  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    payload = dict(environment=harness.environment(device), cached=args.cached, rows=rows)
    harness.write_json(out_dir / "host_time_breakdown.json", payload)
    if args.dump_triton:
        backends = Path(importlib.util.find_spec("triton").origin).parent / "backends"
        shutil.copy(backends / "nvidia" / "driver.py", out_dir / "triton_nvidia_driver.py.txt")
        shutil.copy(backends / "driver.py", out_dir / "triton_driver.py.txt")


if __name__ == "__main__":
    main()
