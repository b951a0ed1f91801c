"""Issue 29: each layer's cached K/V prefetched into L2 by its q/k/v projection, in a B=16 replayed step.

In the B=16 profile at 44a0f42 (entry 86) the q/k/v projection advances a layer by 10.0 µs for 12.6 MB of weight
(1.3 TB/s), and the attention after it by 6.8 µs for about 21 MB of K/V, near the copy. The K/V a layer's attention
reads were written by earlier steps: nothing the step computes changes them, so they could stream while the q/k/v
projection leaves the HBM idle, and the attention read them from L2. The earlier L2 prefetches (entries 34, 56 and
67) prefetched a weight during a kernel that already streamed at the copy, from a launch of their own; this one
fills the q/k/v projection's idle bandwidth, from the projection's own programs.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts) in one process, the variants alternating over
``--rounds`` rounds. ``rows_gemm.rows_gemm_triton`` is wrapped while the session is built and captured: each q/k/v
call (the one with the norm and the RoPE; once a layer, in layer order) gets that layer's cache as ``prefetch``, and
each of its 96 programs issues one bulk prefetch (``cp.async.bulk.prefetch.L2``) before its PDL wait, of a share of
the rows' ``[0, seq_lens)``:

- ``shipped``: no prefetch;
- ``kv``: keys and values (each program a third of one row's keys or values);
- ``k``: keys only (each program a sixth of one row's keys);
- ``kv_after_wait``, ``k_after_wait``: the same issued right after the wait, once the program's weight tile has
  come (before the wait they compete with the weight loads at the MLP's tail; after it the HBM is idle while the
  projection sums, multiplies and rotates).

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``shipped``'s (a prefetch
changes no value: None expected).

It runs at 1b61ede only (05defdd: the first three variants): ``rows_gemm_triton``'s ``prefetch`` was taken out of
the kernel after it (entry 89).

    python benchmarks/probes/session_kv_prefetch_b16.py --out session_kv_prefetch_b16.json --max-cache-len 768
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.kernels.triton import rows_gemm  # noqa: E402

VARIANTS = {  # name: (values prefetched too, or None: no prefetch; issued after the wait)
    "shipped": (None, False),
    "kv": (True, False),
    "k": (False, False),
    "kv_after_wait": (True, True),
    "k_after_wait": (False, True),
}


def with_prefetch(gemm, session, values_too: bool, after_wait: bool):
    calls = [0]

    def wrapped(x, weight, bias, **kwargs):
        if kwargs.get("norm_weight") is not None and kwargs.get("cos") is not None:
            layers = session.cache.layers
            layer = layers[calls[0] % len(layers)]
            calls[0] += 1
            kwargs["prefetch"] = (layer.keys, layer.values if values_too else None, layer.seq_lens, after_wait)
        return gemm(x, weight, bias, **kwargs)

    return wrapped


def timed_session(model, input_ids, values_too: bool | None, after_wait: bool) -> dict:
    """``harness.session_steps``, with the session at hand for the wrapper."""
    from flashcore.integrations.decode_session import DecodeSession

    max_cache_len, replays = harness.SESSION_SHAPE["max_cache_len"], harness.SESSION_SHAPE["replays"]
    gemm = rows_gemm.rows_gemm_triton
    session = DecodeSession(
        model, max_cache_len=max_cache_len, batch_size=input_ids.shape[0], fuse_projections=True, layer_kernels=True
    )
    if values_too is not None:
        rows_gemm.rows_gemm_triton = with_prefetch(gemm, session, values_too, after_wait)
    try:
        session.prefill(input_ids)
        for _ in range(31):
            session.decode_step()
    finally:
        rows_gemm.rows_gemm_triton = gemm
    tokens = session.text()[0][-32:].tolist()
    timings = [1e3 * ms for ms in harness.ms_per_call_repeated(session.decode_step, replays, 5)]
    return {"us_per_step": statistics.median(timings), "tokens": tokens}


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16)


if __name__ == "__main__":
    main()
