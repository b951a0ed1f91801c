"""``fuse_projections``: one GEMM for q/k/v and one for gate/up in every decoder layer of a patched model.

At batch 1 a decode step is a chain of GEMVs, and the small ones do not stream at bandwidth: on the H100, in the
Llama-3.2-1B-shaped model, the 2 MB k and v projections take 5.2 us each (0.4 TB/s) against 5.9 us for the 8 MB
q projection (``benchmarks/NOTES.md``, entry 10). Projections that read the same input are concatenated along
their outputs, so each layer launches two GEMMs where it launched five.

The original parameters become views of the concatenated weight: no memory is added, ``model.parameters()`` counts
the same bytes, and a ``state_dict`` (so ``save_pretrained``) still has every HF name. :func:`unfuse_projections`
gives each parameter its own storage again and restores the class forwards.

Only the two ``forward`` methods change, per instance, to the ones
:mod:`~flashcore.integrations.layer_kernels` defines for both of flashcore's layer switches; they call flashcore's
attention function directly, which is why this needs :func:`~flashcore.integrations.llama.apply_flashcore_to_llama`
first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashcore.integrations.layer_kernels import install_forwards, restore_class_forwards

__all__ = ["fuse_projections", "unfuse_projections"]

_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_MLP_PROJECTIONS = ("gate_proj", "up_proj")


def fuse_projections(model: torch.nn.Module) -> torch.nn.Module:
    """Concatenates each layer's q/k/v and gate/up projections into one GEMM each, in place; idempotent.

    The model must already be patched by ``apply_flashcore_to_llama`` and placed on its device and dtype (the
    concatenated weights are built where the parameters are, and ``model.to()`` afterwards would move only the
    views' copies). Results equal the unfused model's up to the GEMM's summation order. ``remove_flashcore``
    also unfuses (the fused forward calls flashcore's attention directly).
    """
    state = model.__dict__.get("_flashcore_state")
    if state is None:
        raise ValueError("fuse_projections needs a model patched by apply_flashcore_to_llama(model) first")
    if unfuse_projections not in state.undo_on_remove:
        state.undo_on_remove.append(unfuse_projections)
    for layer in model.base_model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if "_fused_projection" in attention.__dict__:
            continue
        attention._fused_projection = _concatenate(attention, _ATTENTION_PROJECTIONS)
        mlp._fused_projection = _concatenate(mlp, _MLP_PROJECTIONS)
        install_forwards(layer)
    return model


def unfuse_projections(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes :func:`fuse_projections`: each projection gets its own storage back, the class forwards return
    (unless ``use_layer_kernels`` still needs flashcore's)."""
    for layer in model.base_model.layers:
        for module, names in ((layer.self_attn, _ATTENTION_PROJECTIONS), (layer.mlp, _MLP_PROJECTIONS)):
            if module.__dict__.pop("_fused_projection", None) is None:
                continue
            for name in names:
                linear = getattr(module, name)
                linear.weight = torch.nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
                if linear.bias is not None:
                    linear.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        restore_class_forwards(layer)
    return model


class _FusedLinear:
    """The concatenated weight (and bias) of several ``nn.Linear`` that read one input, and their output sizes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: list[int]) -> None:
        self.weight, self.bias, self.out_features = weight, bias, out_features

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.out_features, dim=-1)


@torch.no_grad()
def _concatenate(module: torch.nn.Module, names: tuple[str, ...]) -> _FusedLinear:
    linears = [getattr(module, name) for name in names]
    has_bias = {linear.bias is not None for linear in linears}
    if len(has_bias) != 1:
        raise NotImplementedError(f"fuse_projections needs {names} all with or all without a bias")
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears]) if has_bias == {True} else None
    out_features = [linear.out_features for linear in linears]
    start = 0
    for linear, size in zip(linears, out_features, strict=True):
        linear.weight = torch.nn.Parameter(weight[start : start + size], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + size], requires_grad=False)
        start += size
    return _FusedLinear(weight, bias, out_features)
