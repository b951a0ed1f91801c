"""Issue 29: the rotary embedding's outer product as a cuBLAS GEMM in a compiled B=1 step.

HF's ``LlamaRotaryEmbedding`` computes its angles as ``inv_freq [B, D/2, 1] @ positions [B, 1, S]``, a batched
matmul with K = 1. Inductor on torch 2.11 keeps it as an extern cuBLAS call: in a compiled decode step's profile
(``decode_step_kernels.py``, e5fbcc9) a ``cutlass_80_simt_sgemm`` of 3.4 µs with 2 µs idle before it, then a
fused cos/sin kernel. Newer torch lowers a K = 1 bmm to a broadcast product (its ``bmm`` decomposition's outer-product
case). On 2.11, inductor's ``decompose_mm_pass`` (``post_grad_fusion_options``) does the same for a bmm whose
batch is at least ``min_first_dimension_decomposition`` and two of whose sizes are below 32; the product of one
term has the GEMM's bits. This probe times a ``DecodeSession``'s replayed compiled step (``fuse_projections``,
``layer_kernels``) on ``bench_generate``'s model (bf16, a 512-token prompt, ``max_cache_len=2048``) in one process,
the variants alternating over ``--rounds`` rounds:

- ``default_compiled``: the session's inductor options;
- ``rotary_pointwise_compiled``: with ``post_grad_fusion_options={"decompose_mm_pass":
  {"min_first_dimension_decomposition": 1}}`` added.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where its 32 greedy tokens part from ``default_compiled``'s (None: all equal). Also printed: whether this
torch's ``bmm`` decomposition has the outer-product case.

    python benchmarks/probes/session_rotary_bmm_b1.py --out benchmarks/probes/results/session_rotary_bmm_b1.json
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import decode_session  # noqa: E402

VARIANTS = {"default_compiled": (False,), "rotary_pointwise_compiled": (True,)}
DECOMPOSE_K1_BMM = {"decompose_mm_pass": {"min_first_dimension_decomposition": 1}}


def timed_session(model, input_ids, pointwise: bool) -> dict:
    inductor_options = decode_session._inductor_options
    if pointwise:
        decode_session._inductor_options = lambda device: {
            **inductor_options(device),
            "post_grad_fusion_options": DECOMPOSE_K1_BMM,
        }
    try:
        return harness.session_steps(model, input_ids, compile=True, fuse_projections=True, layer_kernels=True)
    finally:
        decode_session._inductor_options = inductor_options


def main() -> None:
    import torch._inductor.decomposition as decomposition

    print("bmm decomposition has the outer-product case:", "Outer-product" in inspect.getsource(decomposition.bmm))
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="default_compiled")


if __name__ == "__main__":
    main()
