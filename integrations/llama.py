"""``apply_flashcore_to_llama``: routes a loaded HF LLaMA-family model's attention through flashcore, with the
model-side options (flashcore's layer kernels, fused projections), and ``remove_flashcore``, which undoes it all.

The attention goes through transformers' extension points; no modeling symbol is replaced:

- an attention function and a mask function (:mod:`flashcore.integrations.attention`) registered under
  :data:`ATTENTION_IMPLEMENTATION` with ``AttentionInterface`` / ``AttentionMaskInterface``, selected with
  ``model.set_attn_implementation``;
- a forward pre-hook on the decoder that, once per forward, gives a ``use_cache`` forward without a cache a
  :class:`FlashCoreCache` where transformers would build a ``DynamicCache``, and adds the cache and the backend to
  the keyword arguments that the decoder hands down to every layer's attention function (``LlamaAttention.forward``
  consumes the cache itself), where :meth:`FlashCoreCache.append_and_attend` appends and attends in one launch;
- for ``generate``, an instance attribute ``_prepare_cache_for_generation`` that wraps the class method (same
  signature in transformers 5.17 to 5.24) and swaps the ``DynamicCache``/``StaticCache`` it builds for a
  :class:`FlashCoreCache` of the same capacity. It runs before generate decides to compile the decode step, so
  on CUDA ``generate`` compiles it (``is_compileable``) as it would for a ``StaticCache``;
- for ``generate`` too, an instance attribute ``create_masks_for_generate``, the hook transformers looks up on the
  model to build the mask of each step ahead of the forward for a compileable cache: it calls the registered mask
  function directly (:func:`_masks_for_generate`);
- and an instance attribute ``get_compiled_call``, which ``generate`` asks for the callable its compiled steps run:
  ``torch.compile``'s code with flashcore's CUDA graphs in place of inductor's (:mod:`.compiled_step`).

``onednn_linears`` gives the projections and the LM head another forward, on oneDNN
(:mod:`flashcore.integrations.onednn_linears`).
``layer_kernels`` and ``fuse_projections`` change code inside the attention and MLP forwards, where transformers
has no extension point; :mod:`flashcore.integrations.llama_forward_fork` says why and holds the one fork of those
forwards, installed only on models that use either option.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import transformers
except ModuleNotFoundError as error:
    if error.name != "transformers":
        raise
    raise ImportError(
        "flashcore.integrations.llama needs transformers, which flashcore's [hf] extra installs: "
        'pip install "flashcore[hf]" (from a checkout: pip install -e ".[hf]")'
    ) from error
# After the check: packaging comes with transformers, not with flashcore.
from packaging.version import Version

MIN_SUPPORTED_TRANSFORMERS_VERSION = "5.17.0"
if Version(transformers.__version__) < Version(MIN_SUPPORTED_TRANSFORMERS_VERSION):
    raise ImportError(
        f"flashcore.integrations.llama needs transformers>={MIN_SUPPORTED_TRANSFORMERS_VERSION} (found "
        f"{transformers.__version__}); install it with: "
        f"pip install 'transformers>={MIN_SUPPORTED_TRANSFORMERS_VERSION},<6'"
    )

from transformers import AttentionInterface, DynamicCache, PreTrainedModel, StaticCache  # noqa: E402
from transformers.generation import CompileConfig  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, create_masks_for_generate  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaModel  # noqa: E402

from flashcore.backends import BACKENDS, is_capturing_or_tracing  # noqa: E402
from flashcore.integrations import fused_projections as _fused_projections  # noqa: E402
from flashcore.integrations import layer_kernels as _layer_kernels  # noqa: E402
from flashcore.integrations import llama_forward_fork  # noqa: E402
from flashcore.integrations import onednn_linears as _onednn_linears  # noqa: E402
from flashcore.integrations.attention import flashcore_attention, flashcore_padding_mask  # noqa: E402
from flashcore.integrations.cache import FlashCoreCache, check_full_attention_only  # noqa: E402
from flashcore.integrations.compiled_step import CompiledStep, captures_cuda_graphs  # noqa: E402

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "CACHE_ARGUMENT_NAME",
    "FlashCoreCache",
    "apply_flashcore_to_llama",
    "flashcore_options",
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
SUPPORTED_GENERATION_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")


@dataclass
class _FlashCoreState:
    """What apply_flashcore_to_llama changed on one model (its options included), so that a later call changes only
    what differs and remove_flashcore undoes exactly that."""

    backend: str
    previous_attn_implementation: str | None
    layer_kernels: bool = False
    fuse_projections: bool = False
    onednn_linears: bool | None = False  # as asked (None: the default's pick); False until a call turns it on
    hook_handles: list = field(default_factory=list)
    previous_max_cache_len: int = 0
    compiled_step: CompiledStep | None = None  # generate's compiled decode step; every apply call drops it


def apply_flashcore_to_llama(
    model: PreTrainedModel,
    *,
    backend: str = "auto",
    layer_kernels: bool = False,
    fuse_projections: bool = False,
    onednn_linears: bool | None = None,
) -> PreTrainedModel:
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
    reorders its rows in place); assisted generation, with prompt lookup or a draft model (the cache crops by rolling
    its rows back); inference only. Refused with an error: sliding-window layers, other architectures, custom or 4-D
    attention masks, attention dropout, gradients, and the other generation modes (DoLa, contrastive search, group
    and constrained beam search).

    Calling it again on a patched model brings it to the new options: ``backend`` is replaced, and each of
    ``layer_kernels``, ``fuse_projections`` and ``onednn_linears`` is turned on or off to match. Options the
    model cannot run are refused before anything changes.

    Args:
        model: a loaded ``PreTrainedModel`` of a supported type, on its final device and dtype.
        backend: ``"auto"`` (default: triton on CUDA or under ``TRITON_INTERPRET=1``, torch otherwise),
            ``"triton"`` or ``"torch"``; see :func:`flashcore.attention_with_kv_cache`. A FlashCoreCache built
            with its own ``backend`` uses that one.
        layer_kernels: run every RMSNorm, the RoPE and the SiLU-and-mul on flashcore's Triton kernels
            (:mod:`flashcore.layer_ops`), so that eager, graph-replayed and compiled steps compute the same bits,
            and a one-token forward's projections on flashcore's GEMV, which overlaps its weight loads with the
            kernel before it; needs ``hidden_act="silu"`` and CUDA (or ``TRITON_INTERPRET=1``). Default: False.
        fuse_projections: concatenate each layer's q/k/v and gate/up weights into one GEMM each, in place and
            with no extra memory (``save_pretrained`` still writes every HF parameter); results equal the unfused
            model's up to the GEMMs' summation order. Default: False.
        onednn_linears: run each decoder projection's and the LM head's GEMM on oneDNN
            (``torch.ops.mkldnn._linear_pointwise``) instead of ``F.linear``'s BLAS, with the weights as they are
            (:mod:`flashcore.integrations.onednn_linears`): on the AMD CPU of ``benchmarks/bench_cpu.py``, 1.5-2.3x
            faster at prefill and 1.0-1.5x at decode on SmolLM2's shapes; results equal
            ``F.linear``'s up to the summation order. Default None: every fp32 CPU linear (a CUDA or 16-bit model
            is left as it is), picked again by each call, so after ``model.to(...)`` call this again. Not with
            tensor parallelism (``tp_plan``), where None leaves the linears as they are.

    Returns:
        The same model object. :func:`remove_flashcore` undoes everything.

    Example: ``tests/test_hf_llama.py::test_generate_greedy_matches_stock``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    decoder, _ = _check_supported(model)
    if layer_kernels:
        _layer_kernels.check_supported(model)
    if fuse_projections:
        _fused_projections.check_supported(model)
    if model_tp_size(model) > 1:
        if onednn_linears:
            raise NotImplementedError(
                "onednn_linears=True does not support a tensor-parallel model (tp_plan): its weights are sharded "
                "DTensors. Leave it None or False"
            )
        onednn_linears = False
    if onednn_linears:
        _onednn_linears.check_supported(model)

    state = model.__dict__.get("_flashcore_state")
    if state is None:
        state = _patch(model, decoder, backend)
    state.backend = backend
    state.compiled_step = None  # its graphs read the weights as they are now, and the options may change them
    if fuse_projections != state.fuse_projections:
        (_fused_projections.fuse if fuse_projections else _fused_projections.unfuse)(model)
        state.fuse_projections = fuse_projections
    if onednn_linears != state.onednn_linears or onednn_linears is None:  # None: picked anew, for where it is now
        _onednn_linears.disable(model)
        if onednn_linears is not False:
            _onednn_linears.enable(model, only_default=onednn_linears is None)
        state.onednn_linears = onednn_linears
    if layer_kernels != state.layer_kernels:
        (_layer_kernels.enable if layer_kernels else _layer_kernels.disable)(model)
        state.layer_kernels = layer_kernels
    llama_forward_fork.sync_forwards(model)
    return model


def model_tp_size(model: torch.nn.Module) -> int:
    """The tensor-parallel degree transformers loaded ``model`` with (``tp_plan``; 1 without), which sets the KV heads
    a ``FlashCoreCache`` holds on each rank."""
    return getattr(model, "tp_size", None) or 1


def model_layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each decoder layer's weights, where that layer's cache belongs: one device for a model on one
    device, several under ``device_map`` (accelerate moves the activations from layer to layer)."""
    return [next(layer.parameters()).device for layer in model.base_model.layers]


