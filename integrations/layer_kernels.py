"""``use_layer_kernels``: a patched model's RMSNorms, RoPE and SiLU-and-mul on flashcore's kernels.

With them (:mod:`flashcore.layer_ops`) the model's eager, graph-replayed and ``torch.compile``d steps compute the
same bits: inductor no longer fuses HF's norm and activation code its own way, it calls the same kernel the eager
step does. Per layer, four launches replace about 28 small eager kernels (HF's code: 8 per RMSNorm, 5 per RoPE of
q or of k, 2 for SwiGLU), which is what a graph-replayed step without inductor spent most of its time on at batch 1
(``benchmarks/NOTES.md``, entries 10 and 32).

Only per-instance forwards change: every RMSNorm of the decoder (each layer's two, and the final one), each
attention and each MLP. The attention and MLP forwards here are also the ones
:func:`~flashcore.integrations.fused_projections.fuse_projections` installs. They read two per-instance switches:
``_fused_projection`` (one GEMM for q/k/v or for gate/up) and ``_uses_layer_kernels``. The attention forward is
transformers' ``LlamaAttention.forward`` (5.17 to 5.24; it takes the cache under either keyword, see
:data:`~flashcore.integrations.llama.CACHE_ARGUMENT_NAME`) with those two switches, calling flashcore's attention
function directly, which is why both need :func:`~flashcore.integrations.llama.apply_flashcore_to_llama` first.

What inductor still compiles around the kernels (the residual adds) must round as eager does: HF's automatic
compile gets ``emulate_precision_casts`` through the model's ``generation_config.compile_config``, and
``DecodeSession(compile=True)`` sets it itself.
"""

from __future__ import annotations

import types

import torch
from transformers import CompileConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from flashcore import layer_ops
from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, _flashcore_attention

__all__ = ["remove_layer_kernels", "use_layer_kernels"]

SUPPORTED_ACTIVATIONS = ("silu", "swish")


def rounding_compile_config() -> CompileConfig:
    """HF's default compile config (mode "reduce-overhead", i.e. inductor's ``triton.cudagraphs``; torch.compile
    takes a mode or options, not both, so it is spelled as its option) plus ``emulate_precision_casts``."""
    return CompileConfig(mode=None, options={"triton.cudagraphs": True, "emulate_precision_casts": True})


def use_layer_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """Runs every RMSNorm, the RoPE and the SiLU-and-mul of a patched model on flashcore's kernels, in place.

    The model must already be patched by ``apply_flashcore_to_llama``. Idempotent; ``remove_flashcore`` (or
    :func:`remove_layer_kernels`) undoes it. Where the model has no ``generation_config.compile_config`` of its
    own, it gets one for generate's automatic compile: HF's default (CUDA graphs) plus inductor's
    ``emulate_precision_casts``, without which inductor fuses a layer's two residual adds and skips the rounding
    of the first sum. The kernels round where HF's eager code rounds, so outputs differ from
    the model's own layers only in the norm's summation order and the ``exp``/``rsqrt`` implementations; they run
    on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (elsewhere the forward raises).

    Returns:
        The same model object.

    Example: ``tests/test_layer_kernels.py::test_bf16_tokens_equal_eagerly_replayed_and_compiled``.
    """
    state = model.__dict__.get("_flashcore_state")
    if state is None:
        raise ValueError("use_layer_kernels needs a model patched by apply_flashcore_to_llama(model) first")
    activation = getattr(model.config, "hidden_act", None)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise NotImplementedError(
            f"use_layer_kernels runs SiLU-and-mul; config.hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got "
            f"{activation!r}"
        )
    norms = _norms(model)
    for norm in norms:
        if not hasattr(norm, "variance_epsilon"):
            raise NotImplementedError(f"use_layer_kernels needs RMSNorms with variance_epsilon, got {type(norm)}")
    if remove_layer_kernels not in state.undo_on_remove:
        state.undo_on_remove.append(remove_layer_kernels)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.compile_config is None:
        generation_config.compile_config = rounding_compile_config()  # its own: generate may edit it
    for norm in norms:
        norm.forward = types.MethodType(_rms_norm_forward, norm)
    for layer in model.base_model.layers:
        for module in (layer.self_attn, layer.mlp):
            module._uses_layer_kernels = True
        install_forwards(layer)
    return model


def remove_layer_kernels(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes :func:`use_layer_kernels`; a fused projection (``fuse_projections``) stays."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.compile_config == rounding_compile_config():
        generation_config.compile_config = None
    for norm in _norms(model):
        norm.__dict__.pop("forward", None)
    for layer in model.base_model.layers:
        for module in (layer.self_attn, layer.mlp):
            module.__dict__.pop("_uses_layer_kernels", None)
        restore_class_forwards(layer)
    return model


def install_forwards(layer: torch.nn.Module) -> None:
    """Gives the layer's attention and MLP the forwards below (which read the two switches)."""
    layer.self_attn.forward = types.MethodType(_attention_forward, layer.self_attn)
    layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)


def restore_class_forwards(layer: torch.nn.Module) -> None:
    """Gives the attention and MLP their class forwards back once neither switch is on."""
    for module in (layer.self_attn, layer.mlp):
        if "_fused_projection" not in module.__dict__ and "_uses_layer_kernels" not in module.__dict__:
            module.__dict__.pop("forward", None)


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = model.base_model
    layers = [norm for layer in decoder.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    return [*layers, decoder.norm]


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return layer_ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    cache = kwargs.pop(CACHE_ARGUMENT_NAME, None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    fused = self.__dict__.get("_fused_projection")
    if fused is not None:
        projected = fused(hidden_states)
    else:
        projected = (self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states))
    query, key, value = (states.view(hidden_shape).transpose(1, 2) for states in projected)
    cos, sin = position_embeddings
    if self.__dict__.get("_uses_layer_kernels"):
        query, key = layer_ops.apply_rotary_embedding(query, key, cos, sin)
    else:
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    attention_output, _ = _flashcore_attention(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
    return self.o_proj(attention_output.reshape(*input_shape, -1).contiguous()), None


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    fused = self.__dict__.get("_fused_projection")
    gate, up = fused(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
    if self.__dict__.get("_uses_layer_kernels"):
        return self.down_proj(layer_ops.silu_and_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)
