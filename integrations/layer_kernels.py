"""``layer_kernels=True``: a patched model's RMSNorms, RoPE and SiLU-and-mul on flashcore's kernels.

With them (:mod:`flashcore.layer_ops`) the model's eager, graph-replayed and ``torch.compile``d steps compute the
same bits: inductor no longer fuses HF's norm and activation code its own way, it calls the same kernel the eager
step does. Per layer, four launches replace about 28 small eager kernels (HF's code: 8 per RMSNorm, 5 per RoPE of
q or of k, 2 for SwiGLU), which is what a graph-replayed step without inductor spent most of its time on at batch 1
(``benchmarks/NOTES.md``, entries 10 and 32). At one token per forward (a batch-1 decode step) the projections run
on flashcore's one-row GEMV too, which starts loading its weight while the kernel before it runs (entry 54), and
so does the LM head (:class:`HeadForward`), which at 2 to 16 rows runs on the few-row GEMM.

Every RMSNorm of the decoder (each layer's two, and the final one) gets a per-instance forward that calls
:func:`flashcore.layer_ops.rms_norm` (``LlamaRMSNorm``'s only hook, ``use_kernel_forward_from_hub``, works only with
the optional ``kernels`` package and Hub-hosted kernels). The RoPE and the SiLU-and-mul sit inside the attention
and MLP forwards, and at one token the residual adds move into their GEMVs, so this module only sets each decoder
layer's, attention's and MLP's ``_uses_layer_kernels`` switch, which :mod:`~flashcore.integrations.llama_forward_fork`
reads. :func:`~flashcore.integrations.llama.apply_flashcore_to_llama` calls :func:`check_supported`, :func:`enable`
and :func:`disable`.

What inductor still compiles around the kernels (the residual adds, where more than one token runs) must round as eager
does: HF's automatic compile gets ``emulate_precision_casts`` through the model's ``generation_config.compile_config``,
and ``DecodeSession(compile=True)`` sets it itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import CompileConfig

from flashcore import layer_ops

SUPPORTED_ACTIVATIONS = ("silu", "swish")


def rounding_compile_config() -> CompileConfig:
    """HF's default compile config (mode "reduce-overhead", i.e. inductor's ``triton.cudagraphs``; torch.compile
    takes a mode or options, not both, so it is spelled as its option) plus ``emulate_precision_casts``."""
    return CompileConfig(mode=None, options={"triton.cudagraphs": True, "emulate_precision_casts": True})


def check_supported(model: torch.nn.Module) -> None:
    """Raises ``NotImplementedError`` for a model whose layers the kernels cannot run; changes nothing."""
    activation = getattr(model.config, "hidden_act", None)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(
            f"layer_kernels=True runs SiLU-and-mul; config.hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got "
            f"{activation!r}"
        )
    for norm in _norms(model):
        if not hasattr(norm, "variance_epsilon"):
            raise NotImplementedError(f"layer_kernels=True needs RMSNorms with variance_epsilon, got {type(norm)}")


def enable(model: torch.nn.Module) -> None:
    """Norm forwards on the kernel, the LM head's on the GEMV and the switches on, in place.

    Where the model has no ``generation_config.compile_config`` of its own, it gets one for generate's automatic
    compile: HF's default (CUDA graphs) plus inductor's ``emulate_precision_casts``, without which inductor fuses a
    layer's two residual adds and skips the rounding of the first sum.
    """
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.compile_config is None:
        generation_config.compile_config = rounding_compile_config()  # its own: generate may edit it
    for norm in _norms(model):
        norm.forward = KernelNormForward(norm)
    for layer in model.base_model.layers:
        for module in (layer, layer.self_attn, layer.mlp):
            module._uses_layer_kernels = True
    head = _head(model)
    if head is not None and type(head) is torch.nn.Linear and "forward" not in head.__dict__:
        head.forward = HeadForward(head)


def disable(model: torch.nn.Module) -> None:
    """Undoes :func:`enable`; a compile config the user set stays."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.compile_config == rounding_compile_config():
        generation_config.compile_config = None
    for norm in _norms(model):
        norm.__dict__.pop("forward", None)
    for layer in model.base_model.layers:
        for module in (layer, layer.self_attn, layer.mlp):
            module.__dict__.pop("_uses_layer_kernels", None)
    head = _head(model)
    if head is not None and isinstance(head.__dict__.get("forward"), HeadForward):
        del head.forward


def runs_kernel_norm(norm: torch.nn.Module) -> bool:
    """Whether ``norm``'s forward is exactly :func:`flashcore.layer_ops.rms_norm` with its weight and epsilon (set by
    :func:`enable`, no hooks), so a GEMV may compute it instead (``layer_ops.gemv(..., norm_weight=...)``)."""
    return isinstance(norm.__dict__.get("forward"), KernelNormForward) and not (
        norm._forward_hooks or norm._forward_pre_hooks
    )


class KernelNormForward:
    """An RMSNorm's forward on :func:`flashcore.layer_ops.rms_norm`, set per instance by :func:`enable`. A class of
    its own, so that :func:`runs_kernel_norm` can tell it apart with an ``isinstance``, which ``torch.compile``
    traces as it runs."""

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return layer_ops.rms_norm(hidden_states, self.norm.weight, self.norm.variance_epsilon)


class HeadForward:
    """The LM head's forward, set by :func:`enable` where the head is a plain ``nn.Linear`` whose forward nothing
    else replaced: for one row (a batch-1 step's last token) flashcore's GEMV, for 2 to 16 (a decode step of a few
    rows) its few-row GEMM, both loading their weight while the final norm runs; else ``F.linear`` as ``nn.Linear``
    computes it."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        plain = type(linear.weight) is torch.nn.Parameter and not (linear._forward_hooks or linear._forward_pre_hooks)
        rows = x.numel() // x.shape[-1]
        if plain and rows == 1:
            return layer_ops.gemv(x, linear.weight, linear.bias)
        if plain and 1 < rows <= layer_ops.ROWS_GEMM_MAX_ROWS:
            return layer_ops.rows_gemm(x, linear.weight, linear.bias)
        return F.linear(x, linear.weight, linear.bias)


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = model.base_model
    layers = [norm for layer in decoder.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    return [*layers, decoder.norm]