def flashcore_options(model: PreTrainedModel) -> dict[str, Any] | None:
    """The keyword arguments of the last :func:`apply_flashcore_to_llama` call on ``model`` (None if unpatched)."""
    state = model.__dict__.get("_flashcore_state")
    if state is None:
        return None
    return {
        "backend": state.backend,
        "layer_kernels": state.layer_kernels,
        "fuse_projections": state.fuse_projections,
        "onednn_linears": state.onednn_linears,
    }


def remove_flashcore(model: PreTrainedModel) -> PreTrainedModel:
    """Undoes :func:`apply_flashcore_to_llama`: layer kernels, fused projections and oneDNN linears undone,
    hooks removed, the previous attention implementation restored.

    Returns the same model object; a model that was never patched is returned unchanged.
    """
    state = model.__dict__.pop("_flashcore_state", None)
    if state is None:
        return model
    if state.layer_kernels:
        _layer_kernels.disable(model)
    if state.onednn_linears is not False:
        _onednn_linears.disable(model)
    if state.fuse_projections:
        _fused_projections.unfuse(model)
    llama_forward_fork.sync_forwards(model)
    for handle in state.hook_handles:
        handle.remove()
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.__dict__.pop("create_masks_for_generate", None)
    model.__dict__.pop("get_compiled_call", None)
    model.set_attn_implementation(state.previous_attn_implementation or "sdpa")
    return model


