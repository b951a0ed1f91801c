"""The attention and mask functions that :func:`~flashcore.integrations.llama.apply_flashcore_to_llama` registers
with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

The mask function runs once per forward (``generate`` runs it once more, ahead of the forward, and the forward
then gets its result back); everything per forward that depends on the padding is decided there, so the attention
function, which runs once per layer, does no more than route the layer's step to
:meth:`FlashCoreCache.append_and_attend <flashcore.integrations.cache.FlashCoreCache.append_and_attend>`.

Left-padded rows are compacted before the launch: each row's valid new tokens move to the front (a stable argsort
of the padding mask) and their count goes in ``query_lens``, so pads are never attended and never stored; outputs
are scattered back. A prefill whose rows are all unpadded passes ``query_lens=None``, which the kernels for long
causal prefills require (:mod:`flashcore.kernels`). RoPE is applied by the model from ``position_ids`` before the
attention function.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import causal_mask_function

from flashcore.backends import is_capturing_or_tracing
from flashcore.integrations.cache import FlashCoreCache
from flashcore.ops import attention_with_kv_cache

QUERY_LENS_DTYPE = torch.int32


def flashcore_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask flashcore's attention takes: int32 ``[B, S_q]``, 1 where a new token is real, or None when all are.

    The kernel applies causality and cache lengths itself, so only the new tokens' padding columns are needed.
    A step whose new tokens are all real gives None: one host read, once per forward, skipped under CUDA-graph
    capture and while ``torch.compile`` traces. On CUDA a decode step (``S_q == 1``) keeps its mask instead, read by
    no one on the host (the decode kernels take ``query_lens``): a host read there would wait for the GPU every token.
    On the CPU the read is free and saves each layer's ``query_lens``. Applied twice (``generate`` precomputes it,
    the model recomputes it), it returns the same mask.
    """
    if mask_function is not causal_mask_function:
        raise NotImplementedError(
            "flashcore supports causal attention with a padding mask only; this call combines the causal mask with "
            "another mask function (packed sequences, or_mask_function/and_mask_function)"
        )
    if attention_mask is None:
        return None
    new_tokens = attention_mask[:, -q_length:]
    # A host read of a CPU tensor costs no sync; on CUDA a decode step skips it (one sync per token).
    may_read = q_length > 1 or not new_tokens.is_cuda
    if may_read and not is_capturing_or_tracing() and bool(new_tokens.all()):
        return None
    # A fresh int32 tensor with standard strides: a view of the growing [B, L] mask would change stride every decode
    # step, and torch.compile guards on strides; int32 is what query_lens must be, so a decode step's mask is its
    # query_lens, viewed, with no conversion per layer.
    return new_tokens.to(QUERY_LENS_DTYPE, memory_format=torch.contiguous_format)


def flashcore_attention(
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
    ``[B, S_q, H_q, D]`` like every transformers attention function. ``attention_mask`` is
    :func:`flashcore_padding_mask`'s. The cache and backend arrive as keyword arguments that the decoder's
    pre-hook adds to its forward, which transformers hands down to every layer's attention; without a cache
    (``use_cache=False``) the tokens are attended in a cache of their own.
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
    num_new = query.shape[2]
    query_lens = order = None
    if attention_mask is None and num_new > 1 and query.is_cuda:
        # The Gluon prefill kernel reads q/k/v through 2-D TMA descriptors and takes contiguous ones only
        # (flashcore.kernels). flashcore's RoPE kernel (layer kernels) writes q and k so; v, and HF's RoPE output,
        # are views of the projections' [B, S_q, H, D] storage and get copied here: at a 16 x 512-token prefill the
        # three copies took as long as the attention (NOTES.md, entry 66). The gather below gives a padded prefill
        # contiguous ones too. The CPU's kernels take any strides, so the CPU skips the copies.
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    elif attention_mask is not None:
        if attention_mask.dim() != 2:
            raise NotImplementedError(
                f"flashcore takes a 2-D padding mask only, got a {attention_mask.dim()}-D attention_mask; pass the "
                f"tokenizer's [B, S] mask"
            )
        if attention_mask.dtype != QUERY_LENS_DTYPE:
            raise TypeError(
                f"attention_mask must be flashcore_padding_mask's {QUERY_LENS_DTYPE} [B, S_q] mask, got "
                f"{attention_mask.dtype}; let the model build it (the registered mask function does)"
            )
        if num_new == 1:
            query_lens = attention_mask.view(-1)
        else:
            query_lens = attention_mask.sum(dim=1, dtype=QUERY_LENS_DTYPE)
            # Real tokens first, in their order: the kernel takes each row's first query_lens[b] tokens.
            order = torch.argsort(1 - attention_mask, dim=1, stable=True)
            query, key, value = (_gather_tokens(tensor, order) for tensor in (query, key, value))

    if flashcore_cache is None:
        fresh = dict(cache_max_len=num_new, query_lens=query_lens, scale=scaling, backend=flashcore_backend)
        out, _ = attention_with_kv_cache(query, key, value, None, **fresh)
    else:
        # token_major: the output is returned as [B, S_q, H_q, D], which the o projection reads; where the kernel
        # writes it so (a CUDA prefill), the model's reshape before that projection copies nothing (NOTES.md, entry
        # 84). A scatter below reorders tokens anyway.
        out = flashcore_cache.append_and_attend(
            module.layer_idx, query, key, value, query_lens=query_lens, scale=scaling, backend=flashcore_backend,
            token_major=order is None,
        )  # fmt: skip
    if order is not None:
        out = torch.empty_like(out).scatter_(2, _expand_order(order, out), out)
    return out.transpose(1, 2), None


def _expand_order(order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return order[:, None, :, None].expand(like.shape[0], like.shape[1], order.shape[1], like.shape[3])


def _gather_tokens(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return tensor.gather(2, _expand_order(order, tensor))
