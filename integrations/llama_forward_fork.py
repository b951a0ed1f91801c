"""A fork of transformers' ``LlamaDecoderLayer.forward``, ``LlamaAttention.forward`` and ``LlamaMLP.forward``
(``models/llama/modeling_llama.py``, transformers 5.17 through 5.24: the two ends differ only in the cache keyword,
``past_key_values`` until 5.24 and ``cache`` from it, and in 5.24 passing its kwargs on to ``cache.update``; Qwen2's
and Mistral's attention differ from Llama's only in passing their ``sliding_window``, and their decoder layers are
Llama's). It is installed per instance, only on models that use one of the options below, and no other file of
flashcore forks transformers code.

Two options of :func:`~flashcore.integrations.llama.apply_flashcore_to_llama` change what happens *inside* these
forwards, and transformers has no extension point there:

- ``layer_kernels=True`` replaces the RoPE, which ``LlamaAttention.forward`` calls as the module-level function
  ``apply_rotary_pos_emb``. Its only hook, ``use_kernelized_func`` / ``use_kernel_forward_from_hub``, exists only with
  the optional ``kernels`` package installed and maps names to kernels hosted on the Hub; without it the decorators are
  no-ops. Reassigning ``modeling_llama.apply_rotary_pos_emb`` would change every model in the process, patched or not.
  It also replaces the SiLU-and-mul of ``LlamaMLP.forward`` (``act_fn(gate_proj(x)) * up_proj(x)``), which is not a
  module of its own, and, for an input of one token, runs the projections on flashcore's one-row GEMV
  (:func:`flashcore.layer_ops.gemv`) instead of their modules. That GEMV also takes the decoder layer's RMSNorms,
  the RoPE and the residual adds, and the down projection's GEMV the SiLU-and-mul
  (:func:`flashcore.layer_ops.silu_and_mul_gemv`): four launches per layer where there were ten. At 2 to 16 rows
  the down projection runs on flashcore's few-row GEMM (:func:`flashcore.layer_ops.rows_gemm`), which takes the
  SiLU-and-mul and the residual add after it, and so does the q/k/v projection, with the input RMSNorm before it
  and the RoPE after it, where the GEMM can rotate q and k. So with the layer
  kernels the decoder layer's forward hands each sublayer its norm and its residual. The attention and the MLP
  forwards apply the norm first (or inside the GEMV) and return the residual added (``residual + o_proj(...)``,
  ``residual + down_proj(...)``), what stock's layer computes around them. At more than one token, where the
  projections are GEMMs, the add after attention and the norm after it run as one kernel between the two.
- ``fuse_projections=True`` computes q, k and v (and gate and up) with one GEMM, whose output the stock forwards
  cannot take: they call each projection module separately.

Each forward here is the stock one with exactly those two switches, read from per-instance attributes that the feature
modules set (``_fused_projection``: :mod:`~flashcore.integrations.fused_projections`; ``_uses_layer_kernels``:
:mod:`~flashcore.integrations.layer_kernels`, on the decoder layer, its attention and its MLP); with both off it
computes what the stock forward computes. The attention function is looked up as transformers looks it up, so the fork
runs whichever attention the model is set to. Only :func:`sync_forwards`, called by ``apply_flashcore_to_llama`` and
``remove_flashcore`` once the switches are set, installs or removes these forwards.
"""

from __future__ import annotations

import types

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from flashcore import layer_ops
from flashcore.integrations import layer_kernels, onednn_linears

SWITCHES = ("_fused_projection", "_uses_layer_kernels")


def sync_forwards(model: torch.nn.Module) -> None:
    """Gives each layer's attention and MLP the forward below while a switch is on, and its class forward otherwise;
    the same for the decoder layer, except where something else replaced its forward (accelerate's ``device_map``
    hooks wrap the layer's): that forward is kept, and it adds the residuals as stock's layer does."""
    for layer in model.base_model.layers:
        for module, forward in ((layer.self_attn, attention_forward), (layer.mlp, mlp_forward)):
            if any(switch in module.__dict__ for switch in SWITCHES):
                module.forward = types.MethodType(forward, module)
            else:
                module.__dict__.pop("forward", None)
        current = layer.__dict__.get("forward")
        if current is None or getattr(current, "__func__", None) is decoder_layer_forward:
            if "_uses_layer_kernels" in layer.__dict__:
                layer.forward = types.MethodType(decoder_layer_forward, layer)
            else:
                layer.__dict__.pop("forward", None)