def _patch(model: PreTrainedModel, decoder: torch.nn.Module, backend: str) -> _FlashCoreState:
    """The attention routing: registered functions, the decoder's pre-hook and generate's cache."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, flashcore_attention)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, flashcore_padding_mask)
    state = _FlashCoreState(backend=backend, previous_attn_implementation=model.config._attn_implementation)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)

    def prepare_forward(module, args, kwargs):
        """Once per forward: the cache (built where transformers would build a DynamicCache) and the backend,
        as keyword arguments that the decoder hands down to every layer's attention function."""
        if CACHE_ARGUMENT_NAME != "past_key_values" and "past_key_values" in kwargs:
            # This hook runs before transformers' deprecation shim renames the keyword: it would not see that cache,
            # build a new one, and the shim would then drop the caller's.
            raise TypeError(
                f"{type(module).__name__} takes its cache as {CACHE_ARGUMENT_NAME}= in transformers "
                f"{transformers.__version__}; past_key_values= is deprecated there, and a model patched by "
                f"apply_flashcore_to_llama refuses it (the *ForCausalLM model renames it itself)"
            )
        kwargs["flashcore_backend"] = state.backend
        cache = kwargs.get(CACHE_ARGUMENT_NAME)
        if cache is None:
            cache = kwargs[CACHE_ARGUMENT_NAME] = _cache_for_forward(module, args, kwargs, model_tp_size(model))
        elif not isinstance(cache, FlashCoreCache):
            raise TypeError(_WRONG_CACHE.format(type(cache).__name__))
        if cache is not None and not is_capturing_or_tracing():
            cache.in_patched_forward = True  # until the last layer's step; see FlashCoreCache.update
        kwargs["flashcore_cache"] = cache
        return args, kwargs

    state.hook_handles.append(decoder.register_forward_pre_hook(prepare_forward, with_kwargs=True))
    if hasattr(type(model), "_prepare_cache_for_generation"):  # a bare LlamaModel does not generate
        model._prepare_cache_for_generation = _make_prepare_cache_for_generation(model, state)
        model.create_masks_for_generate = _masks_for_generate
        model.get_compiled_call = _make_get_compiled_call(model, state)
    model._flashcore_state = state
    return state


