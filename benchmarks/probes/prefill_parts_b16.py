"""Issue 29: how much of a B=16 session's prefill the host costs, and its attention against SDPA's.

``bench_generate`` counts the prefill of 16 x 512 tokens in the B=16 tok/s (32.2 ms at fb3a4aa). Its profile
(entry 83) has 28.5 ms of kernels, 21.0 of them the projections' GEMMs at 760 TFLOP/s, and 2.1 ms in which the GPU
runs none of its kernels. This probe builds ``bench_generate``'s model (bf16, the Llama-3.2-1B shape), a
``DecodeSession`` with ``fuse_projections`` and ``layer_kernels`` (no compile, ``max_cache_len`` 768) and 16
random 512-token prompts, warms up, then:

- ``host_clock_ms``: ``--repeats`` prefills on the host clock, each after ``reset()`` and a sync;
- ``device_only_ms``: the same prefill enqueued behind a ``torch.cuda._sleep`` long enough that the host has queued
  all of it before the GPU reaches it (``host_ahead`` says whether it had), timed with CUDA events from the sleep's
  end to the prefill's end: the prefill with no host in the way. ``host_enqueue_ms`` is the host's time to queue it;
- ``attention``: the attention of one layer at this prefill, ``[16, 32, 512, 64]`` queries and ``[16, 8, 512, 64]``
  keys and values (bf16, contiguous, an empty cache of 768), by ``flashcore.attention_with_kv_cache`` (``auto``:
  the Gluon prefill kernel) and by SDPA's flash, cuDNN and memory-efficient backends (causal, ``enable_gqa``);
  each with its ``seq_lens`` zeroed in the timed call, medians of ``triton.testing.do_bench`` (L2 flushed);
- ``timeline``: one prefill with a host stamp and a CUDA event at the session's call, at the model's, at the
  embedding and the rotary module (call and return), through the first layer's modules, at each later layer's
  start and at the final norm: for each, the host's time since the call and the GPU's time since the
  call's event (the GPU idle at the call). Where the GPU's time is about the host's, the GPU waits on the host;
- ``after_capture``: after three decode steps (the second captured, as in ``bench_generate``), prefills after
  ``reset()`` with the cache's count of the rows' lengths (``counted``, entry 84) and without it (``host_read``: the
  first layer reads them, as before entry 84), alternating: host clock and timeline of each.

    python benchmarks/probes/prefill_parts_b16.py --out prefill_parts_b16.json
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
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

import flashcore  # noqa: E402
from flashcore.integrations.decode_session import DecodeSession  # noqa: E402

SLEEP_CYCLES = 200_000_000  # about 0.1 s at the H100's clock: longer than the host needs to queue a prefill


def reset(session: DecodeSession, host_read: bool) -> None:
    """``session.reset()``; with ``host_read``, the cache forgets its count of the rows' lengths on the host, as
    every prefill after a captured step did before entry 84, so that its first layer reads them."""
    session.reset()
    if host_read:
        session.cache._host_length = None


def host_clock_ms(session: DecodeSession, input_ids: torch.Tensor, host_read: bool = False) -> float:
    reset(session, host_read)
    torch.cuda.synchronize()
    started = time.perf_counter()
    session.prefill(input_ids)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - started)


def device_only(session: DecodeSession, input_ids: torch.Tensor) -> tuple[float, float, bool]:
    session.reset()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    queued = time.perf_counter()
    session.prefill(input_ids)
    end.record()
    enqueue_ms = 1e3 * (time.perf_counter() - queued)
    host_ahead = not start.query()  # the GPU was still asleep when the host had queued everything
    torch.cuda.synchronize()
    return start.elapsed_time(end), enqueue_ms, host_ahead


def timeline(session: DecodeSession, input_ids: torch.Tensor, host_read: bool = False) -> list[dict]:
    model = session.model
    stamps: list[tuple[str, float, torch.cuda.Event]] = []

    def stamp(name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        stamps.append((name, time.perf_counter(), event))

    first = model.model.layers[0]
    # (name, module, also when it returns): the way to the first layer and through it in detail, then each layer
    modules = [("model", model, False), ("decoder", model.model, False), ("embedding", model.model.embed_tokens, True)]
    modules += [("rotary", model.model.rotary_emb, True), ("layer 0", first, False)]
    modules += [(f"layer 0 {name}", module, True) for name, module in first.named_children()]
    modules += [(f"layer {i}", layer, False) for i, layer in enumerate(model.model.layers) if i > 0]
    modules.append(("final norm", model.model.norm, False))
    handles = [module.register_forward_pre_hook(lambda *_, name=name: stamp(name)) for name, module, _ in modules]
    handles += [
        module.register_forward_hook(lambda *_, name=name: stamp(name + " returned"))
        for name, module, after in modules
        if after
    ]
    try:
        reset(session, host_read)
        torch.cuda.synchronize()
        stamp("call")
        session.prefill(input_ids)
        stamp("returned")
        torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    _, host0, event0 = stamps[0]
    return [
        {"at": name, "host_ms": round(1e3 * (host - host0), 3), "gpu_ms": round(event0.elapsed_time(event), 3)}
        for name, host, event in stamps
    ]


def attention_times(device: torch.device) -> dict:
    batch, heads, kv_heads, length, dim, capacity = 16, 32, 8, 512, 64, 768
    q = torch.randn(batch, heads, length, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, length, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_cache = torch.empty(batch, kv_heads, capacity, dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    seq_lens = torch.zeros(batch, device=device, dtype=torch.int32)

    def flashcore_call():
        seq_lens.zero_()
        # check=False, as in a session's layers: the value checks read seq_lens on the host, one sync a call
        return flashcore.attention_with_kv_cache(q, k, v, (k_cache, v_cache, seq_lens), check=False)[0]

    def sdpa(backend):
        def call():
            seq_lens.zero_()  # the same extra launch as flashcore's
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return call

    reference = sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)().float()
    calls = {
        "flashcore": flashcore_call,
        "sdpa_flash": sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": sdpa(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION),
    }
    flop = 4 * batch * heads * dim * length * (length + 1) / 2
    result = {}
    for name, call in calls.items():
        try:
            max_error = (call().float() - reference).abs().max().item()
            us = 1e3 * triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
        except RuntimeError as error:  # a backend this build lacks
            result[name] = {"error": str(error)[:200]}
            continue
        result[name] = {"us": us, "tflops": flop / (us * 1e-6) / 1e12, "max_abs_vs_sdpa_flash": max_error}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda")
    model, input_ids = harness.bench_model_and_prompts(16, device)
    with torch.inference_mode():
        session = DecodeSession(model, max_cache_len=768, batch_size=16, fuse_projections=True, layer_kernels=True)
        for _ in range(2):
            host_clock_ms(session, input_ids)
        host = [host_clock_ms(session, input_ids) for _ in range(args.repeats)]
        device_runs = [device_only(session, input_ids) for _ in range(args.repeats)]
        line = timeline(session, input_ids)
        # As in bench_generate: decode steps after the prefill, the second captured. Then prefills with the cache's
        # count (no host read) and without it (the read), alternating.
        for _ in range(3):
            session.decode_step()
        captured = {False: [], True: []}
        for _ in range(args.repeats):
            for host_read in (False, True):
                captured[host_read].append(host_clock_ms(session, input_ids, host_read))
        captured_lines = {host_read: timeline(session, input_ids, host_read) for host_read in (False, True)}
        attention = attention_times(device)
    result = {
        "environment": harness.environment(device),
        "settings": vars(args),
        "host_clock_ms": statistics.median(host),
        "host_clock_ms_all": [round(t, 3) for t in host],
        "device_only_ms": statistics.median(run[0] for run in device_runs),
        "device_only_ms_all": [round(run[0], 3) for run in device_runs],
        "host_enqueue_ms_all": [round(run[1], 3) for run in device_runs],
        "host_ahead_all": [run[2] for run in device_runs],
        "attention": attention,
        "timeline": line,
        "after_capture": {
            name: {
                "host_clock_ms": statistics.median(captured[host_read]),
                "host_clock_ms_all": [round(t, 3) for t in captured[host_read]],
                "timeline": captured_lines[host_read],
            }
            for name, host_read in (("counted", False), ("host_read", True))
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
