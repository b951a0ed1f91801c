"""Issue 29: inductor options for the small kernels at the two ends of a compiled B=1 step.

A compiled decode step's profile (``decode_step_kernels.py``, 2c920f3) opens with four inductor kernels before the
first layer (9.3 µs of advance: the position update, the embedding, the rotary embedding's angles as a cuBLAS GEMM
and its cos/sin) and closes with eight after the LM head (10.9 µs: ``chunked_argmax``'s two passes, then the
session's bookkeeping: token, positions, text). This probe times a ``DecodeSession``'s replayed compiled step
(``fuse_projections``, ``layer_kernels``) on ``bench_generate``'s model (bf16, a 512-token prompt,
``max_cache_len=2048``) in one process with inductor options added to the session's, the variants alternating over
``--rounds`` rounds:

- ``default_compiled``: the session's inductor options;
- ``rotary_pointwise_compiled``: ``post_grad_fusion_options={"decompose_mm_pass": {"min_first_dimension_decomposition":
  1}}``, meant to lower the rotary embedding's ``inv_freq [B, D/2, 1] @ positions [B, 1, S]`` (K = 1) to a broadcast
  product as newer torch's ``bmm`` decomposition does. It did not change the step at 2c920f3: that pass reads its
  thresholds when its module is imported, before the option is seen;
- ``combo_kernels_compiled``: ``combo_kernels=True``, inductor's horizontal fusion of independent kernels into one
  launch (the bookkeeping's updates of buffers of different sizes cannot fuse otherwise).

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays), and the first
step where its 32 greedy tokens part from ``default_compiled``'s (None: all equal). Also printed: whether this
torch's ``bmm`` decomposition has the outer-product case.

    python benchmarks/probes/session_inductor_options_b1.py --out session_inductor_options_b1.json
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore.integrations import decode_session  # noqa: E402

VARIANTS = {  # name: (inductor options added to the session's)
    "default_compiled": ({},),
    "rotary_pointwise_compiled": (
        {"post_grad_fusion_options": {"decompose_mm_pass": {"min_first_dimension_decomposition": 1}}},
    ),
    "combo_kernels_compiled": ({"combo_kernels": True},),
}


def timed_session(model, input_ids, added: dict) -> dict:
    inductor_options = decode_session._inductor_options
    decode_session._inductor_options = lambda device: {**inductor_options(device), **added}
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