def decoder_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` with each RMSNorm and residual add handed to the sublayer after and before it,
    whose forwards (below) take ``norm`` and ``residual``; installed with the layer kernels only. At one token the
    GEMVs compute them. At more, the add after attention and the norm after that add run as one kernel
    (:func:`flashcore.layer_ops.add_rms_norm`) between the sublayers. ``kwargs`` (the mask, positions, cache and
    rotary embedding, by whichever names the model passes them) go to the attention as stock's do."""
    residual = hidden_states
    norm = self.post_attention_layernorm
    if _runs_gemv(self, hidden_states) or not layer_kernels.runs_kernel_norm(norm):
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, norm=self.input_layernorm, residual=residual, **kwargs
        )
        return self.mlp(hidden_states, norm=norm, residual=hidden_states)
    # More than one token: the projections are GEMMs that take no residual or norm, so the add after attention and
    # the norm before the MLP run as one kernel.
    attn_output, _ = self.self_attn(hidden_states=hidden_states, norm=self.input_layernorm, **kwargs)
    hidden_states, normed = layer_ops.add_rms_norm(attn_output, residual, norm.weight, norm.variance_epsilon)
    return self.mlp(normed, residual=hidden_states)


def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LlamaAttention.forward``; the decoder layer passes the cache as ``cache`` (5.24) or ``past_key_values``.
    From :func:`decoder_layer_forward`, ``norm`` (the layer's input RMSNorm, still to apply to ``hidden_states``) and
    ``residual``: it then returns ``residual + o_proj(...)``."""
    cache = kwargs.pop("cache", None)
    cache = kwargs.pop("past_key_values", None) if cache is None else cache
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    cos, sin = position_embeddings
    rotary = (cos, sin) if layer_ops.gemv_can_rotate(self.head_dim) else None
    projected, rotated = _project(self, hidden_states, ("q_proj", "k_proj", "v_proj"), norm, rotary=rotary)
    query_states, key_states, value_states = (states.view(hidden_shape).transpose(1, 2) for states in projected)

    if not rotated:
        rope = layer_ops.apply_rotary_embedding if self.__dict__.get("_uses_layer_kernels") else apply_rotary_pos_emb
        query_states, key_states = rope(query_states, key_states, cos, sin)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),  # Qwen2's and Mistral's forward pass theirs
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = _project_residual(self, attn_output, "o_proj", residual)
    return attn_output, attn_weights


def mlp_forward(
    self, x: torch.Tensor, norm: torch.nn.Module | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``LlamaMLP.forward``; with ``norm`` and ``residual`` (from :func:`decoder_layer_forward`) it returns
    ``residual + mlp(norm(x))``."""
    fused = self.__dict__.get("_fused_projection")
    if (
        norm is None
        and fused is not None
        and _runs_rows_gemm(self, x)
        and layer_ops.rows_gemm_streams(x, fused.weight, swiglu=True)
    ):
        # The few-row GEMM's TMA kernel computes the SiLU-and-mul in its epilogue: the down projection is then a plain
        # GEMM, with the residual add in its own epilogue (NOTES.md, entry 72); both in one launch where
        # rows_mlp_fuses (entry 80).
        down = self.down_proj
        if _is_plain_linear(down) and layer_ops.rows_mlp_fuses(x, fused.weight, down.weight):
            return layer_ops.rows_mlp(x, fused.weight, fused.bias, down.weight, down.bias, residual=residual)
        activated = layer_ops.rows_gemm(x, fused.weight, fused.bias, swiglu=True)
        return _project_residual(self, activated, "down_proj", residual)
    (gate, up), _ = _project(self, x, ("gate_proj", "up_proj"), norm)
    if not self.__dict__.get("_uses_layer_kernels"):
        return self.down_proj(self.act_fn(gate) * up)
    return _project_residual(self, gate, "down_proj", residual, up=up)


def _project(
    module: torch.nn.Module,
    x: torch.Tensor,
    names: tuple[str, ...],
    norm: torch.nn.Module | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(outputs, rotated)``: the projections ``names`` of ``module`` applied to ``x``, or to ``norm(x)`` where a
    norm is given; ``rotated`` says whether the first two (q and k) also got the rotary embedding ``rotary``
    (``(cos, sin)``, or None).

    Through the fused GEMM where the module has one (``names`` are then the ones it fused). On flashcore's one-row
    GEMV where :func:`_runs_gemv`, and on its few-row GEMM where :func:`_rows_gemm_rotates` (the q/k/v projection of
    a decode step of a few rows), where every projection is the fused one or a plain ``nn.Linear``: no hooks (tensor
    parallelism's are hooks) and no forward replaced by anything but ``onednn_linears``. The kernel then computes
    the norm too where that runs flashcore's (``runs_kernel_norm``), and the rotary embedding where one is given.
    Otherwise each module, as the stock forward calls it."""
    fused = module.__dict__.get("_fused_projection") if len(names) > 1 else None
    linears = [fused] if fused is not None else [getattr(module, name) for name in names]
    plain = fused is not None or all(map(_is_plain_linear, linears))
    one_row = _runs_gemv(module, x) and plain
    few_rows = not one_row and plain and _rows_gemm_rotates(module, x, fused, linears, rotary)
    if norm is not None and not ((one_row or few_rows) and layer_kernels.runs_kernel_norm(norm)):
        x, norm = norm(x), None
    if not (one_row or few_rows):
        return (fused(x) if fused is not None else tuple(linear(x) for linear in linears)), False
    project = layer_ops.gemv if one_row else layer_ops.rows_gemm
    folded = {} if norm is None else dict(norm_weight=norm.weight, eps=norm.variance_epsilon)
    rotation = {} if rotary is None else dict(cos=rotary[0], sin=rotary[1])
    if fused is not None:
        if rotary is not None:
            rotation["rotated"] = sum(fused.out_features[:2])  # the q and k rows of q/k/v
        out = project(x, fused.weight, fused.bias, **folded, **rotation)
        return out.split(fused.out_features, dim=-1), rotary is not None
    outputs = tuple(
        project(x, linear.weight, linear.bias, **folded, **(rotation if i < 2 else {}))
        for i, linear in enumerate(linears)
    )
    return outputs, rotary is not None


def _project_residual(
    module: torch.nn.Module,
    x: torch.Tensor,
    name: str,
    residual: torch.Tensor | None,
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + module.<name>(x)`` (the projection alone without a residual); with ``up``, of
    ``silu_and_mul(x, up)``, the down projection. Where :func:`_project` would run the GEMV, the residual and the
    SiLU-and-mul run inside it; so they do in the down projection's few-row GEMM, at 2 to 16 rows with the layer
    kernels (:func:`flashcore.layer_ops.rows_gemm`), which also takes the o projection and a down projection after
    the SiLU-and-mul where its TMA kernel streams the weight (``rows_gemm_streams``)."""
    linear = getattr(module, name)
    if _runs_gemv(module, x) and _is_plain_linear(linear):
        if up is None:
            return layer_ops.gemv(x, linear.weight, linear.bias, residual=residual)
        return layer_ops.silu_and_mul_gemv(x, up, linear.weight, linear.bias, residual=residual)
    if (
        _runs_rows_gemm(module, x)
        and _is_plain_linear(linear)
        and (up is not None or layer_ops.rows_gemm_streams(x, linear.weight))
    ):
        return layer_ops.rows_gemm(x, linear.weight, linear.bias, up=up, residual=residual)
    x = x if up is None else layer_ops.silu_and_mul(x, up)
    adds_in_place = residual is not None and residual.is_cuda and residual.is_contiguous() and linear.bias is None
    if up is not None and adds_in_place and _is_plain_linear(linear):
        # A prefill's down projection: the residual added in cuBLAS's epilogue (beta = 1), in place, one launch and
        # one rounding fewer (NOTES.md, entry 84). In place: torch.addmm would first copy the residual into its
        # output. The residual here is the layer's own sum after attention (decoder_layer_forward), read by nothing
        # after this add.
        residual.view(-1, residual.shape[-1]).addmm_(x.view(-1, x.shape[-1]), linear.weight.t())
        return residual
    out = linear(x)
    return out if residual is None else residual + out


def _runs_gemv(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """The layer kernels are on and ``x`` is a single token: a batch-1 decode step."""
    return bool(module.__dict__.get("_uses_layer_kernels")) and x.numel() == x.shape[-1]


def _runs_rows_gemm(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """The layer kernels are on and ``x`` holds 2 to ``layer_ops.ROWS_GEMM_MAX_ROWS`` rows: a decode step of a few
    rows, or a short prefill."""
    rows = x.numel() // x.shape[-1]
    return bool(module.__dict__.get("_uses_layer_kernels")) and 1 < rows <= layer_ops.ROWS_GEMM_MAX_ROWS


def _rows_gemm_rotates(
    module: torch.nn.Module,
    x: torch.Tensor,
    fused: torch.nn.Module | None,
    linears: list[torch.nn.Module],
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
) -> bool:
    """The q/k/v projection of 2 to 16 rows (:func:`_runs_rows_gemm`) with a rotary embedding of one row per row of
    ``x``, whose q and k outputs the few-row GEMM can rotate (``layer_ops.rows_gemm_can_rotate``): it then takes the
    layer's norm before it and the RoPE after it, two launches a layer fewer (NOTES.md, entry 68)."""
    rows = x.numel() // x.shape[-1]
    if rotary is None or not _runs_rows_gemm(module, x) or rotary[0].numel() != rows * rotary[0].shape[-1]:
        return False
    rotated = [sum(fused.out_features[:2])] if fused is not None else [linear.out_features for linear in linears[:2]]
    return all(map(layer_ops.rows_gemm_can_rotate, rotated))


def _is_plain_linear(linear: torch.nn.Module) -> bool:
    return (
        type(linear) is torch.nn.Linear
        and not onednn_linears.has_other_forward(linear)
        and not (linear._forward_hooks or linear._forward_pre_hooks)
        and type(linear.weight) is torch.nn.Parameter
    )