def _masks_for_generate(**kwargs):
    """The mask ``generate`` builds for each step ahead of the forward (the cache is compileable): what
    transformers' ``create_masks_for_generate`` gives for flashcore's mask function, without the general mask
    machinery around the call, host time on every step (benchmarks/NOTES.md, entry 48).
    transformers calls it with keywords only: ``inputs_embeds`` (``input_embeds`` in older releases), whose first two
    sizes are the batch and the new tokens, and ``attention_mask``. A model switched to another attention since the
    patch gets transformers' own function."""
    embeds = kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
    if kwargs["config"]._attn_implementation != ATTENTION_IMPLEMENTATION or embeds is None:
        return create_masks_for_generate(**kwargs)
    batch_size, q_length = embeds.shape[:2]
    return flashcore_padding_mask(batch_size, q_length, q_length, attention_mask=kwargs.get("attention_mask"))


def _make_get_compiled_call(model, state: _FlashCoreState):
    get_compiled_call = type(model).get_compiled_call

    def get_flashcore_compiled_call(compile_config=None):
        """What generate's compiled steps run: a :class:`CompiledStep` where ``compile_config`` asks for CUDA graphs
        on CUDA, else transformers' own ``torch.compile`` of the forward."""
        if compile_config is None:
            compile_config = getattr(model, "_default_compile_config", CompileConfig)()
        compile_kwargs = compile_config.to_dict()
        if model.device.type != "cuda" or not captures_cuda_graphs(compile_kwargs):
            return get_compiled_call(model, compile_config)
        if state.compiled_step is None or state.compiled_step.asked != compile_kwargs:
            state.compiled_step = CompiledStep(model, compile_kwargs)
        return state.compiled_step

    return get_flashcore_compiled_call


def _cache_for_forward(module, args, kwargs, tp_size: int) -> FlashCoreCache | None:
    """What the DynamicCache transformers builds for a ``use_cache`` forward without a cache would hold: exactly
    these tokens. A continuation needs a FlashCoreCache with room for it, and the cache says so if it is too small."""
    use_cache = kwargs.get("use_cache")
    if not (module.config.use_cache if use_cache is None else use_cache):
        return None
    inputs = next((kwargs[name] for name in ("inputs_embeds", "input_ids") if kwargs.get(name) is not None), None)
    if inputs is None and args:
        inputs = args[0]
    if not isinstance(inputs, torch.Tensor):
        return None  # the model itself reports the missing input
    return FlashCoreCache(module.config, max_cache_len=inputs.shape[1], tp_size=tp_size)


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
                f"{getattr(generation_mode, 'value', generation_mode)!r}; call remove_flashcore(model) for it"
            )
        passed = model_kwargs.get(CACHE_ARGUMENT_NAME)
        if passed is not None and not isinstance(passed, FlashCoreCache):
            raise TypeError(_WRONG_CACHE.format(type(passed).__name__))
        if generation_mode == "assisted_generation":
            # generate sizes caches for max_length - 1 tokens (the last token is never fed back), but a verify step
            # stores its candidates before checking them: up to max_length tokens with a draft model (which drafts no
            # further), and up to prompt_lookup_num_tokens - 1 more with prompt lookup (whose candidates are cut to
            # max_length only after the verify step).
            max_cache_length += 1 + (generation_config.prompt_lookup_num_tokens or 0)
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
        model_kwargs[CACHE_ARGUMENT_NAME] = FlashCoreCache(
            model.config,
            max_cache_len=state.previous_max_cache_len,
            device=model_layer_devices(model),
            tp_size=model_tp_size(model),
        )

    return prepare_flashcore_cache
