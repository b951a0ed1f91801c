"""``onednn_linears``: each projection and the LM head run their fp32 GEMM on oneDNN, on the CPU.

``nn.Linear`` calls ``F.linear``, whose fp32 GEMM on the CPU is PyTorch's BLAS (MKL in the PyPI wheels). PyTorch
ships oneDNN too (``torch.ops.mkldnn._linear_pointwise``, the kernel inductor compiles CPU linears to). On the
2-core AMD CPU (with AVX-512) of ``benchmarks/bench_cpu.py`` and SmolLM2-135M's shapes, oneDNN runs a prefill's
GEMMs 1.5-2.3x faster (2.1-2.3x at 3,000 tokens) and a decode step's GEMVs 1.0-1.5x
(``benchmarks/probes/cpu_linear.py``; NOTES.md, entry 50). The same fp32 arithmetic, in another summation order.

The weights are not touched: each ``nn.Linear`` gets an instance ``forward`` that hands its own ``weight`` and
``bias`` to oneDNN, so ``state_dict``, ``save_pretrained`` and tied embeddings see the model as it was. The forward
is for CPU tensors: a model moved to another device or dtype after the patch needs ``apply_flashcore_to_llama``
again, which picks the default's linears anew. Projections fused by ``fuse_projections`` (off by default) are one
GEMM that bypasses their modules; it stays on ``F.linear``, as does a step that ``torch.compile`` traces
(``DecodeSession(compile=True)`` on the CPU), whose GEMMs inductor picks. Inference only, as every flashcore path.

:func:`~flashcore.integrations.llama.apply_flashcore_to_llama` calls :func:`check_supported`, :func:`enable` and
:func:`disable`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Every decoder projection and the LM head."""
    modules = [
        getattr(getattr(layer, module), name)
        for layer in model.base_model.layers
        for module, names in _PROJECTIONS.items()
        for name in names
    ]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return modules + ([head] if head is not None else [])


def runs_on_onednn(linear: torch.nn.Linear) -> bool:
    """What the default (``onednn_linears=None``) turns on: an fp32 CPU linear, where oneDNN is available."""
    weight = linear.weight
    return torch.backends.mkldnn.is_available() and weight.device.type == "cpu" and weight.dtype == torch.float32


def check_supported(model: torch.nn.Module) -> None:
    """Refuses ``onednn_linears=True`` on a model with a linear it cannot run; changes nothing."""
    if not torch.backends.mkldnn.is_available():
        raise NotImplementedError("onednn_linears=True needs a PyTorch built with oneDNN (torch.backends.mkldnn)")
    for linear in linears(model):
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError(
                f"onednn_linears=True runs fp32 CPU linears, but a weight is {linear.weight.dtype} on "
                f"{linear.weight.device}; leave it None (on for fp32 CPU weights only) or False"
            )
        if has_other_forward(linear):
            raise NotImplementedError(
                "onednn_linears=True found a linear whose forward something else replaced (accelerate's offloading "
                "hooks?); leave it None (such linears keep their forward) or False"
            )


def enable(model: torch.nn.Module, *, only_default: bool) -> None:
    """Gives every linear (with ``only_default``, every one :func:`runs_on_onednn` picks) the oneDNN forward."""
    for linear in linears(model):
        if not has_other_forward(linear) and (not only_default or runs_on_onednn(linear)):
            linear.forward = types.MethodType(_onednn_forward, linear)


def disable(model: torch.nn.Module) -> None:
    """Gives every linear its class forward back."""
    for linear in linears(model):
        if _runs_onednn_forward(linear):
            del linear.forward


def _onednn_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` on oneDNN: ``input @ weight.T + bias``, the weight as stored. While ``torch.compile``
    traces, ``F.linear``: inductor picks its own GEMM, and its lowering of this op takes only the prepacked weights
    of its freezing pass."""
    if torch.compiler.is_compiling():
        return F.linear(input, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(input, self.weight, self.bias, "none", [None], "")


def _runs_onednn_forward(linear: torch.nn.Module) -> bool:
    forward = linear.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _onednn_forward


def has_other_forward(linear: torch.nn.Module) -> bool:
    """Whether something other than this module replaced the linear's forward (an instance ``forward``)."""
    return "forward" in linear.__dict__ and not _runs_onednn_forward(linear)
