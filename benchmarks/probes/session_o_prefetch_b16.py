"""Issue 29: the o projection's weight prefetched into L2 during the attention, in a B=16 replayed step.

In entry 63's B=16 profile the o projection (cuBLAS, 2048 x 2048, 8.4 MB) takes 6.3-6.7 µs a layer, about 1.3 TB/s,
and the decode kernel before it 11.2-12.9 µs, reading about 20 MB of K/V: the HBM has room during the attention.
Entry 56 prefetched the o weight at B=1, from the q/k/v GEMV's programs, and lost 20-34 µs a step; there the
attention is about 3 µs and leaves no room. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``, no compile) on ``bench_generate``'s model (bf16, 16 random 512-token
prompts) in one process, the variants alternating over ``--rounds`` rounds:

- ``none``: as shipped;
- ``o_prefetch``: after each layer's RoPE, one more launch (PDL; it waits for the RoPE, releases the attention,
  then issues the prefetches and ends) whose 128 programs each start one bulk prefetch
  (``cp.async.bulk.prefetch.L2``, sm_90) of a 128th of the layer's o weight. ``layer_ops.apply_rotary_embedding``
  is wrapped while the session is built and captured; it is called once per layer in layer order, which picks the
  layer.

Per variant: µs per replayed step and the first step where row 0's 32 tokens part from ``none``'s (a prefetch
changes no value, so None is expected).

    python benchmarks/probes/session_o_prefetch_b16.py --out session_o_prefetch_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402

VARIANTS = {"none": (False,), "o_prefetch": (True,)}  # name: (the o weight prefetched)
PROGRAMS = 128


@triton.jit
def _prefetch_kernel(ptr, nbytes):
    gdc_wait()
    gdc_launch_dependents()
    share = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), 16) * 16
    start = tl.program_id(0).to(tl.int64) * share
    size = tl.minimum(tl.maximum(nbytes - start, 0), share).to(tl.int32)
    address = tl.full([1], 0, tl.int64) + (ptr + start).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, tl.full([1], 0, tl.int32) + size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


def with_o_prefetch(rotate, model):
    weights = [layer.self_attn.o_proj.weight for layer in model.model.layers]
    calls = [0]

    def wrapped(query, key, cos, sin):
        rotated = rotate(query, key, cos, sin)
        weight = weights[calls[0] % len(weights)]
        calls[0] += 1
        nbytes = weight.numel() * weight.element_size() // 16 * 16
        _prefetch_kernel[(PROGRAMS,)](weight, nbytes, num_warps=1, launch_pdl=True)
        return rotated

    return wrapped


def timed_session(model, input_ids, prefetch: bool) -> dict:
    rotate = layer_ops.apply_rotary_embedding
    if prefetch:
        layer_ops.apply_rotary_embedding = with_o_prefetch(rotate, model)
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        layer_ops.apply_rotary_embedding = rotate


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="none", batch=16)


if __name__ == "__main__":
    main()
