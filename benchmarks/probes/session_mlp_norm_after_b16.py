"""Issue 29: the MLP's RMSNorm as a scale after the gate/up GEMM, in a B=16 replayed step.

A B=16 layer runs the o projection, then the add-and-norm kernel (the residual add after attention and the MLP's
RMSNorm, one launch), then gate/up with the SiLU-and-mul, then down with the residual add. Entry 74 put the norm inside
the TMA gate/up GEMM, normalizing each x tile before its MMA: +110 µs a step. Here the norm moves after the GEMM
instead. Its weight is folded into the gate/up weight (``W * w`` along K, rounded to bf16 once, built here per layer)
and each row's ``rsqrt(mean(x^2) + eps)`` multiplies the products in the epilogue (``tma_rows_gemm(row_rms_eps=)``). At
0e8eb98 the squares were summed from the x tiles the ring copies, while their MMAs ran, with a barrier before each
refill; since, each program loads all of x into registers after its wait and sums the squares after its loop, the loads
in flight while the MMAs run. No MMA waits on the norm. The o projection adds the residual in its epilogue, and the add-
and-norm launch goes. The roundings are not HF's: ``x * inv_rms`` and ``w * normalized`` are not rounded to bf16 before
the GEMM.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds:
``shipped``, and ``norm_after`` (the decoder layer's forward replaced for steps of 2 to 16 rows). The report gives,
for the first call of each layer in ``norm_after``, the largest difference of its SiLU-and-mul output from the
shipped path's on the same input, in units of the largest magnitude.

    python benchmarks/probes/session_mlp_norm_after_b16.py --out session_mlp_norm_after_b16.json --max-cache-len 768
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import torch  # noqa: E402

from flashcore import layer_ops  # noqa: E402
from flashcore.integrations import llama_forward_fork as fork  # noqa: E402
from flashcore.kernels.gluon_sm90 import rows_gemm as tma  # noqa: E402

VARIANTS = {"shipped": (False,), "norm_after": (True,)}
REPORT: dict = {"relative_difference_by_layer": {}}
_scaled_weights: dict[int, torch.Tensor] = {}


def _gate_up_norm_after(layer, hidden: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate, up) of rms_norm(hidden) with the norm after the GEMM."""
    norm, fused = layer.post_attention_layernorm, layer.mlp.__dict__["_fused_projection"]
    weight = _scaled_weights.get(layer.self_attn.layer_idx)
    if weight is None:
        weight = (fused.weight.float() * norm.weight.float()).to(fused.weight.dtype)
        _scaled_weights[layer.self_attn.layer_idx] = weight
    rows = hidden.reshape(-1, hidden.shape[-1])
    activated = tma.tma_rows_gemm(rows, weight, fused.bias, swiglu=True, row_rms_eps=norm.variance_epsilon)
    differences = REPORT["relative_difference_by_layer"]
    if layer.self_attn.layer_idx not in differences and not torch.cuda.is_current_stream_capturing():
        normed = layer_ops.rms_norm(rows, norm.weight, norm.variance_epsilon)
        shipped = layer_ops.rows_gemm(normed, fused.weight, fused.bias, swiglu=True)
        scale = float(shipped.abs().max())
        differences[layer.self_attn.layer_idx] = float((activated - shipped).abs().max()) / scale
    return activated.view(*hidden.shape[:-1], -1)


def decoder_layer_norm_after(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    if not fork._runs_rows_gemm(self, hidden_states):
        return shipped_forward(self, hidden_states, **kwargs)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states, norm=self.input_layernorm, residual=hidden_states, **kwargs
    )
    activated = _gate_up_norm_after(self, hidden_states)
    return fork._project_residual(self.mlp, activated, "down_proj", hidden_states)


shipped_forward = fork.decoder_layer_forward


def _bind_layer_forward(model, forward) -> None:
    """``sync_forwards`` keeps a layer forward it did not install: unbind it, so that the next one binds ``forward``."""
    for layer in model.base_model.layers:
        layer.__dict__.pop("forward", None)
    fork.decoder_layer_forward = forward


def timed_session(model, input_ids, norm_after: bool) -> dict:
    _bind_layer_forward(model, decoder_layer_norm_after if norm_after else shipped_forward)
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        _bind_layer_forward(model, shipped_forward)


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
