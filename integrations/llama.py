"""``apply_flashcore_to_llama``: routes a loaded HF LLaMA-family model's attention through flashcore.

Everything goes through transformers' extension points; no modeling symbol is replaced:

- an attention function and a mask function registered under :data:`ATTENTION_IMPLEMENTATION` with
  ``AttentionInterface`` / ``AttentionMaskInterface``, selected with ``model.set_attn_implementation``;
- a forward pre-hook on every attention module that hands the cache (which ``LlamaAttention.forward`` consumes
  itself) to the attention function, where :func:`flashcore.attention_with_kv_cache` appends and attends in one
  launch; :class:`FlashCoreCache`'s ``update()`` copies nothing;
- a forward pre-hook on the decoder that gives a ``use_cache`` forward without a cache a :class:`FlashCoreCache`
  where transformers would build a ``DynamicCache``;
- for ``generate``, an instance attribute ``_prepare_cache_for_generation`` that wraps the class method (same
  signature in transformers 5.17 to 5.24) and swaps the ``DynamicCache``/``StaticCache`` it builds for a
  :class:`FlashCoreCache` of the same capacity. It runs before generate decides to compile the decode step, so
  on CUDA ``generate`` compiles it (``is_compileable``) as it would for a ``StaticCache``.

Left-padded rows are compacted before the launch: each row's valid new tokens move to the front (a stable argsort
of the padding mask) and their count goes in ``query_lens``, so pads are never attended and never stored; outputs
are scattered back. RoPE is applied by the model from generate's ``position_ids`` before the attention function.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from packaging.version import Version

MIN_SUPPORTED_TRANSFORMERS_VERSION = "5.17.0"
if Version(transformers.__version__) < Version(MIN_SUPPORTED_TRANSFORMERS_VERSION):
    raise ImportError(
        f"flashcore.integrations.llama needs transformers>={MIN_SUPPORTED_TRANSFORMERS_VERSION} (found "
        f"{transformers.__version__}); install it with: "
        f"pip install 'transformers>={MIN_SUPPORTED_TRANSFORMERS_VERSION},<6'"
    )

from transformers import AttentionInterface, DynamicCache, PreTrainedModel, StaticCache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaModel  # noqa: E402

from flashcore.integrations.cache import FlashCoreCache, check_full_attention_only  # noqa: E402
from flashcore.ops import BACKENDS, attention_with_kv_cache  # noqa: E402

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "CACHE_ARGUMENT_NAME",
    "FlashCoreCache",
    "apply_flashcore_to_llama",
    "remove_flashcore",
]

ATTENTION_IMPLEMENTATION = "fcore_kv"
"""The registered name. transformers treats any name containing "flash" as FlashAttention (and tries to import it),
and "sdpa"/"flex_attention"/"paged|" or an "org/repo" pattern have meanings of their own, hence no "flashcore"."""


def _cache_argument_name() -> str:
    """The keyword under which this transformers passes the KV cache: ``cache`` from 5.24, ``past_key_values`` before.

    5.24 renamed it everywhere at once: every model's and layer's ``forward`` (``models/llama/modeling_llama.py``),
    generate's ``model_kwargs`` (``generation/utils.py``) and the output fields (``modeling_outputs.py``; the old
    name is read through a property of ``ModelOutput`` in ``utils/generic.py``). The old keyword still reaches
    ``forward`` through ``@deprecate_kwarg``, but a forward pre-hook sees it as the caller spelled it, before that
    shim renames it.
    """
    parameters = inspect.signature(LlamaModel.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ImportError(
        f"flashcore.integrations.llama found neither `cache` nor `past_key_values` among LlamaModel.forward's "
        f"parameters in transformers {transformers.__version__}; install transformers>="
        f"{MIN_SUPPORTED_TRANSFORMERS_VERSION},<6"
    )


CACHE_ARGUMENT_NAME = _cache_argument_name()
"""Pass the cache as ``model(..., **{CACHE_ARGUMENT_NAME: cache})`` and read it back with
``getattr(outputs, CACHE_ARGUMENT_NAME)`` to run on every supported transformers version."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_GENERATION_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


