"""Issue 29: the MLP's RMSNorm as a row scale after the gate/up GEMM, its squares summed by the o projection, in a
B=16 replayed step.

A B=16 layer runs the o projection, then the add-and-norm kernel (the residual add after attention and the MLP's
RMSNorm), then the MLP in one launch (gate/up with the SiLU-and-mul, then down with the residual add). Entry 77 took
the add-and-norm launch away by folding the norm's weight into the gate/up weight and scaling each row's products by
``rsqrt(mean(x^2) + eps)`` after the GEMM; the o projection added the residual. It was 17.5-32 µs a step slower:
each gate/up program read all of x (64 KB) for the squares. Here the o projection's epilogue, which holds its 64
outputs of each row after the residual add, writes their squares' sum (``tma_rows_gemm(squares=)``), and each MLP
program reads the 32 sums of its 16 rows (2 KB) after its wait (``tma_rows_mlp(squares=, eps=)``). No MMA waits on
the norm, and no program reads x twice. The norm's weight is folded into the gate/up weight (``W * w`` along K,
rounded to bf16 once, built here per layer, a second copy of that weight). The roundings are not HF's: ``x *
inv_rms`` and ``w * normalized`` are not rounded to bf16 before the GEMM.

This probe times a ``DecodeSession``'s replayed step (``fuse_projections`` and ``layer_kernels``, no compile) on
``bench_generate``'s model (bf16, 16 random 512-token prompts), the variants alternating over ``--rounds`` rounds:
``shipped``, and ``norm_after`` (the decoder layer's forward replaced for steps of 2 to 16 rows). The report gives,
for the first call of each layer in ``norm_after`` (outside a capture), the largest difference of its MLP output from
the shipped path's on the same input, in units of the largest magnitude.

It ran at 27ed4a9, where each MLP program summed the 32 sums right after its wait, and at 73d9606, where it loads
them there and sums them after its products. It runs at those commits only: the kernels' options it sets
(``squares``, ``eps``) were taken out after it (entry 88).

    python benchmarks/probes/session_mlp_norm_squares_b16.py --out session_mlp_norm_squares_b16.json --max-cache-len 768
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
from flashcore.kernels.gluon_sm90 import rows_mlp  # noqa: E402

VARIANTS = {"shipped": (False,), "norm_after": (True,)}
REPORT: dict = {"relative_difference_by_layer": {}}
_scaled_weights: dict[int, torch.Tensor] = {}
_squares: dict[torch.device, torch.Tensor] = {}


def _squares_buffer(hidden: torch.Tensor) -> torch.Tensor:
    buffer = _squares.get(hidden.device)
    if buffer is None:
        buffer = _squares[hidden.device] = torch.zeros(
            hidden.shape[-1] // tma.BLOCK_N * tma.MAX_ROWS, dtype=torch.float32, device=hidden.device
        )
    return buffer


def project_residual_with_squares(module, x, name, residual, up=None):
    """The o projection of 2 to 16 rows with the residual add and its squares' sums; the rest as shipped."""
    if name != "o_proj" or residual is None or not fork._runs_rows_gemm(module, x):
        return shipped_project_residual(module, x, name, residual, up=up)
    linear = module.o_proj
    rows = x.reshape(-1, x.shape[-1])
    out = tma.tma_rows_gemm(
        rows, linear.weight, linear.bias, residual=residual.reshape(-1, residual.shape[-1]), squares=_squares_buffer(x)
    )
    return out.view(*x.shape[:-1], -1)


def decoder_layer_norm_after(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    if not fork._runs_rows_gemm(self, hidden_states):
        return shipped_forward(self, hidden_states, **kwargs)
    residual = hidden_states
    norm, mlp = self.post_attention_layernorm, self.mlp
    fused, down = mlp.__dict__["_fused_projection"], mlp.down_proj
    weight = _scaled_weights.get(self.self_attn.layer_idx)
    if weight is None:
        weight = (fused.weight.float() * norm.weight.float()).to(fused.weight.dtype)
        _scaled_weights[self.self_attn.layer_idx] = weight
    summed, _ = self.self_attn(hidden_states=hidden_states, norm=self.input_layernorm, residual=residual, **kwargs)
    rows = summed.reshape(-1, summed.shape[-1])
    out = rows_mlp.tma_rows_mlp(
        rows, weight, fused.bias, down.weight, down.bias, residual=rows, squares=_squares_buffer(rows),
        eps=norm.variance_epsilon,
    )  # fmt: skip
    differences = REPORT["relative_difference_by_layer"]
    if self.self_attn.layer_idx not in differences and not torch.cuda.is_current_stream_capturing():
        normed = layer_ops.rms_norm(rows, norm.weight, norm.variance_epsilon)
        shipped = rows_mlp.tma_rows_mlp(normed, fused.weight, fused.bias, down.weight, down.bias, residual=rows)
        scale = float(shipped.abs().max())
        differences[self.self_attn.layer_idx] = float((out - shipped).abs().max()) / scale
    return out.view(summed.shape)


shipped_forward = fork.decoder_layer_forward
shipped_project_residual = fork._project_residual


def _bind_layer_forward(model, forward) -> None:
    """``sync_forwards`` keeps a layer forward it did not install: unbind it, so that the next one binds ``forward``."""
    for layer in model.base_model.layers:
        layer.__dict__.pop("forward", None)
    fork.decoder_layer_forward = forward


def timed_session(model, input_ids, norm_after: bool) -> dict:
    _bind_layer_forward(model, decoder_layer_norm_after if norm_after else shipped_forward)
    fork._project_residual = project_residual_with_squares if norm_after else shipped_project_residual
    try:
        return harness.session_steps(model, input_ids, fuse_projections=True, layer_kernels=True)
    finally:
        _bind_layer_forward(model, shipped_forward)
        fork._project_residual = shipped_project_residual


def main() -> None:
    harness.session_probe_main(__doc__, VARIANTS, timed_session, reference="shipped", batch=16, report=REPORT)


if __name__ == "__main__":
    main()
