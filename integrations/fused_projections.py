"""``fuse_projections=True``: one GEMM for q/k/v and one for gate/up in every decoder layer of a patched model.

At batch 1 a decode step is a chain of GEMVs, and the small ones do not stream at bandwidth: on the H100, in the
Llama-3.2-1B-shaped model, the 2 MB k and v projections take 5.2 us each (0.4 TB/s) against 5.9 us for the 8 MB
q projection (``benchmarks/NOTES.md``, entry 10). Projections that read the same input are concatenated along
their outputs, so each layer launches two GEMMs where it launched five.

The original parameters become views of the concatenated weight: no memory is added, ``model.parameters()`` counts
the same bytes, and a ``state_dict`` (so ``save_pretrained``) still has every HF name. :func:`unfuse` gives each
parameter its own storage again.

The fused weight sits in each attention's and MLP's ``_fused_projection``, which the forwards of
:mod:`~flashcore.integrations.llama_forward_fork` read. :func:`~flashcore.integrations.llama.apply_flashcore_to_llama`
calls :func:`check_supported`, :func:`fuse` and :func:`unfuse`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj")


def check_supported(model: torch.nn.Module) -> None:
    """Raises ``NotImplementedError`` for a layer whose projections cannot be fused; changes nothing."""
    for layer in model.base_model.layers:
        for module, names in ((layer.self_attn, _ATTENTION_PROJECTIONS), (layer.mlp, _MLP_PROJECTIONS)):
            if len({getattr(module, name).bias is not None for name in names}) != 1:
                raise NotImplementedError(f"fuse_projections=True needs {names} all with or all without a bias")


def fuse(model: torch.nn.Module) -> None:
    """Concatenates each layer's q/k/v and gate/up projections into one GEMM each, in place.

    The model must be placed on its device and dtype first (the concatenated weights are built where the
    parameters are, and ``model.to()`` afterwards would move only the views' copies). Results equal the unfused
    model's up to the GEMM's summation order.
    """
    for layer in model.base_model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if "_fused_projection" not in attention.__dict__:
            attention._fused_projection = _concatenate(attention, _ATTENTION_PROJECTIONS)
            mlp._fused_projection = _concatenate(mlp, _MLP_PROJECTIONS)


def unfuse(model: torch.nn.Module) -> None:
    """Undoes :func:`fuse`: each projection gets its own storage back."""
    for layer in model.base_model.layers:
        for module, names in ((layer.self_attn, _ATTENTION_PROJECTIONS), (layer.mlp, _MLP_PROJECTIONS)):
            if module.__dict__.pop("_fused_projection", None) is None:
                continue
            for name in names:
                linear = getattr(module, name)
                linear.weight = torch.nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
                if linear.bias is not None:
                    linear.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)


class _FusedLinear:
    """The concatenated weight (and bias) of several ``nn.Linear`` that read one input, and their output sizes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: list[int]) -> None:
        self.weight, self.bias, self.out_features = weight, bias, out_features

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.out_features, dim=-1)


@torch.no_grad()
def _concatenate(module: torch.nn.Module, names: tuple[str, ...]) -> _FusedLinear:
    linears = [getattr(module, name) for name in names]
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears]) if linears[0].bias is not None else None
    out_features = [linear.out_features for linear in linears]
    start = 0
    for linear, size in zip(linears, out_features, strict=True):
        linear.weight = torch.nn.Parameter(weight[start : start + size], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + size], requires_grad=False)
        start += size
    return _FusedLinear(weight, bias, out_features)