@dataclass
class _FlashCoreState:
    """What apply_flashcore_to_llama changed on one model, so that remove_flashcore can undo exactly that."""

    backend: str
    previous_attn_implementation: str | None
    hook_handles: list = field(default_factory=list)
    previous_max_cache_len: int = 0
    # What later flashcore-only changes (fuse_projections) register to be undone with the patch.
    undo_on_remove: list = field(default_factory=list)


def apply_flashcore_to_llama(model: PreTrainedModel, *, backend: str = "auto") -> PreTrainedModel:
    """Routes every attention layer of a loaded LLaMA-family model through flashcore, in place.

    After the call, ``model.generate(...)`` and ``model(...)`` run prefill and every decode step on
    :func:`flashcore.attention_with_kv_cache` over a :class:`FlashCoreCache`, whether or not the caller passes
    ``cache=FlashCoreCache(...)`` (``past_key_values=`` before transformers 5.24; :data:`CACHE_ARGUMENT_NAME`):
    where transformers would build a ``DynamicCache`` (or a ``StaticCache`` for ``cache_implementation="static"``),
    a FlashCoreCache of the same capacity is used, at least as large as the one the previous ``generate`` call
    built, so a compiled decode step is reused (``cache_implementation="static", max_cache_len=N`` sizes it for
    longer calls up front). Nothing falls back to SDPA: what flashcore cannot run raises.

    Supported: ``LlamaForCausalLM``/``LlamaModel`` and the same attention in Mistral (no sliding window) and
    Qwen2 (full-attention layers); fp16, bf16, fp32; left padding; greedy, sampling and beam search (the cache
    reorders its rows in place); inference only. Refused with an error: sliding-window layers, other
    architectures, custom or 4-D attention masks, attention dropout, gradients, and generation modes that crop
    the cache (assisted generation, DoLa, contrastive search).

    Args:
        model: a loaded ``PreTrainedModel`` of a supported type. Calling this again is a no-op, except that
            ``backend`` is updated.
        backend: ``"auto"`` (default: triton on CUDA or under ``TRITON_INTERPRET=1``, torch otherwise),
            ``"triton"`` or ``"torch"``; see :func:`flashcore.attention_with_kv_cache`. A FlashCoreCache built
            with its own ``backend`` uses that one.

    Returns:
        The same model object. :func:`remove_flashcore` undoes the patch.

    Example: ``tests/test_hf_llama.py::test_generate_greedy_matches_stock``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    state = model.__dict__.get("_flashcore_state")
    if state is not None:
        state.backend = backend
        return model
    decoder, attention_modules = _check_supported(model)

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _flashcore_attention)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, _flashcore_padding_mask)
    state = _FlashCoreState(backend=backend, previous_attn_implementation=model.config._attn_implementation)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)

    def pass_cache_to_attention(module, args, kwargs):
        cache = kwargs.get(CACHE_ARGUMENT_NAME)
        kwargs["flashcore_cache"] = cache
        kwargs["flashcore_backend"] = cache.backend if getattr(cache, "backend", None) is not None else state.backend
        return args, kwargs

    def build_cache_for_forward(module, args, kwargs):
        if CACHE_ARGUMENT_NAME != "past_key_values" and "past_key_values" in kwargs:
            # This hook runs before transformers' deprecation shim renames the keyword: it would not see that cache,
            # build a new one, and the shim would then drop the caller's.
            raise TypeError(
                f"{type(module).__name__} takes its cache as {CACHE_ARGUMENT_NAME}= in transformers "
                f"{transformers.__version__}; past_key_values= is deprecated there, and a model patched by "
                f"apply_flashcore_to_llama refuses it (the *ForCausalLM model renames it itself)"
            )
        cache = kwargs.get(CACHE_ARGUMENT_NAME)
        if cache is not None:
            if not isinstance(cache, FlashCoreCache):
                raise TypeError(_WRONG_CACHE.format(type(cache).__name__))
            return None
        use_cache = kwargs.get("use_cache")
        if not (module.config.use_cache if use_cache is None else use_cache):
            return None
        inputs = next((kwargs[name] for name in ("inputs_embeds", "input_ids") if kwargs.get(name) is not None), None)
        if inputs is None and args:
            inputs = args[0]
        if not isinstance(inputs, torch.Tensor):
            return None  # the model itself reports the missing input
        # What the DynamicCache transformers builds here would hold: exactly these tokens. A continuation needs a
        # FlashCoreCache with room for it, and the cache says so if it is too small.
        kwargs[CACHE_ARGUMENT_NAME] = FlashCoreCache(module.config, max_cache_len=inputs.shape[1])
        return args, kwargs

    for attention in attention_modules:
        state.hook_handles.append(attention.register_forward_pre_hook(pass_cache_to_attention, with_kwargs=True))
    state.hook_handles.append(decoder.register_forward_pre_hook(build_cache_for_forward, with_kwargs=True))
    if hasattr(type(model), "_prepare_cache_for_generation"):  # a bare LlamaModel does not generate
        model._prepare_cache_for_generation = _make_prepare_cache_for_generation(model, state)
    model._flashcore_state = state
    return model


def remove_flashcore(model: PreTrainedModel) -> PreTrainedModel:
    """Undoes :func:`apply_flashcore_to_llama`: hooks removed, previous attention implementation restored.

    Returns the same model object; a model that was never patched is returned unchanged.
    """
    state = model.__dict__.pop("_flashcore_state", None)
    if state is None:
        return model
    for undo in state.undo_on_remove:
        undo(model)
    for handle in state.hook_handles:
        handle.remove()
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.set_attn_implementation(state.previous_attn_implementation or "sdpa")
    return model


_WRONG_CACHE = (
    f"a model patched by apply_flashcore_to_llama needs {CACHE_ARGUMENT_NAME}=FlashCoreCache(model.config, "
    f"max_cache_len=...) or None (generate and forward then build one), got a {{}}"
)


def _check_supported(model) -> tuple[Any, list]:
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"apply_flashcore_to_llama supports model types {SUPPORTED_MODEL_TYPES}, got "
            f"{getattr(config, 'model_type', type(model).__name__)!r}"
        )
    check_full_attention_only(config)
    decoder = model.base_model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__} has no decoder layers at .base_model.layers to patch")
    attention_modules = []
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None or getattr(attention, "layer_idx", None) != index or not attention.is_causal:
            raise NotImplementedError(
                f"decoder layer {index} has no causal LLaMA-style self_attn (with layer_idx={index}); flashcore "
                f"cannot route it"
            )
        attention_modules.append(attention)
    return decoder, attention_modules


def _make_prepare_cache_for_generation(model, state: _FlashCoreState):
    prepare_cache_for_generation = type(model)._prepare_cache_for_generation

    def prepare_flashcore_cache(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        if generation_mode not in SUPPORTED_GENERATION_MODES:
            raise NotImplementedError(
                f"flashcore runs generation modes {SUPPORTED_GENERATION_MODES}, not "
                f"{getattr(generation_mode, 'value', generation_mode)!r}, "
                f"which needs to crop the cache; call remove_flashcore(model) for it"
            )
        passed = model_kwargs.get(CACHE_ARGUMENT_NAME)
        if passed is not None and not isinstance(passed, FlashCoreCache):
            raise TypeError(_WRONG_CACHE.format(type(passed).__name__))
        # Checked here, once, because generate may compile the decode step, and a compiled step cannot read
        # lengths on the host: a per-step check there would be skipped and the overflow silently dropped.
        if passed is not None and max_cache_length > passed.max_cache_len:
            raise ValueError(
                f"FlashCoreCache is too small for this generate call: the conversation plus max_new_tokens needs "
                f"{max_cache_length} tokens per row (pads included) but the cache has max_cache_len="
                f"{passed.max_cache_len}. Nothing was written. Build it with FlashCoreCache(model.config, "
                f"max_cache_len={max_cache_length}) or larger, or lower max_new_tokens."
            )
        prepare_cache_for_generation(
            model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        built = model_kwargs.get(CACHE_ARGUMENT_NAME)
        if built is None or isinstance(built, FlashCoreCache):
            return
        if type(built) is StaticCache:  # sized by generate, with generation_config.max_cache_len as a floor
            max_cache_length = max(max_cache_length, built.get_max_length())
        elif type(built) is not DynamicCache:
            raise NotImplementedError(
                f"flashcore replaces the DynamicCache or StaticCache that generate builds, not a "
                f"{type(built).__name__} "
                f"(cache_implementation={generation_config.cache_implementation!r})"
            )
        # Never smaller than last call's: a compiled decode step stays valid (the same rule as StaticCache).
        state.previous_max_cache_len = max(max_cache_length, state.previous_max_cache_len)
        model_kwargs[CACHE_ARGUMENT_NAME] = FlashCoreCache(model.config, max_cache_len=state.previous_max_cache_len)

    return prepare_flashcore_cache


def _flashcore_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask flashcore's attention takes: bool ``[B, S_q]``, True where a new token is real (None: all are).

    The kernel applies causality and cache lengths itself, so only the new tokens' padding columns are needed.
    Applied twice (generate precomputes it, the model recomputes it), it returns the same mask.
    """
    if mask_function is not causal_mask_function:
        raise NotImplementedError(
            "flashcore supports causal attention with a padding mask only; this call combines the causal mask with "
            "another mask function (packed sequences, or_mask_function/and_mask_function)"
        )
    if attention_mask is None:
        return None
    # A fresh tensor with standard strides: a view of the growing [B, L] mask would change stride every decode
    # step, and torch.compile guards on strides (transformers 5.17 does not make it contiguous itself).
    return attention_mask[:, -q_length:].clone(memory_format=torch.contiguous_format)


