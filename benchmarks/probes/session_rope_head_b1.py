"""Issue 29: what the RoPE inside the q/k/v GEMV and the LM head on the GEMV save in a B=1 replayed step.

Since entry 56 a one-token step with ``layer_kernels=True`` computes the rotary embedding of q and k in the q/k/v
GEMV's epilogue (no RoPE launch, and under ``torch.compile`` no per-layer cos/sin kernel of inductor's), and runs the
LM head on flashcore's GEMV instead of cuBLAS. This probe times a ``DecodeSession``'s replayed step
(``fuse_projections`` and ``layer_kernels``) on ``bench_generate``'s model (the Llama-3.2-1B shape, bf16, a 512-token
prompt, ``max_cache_len=2048``) in one process, the variants alternating over ``--rounds`` rounds:

- ``separate``: RoPE on its own kernel (the fold switched off by making ``flashcore.layer_ops.gemv_can_rotate``
  answer False in this process) and the LM head on ``nn.Linear``'s forward (flashcore's head forward removed);
- ``rope_folded``: the RoPE in the GEMV, the head as in ``separate``;
- ``..._head_gemv``: the LM head on the GEMV (the default);
- ``..._compiled``: with ``compile=True``.

Per variant: µs per replayed step (median over rounds of the median of 5 timings of 100 replays; the context grows
by 500 tokens over them), and the first step where its 32 greedy tokens part from ``separate``'s (None: all equal).

    python benchmarks/probes/session_rope_head_b1.py --out benchmarks/probes/results/session_rope_head_b1.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations.llama import apply_flashcore_to_llama  # noqa: E402

VARIANTS = {  # name: (compile, RoPE in the q/k/v GEMV, LM head on the GEMV)
    "separate": (False, False, False),
    "rope_folded": (False, True, False),
    "separate_head_gemv": (False, False, True),
    "rope_folded_head_gemv": (False, True, True),
}
VARIANTS |= {f"{name}_compiled": (True, *switches[1:]) for name, switches in VARIANTS.items()}


def timed_session(model, input_ids, compile: bool, rope_folded: bool, head_gemv: bool) -> dict:
    options = dict(fuse_projections=True, layer_kernels=True)
    apply_flashcore_to_llama(model, **options)  # the head's forward set now, so that a session does not set it again
    gemv_can_rotate, head = layer_ops.gemv_can_rotate, model.get_output_embeddings()
    head_forward = head.__dict__.pop("forward") if not head_gemv else None
    if not rope_folded:
        layer_ops.gemv_can_rotate = lambda head_dim: False
    try:
        return harness.session_steps(model, input_ids, compile=compile, **options)
    finally:
        layer_ops.gemv_can_rotate = gemv_can_rotate
        if head_forward is not None:
            head.forward = head_forward


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="separate")


if __name__ == "__main__":
    main()
