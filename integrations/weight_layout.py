"""``input_major_weights``: each projection's weight stored as the transpose of a contiguous ``[in, out]`` tensor.

At batch 1 a decode step's projections and LM head are GEMVs, and a CPU decode step is little else. ``F.linear``
computes ``x @ W.T``; with ``W`` stored ``[out, in]`` (PyTorch's layout) MKL's fp32 GEMV streams it at 14-18 GB/s
on the 2-core CPU of ``benchmarks/bench_cpu.py``, with ``W.T`` contiguous at 19-25 GB/s: SmolLM2's gate/up GEMV
1.4x and its LM head 1.6x faster (``benchmarks/probes/cpu_weight_layout.py``; NOTES.md, entry 50). The GEMMs of a
prefill run at the same speed either way. In 16-bit the CPU's GEMV (oneDNN) is slower on such weights, so the
default converts fp32 weights on the CPU only.

Each weight keeps its Parameter, shape, values and name: ``linear.weight`` becomes a ``[out, in]`` view with
strides ``(1, out)`` of new storage, which ``F.linear`` hands to the GEMM without a copy, and the forwards are
unchanged. No memory is added (one weight at a time is copied). Results equal the row-major model's up to the
GEMVs' summation order. An LM head tied to the input embeddings stays tied; the embedding lookup then gathers
strided rows, which costs about 18 ms on a 3,000-token prompt against the LM head's 2.7 ms saved per token.

Projections fused by ``fuse_projections`` (off by default) keep their concatenated weight row-major: their
Parameters are views of it, and transformers' ``save_pretrained`` cannot write views of a transposed tensor (its
check for shared storage flattens each with ``view(-1)``).

:func:`~flashcore.integrations.llama.apply_flashcore_to_llama` calls :func:`restore` before it fuses or unfuses
projections and :func:`convert` after.
"""

from __future__ import annotations

import torch

_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def wants_input_major(weight: torch.Tensor) -> bool:
    """The default (``input_major_weights=None``): fp32 weights on the CPU, where it streams faster."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def convert(model: torch.nn.Module, *, only_default: bool) -> None:
    """Stores every unfused decoder projection's weight and the LM head's input-major, in place; with
    ``only_default``, just the weights :func:`wants_input_major` picks. A weight already input-major is left as it
    is."""
    _relayout(model, lambda weight: weight.t().contiguous().t(), wants_input_major if only_default else None)


def restore(model: torch.nn.Module) -> None:
    """Undoes :func:`convert`: every such weight contiguous (``[out, in]`` row-major) again."""
    _relayout(model, lambda weight: weight.contiguous(), None)


def is_input_major(weight: torch.Tensor) -> bool:
    """Stored as the transpose of a contiguous tensor."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


@torch.no_grad()
def _relayout(model: torch.nn.Module, layout, picks) -> None:
    """Gives each unfused projection's weight and the LM head's ``layout(weight)`` where ``picks`` is None or says
    so, keeping the ties that point at it."""
    for layer in model.base_model.layers:
        for module_name, names in _PROJECTIONS.items():
            module = getattr(layer, module_name)
            fused = module.__dict__.get("_fused_projection")
            for name in names[len(fused.out_features) if fused is not None else 0 :]:
                _set_weight(model, getattr(module, name), layout, picks)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        _set_weight(model, head, layout, picks)


def _set_weight(model: torch.nn.Module, module: torch.nn.Module, layout, picks) -> None:
    """``module.weight = layout(module.weight)``, and the same new Parameter wherever the old one was tied."""
    old = module.weight
    if picks is not None and not picks(old):
        return
    new = layout(old)
    if new.data_ptr() == old.data_ptr():  # already in that layout
        return
    new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    for holder in model.modules():
        for name, parameter in holder._parameters.items():
            if parameter is old:
                holder._parameters[name] = new