def _flashcore_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    flashcore_cache: FlashCoreCache | None = None,
    flashcore_backend: str = "auto",
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Appends the new tokens to the layer's cache and attends, in one flashcore launch.

    ``query`` is ``[B, H_q, S_q, D]`` and ``key``/``value`` ``[B, H_kv, S_q, D]``, RoPE applied; returns
    ``[B, S_q, H_q, D]`` like every transformers attention function. The cache arrives through the pre-hook.
    """
    if sliding_window is not None:
        raise NotImplementedError(f"flashcore does not run sliding-window layers yet (sliding_window={sliding_window})")
    if dropout > 0.0:
        raise NotImplementedError(f"flashcore attention has no dropout, got dropout={dropout}; call model.eval()")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise NotImplementedError(
            "flashcore attention is inference-only (no backward); run under torch.no_grad() or torch.inference_mode(), "
            "or call remove_flashcore(model) to train"
        )
    if flashcore_cache is not None and not isinstance(flashcore_cache, FlashCoreCache):
        raise TypeError(_WRONG_CACHE.format(type(flashcore_cache).__name__))
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"flashcore takes a 2-D padding mask only, got a {attention_mask.dim()}-D attention_mask; pass the "
            f"tokenizer's [B, S] mask"
        )
    num_new = query.shape[2]
    query_lens = order = None
    if attention_mask is not None:
        is_real = attention_mask.bool()
        query_lens = is_real.sum(dim=1, dtype=torch.int32)
        if num_new > 1:
            # Real tokens first, in their order: the kernel takes each row's first query_lens[b] tokens.
            order = torch.argsort((~is_real).to(torch.int8), dim=1, stable=True)
            query, key, value = (_gather_tokens(tensor, order) for tensor in (query, key, value))

    if flashcore_cache is None:
        out, _ = attention_with_kv_cache(
            query,
            key,
            value,
            None,
            cache_max_len=num_new,
            query_lens=query_lens,
            scale=scaling,
            backend=flashcore_backend,
        )
    else:
        layer = flashcore_cache.layers[module.layer_idx]
        # check=False: the layer's update() has just checked capacity for S_q (pads included) in eager mode.
        out, _ = attention_with_kv_cache(
            query,
            key,
            value,
            (layer.keys, layer.values, layer.seq_lens),
            query_lens=query_lens,
            scale=scaling,
            backend=flashcore_backend,
            check=False,
        )
        layer.advance(num_new)

    if order is not None:
        out = torch.empty_like(out).scatter_(2, _expand_order(order, out), out)
    return out.transpose(1, 2), None


def _expand_order(order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return order[:, None, :, None].expand(like.shape[0], like.shape[1], order.shape[1], like.shape[3])


def _gather_tokens(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return tensor.gather(2, _expand_order(order, tensor))
