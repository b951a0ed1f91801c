"""``attention_with_kv_cache``: the one public op, its contract, its validation and its backend dispatch.

Everything else in flashcore (the HF integration, the chat example, the benchmarks) calls this function and
links to its docstring rather than restating the cache rules.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from flashcore.backends import SUPPORTED_DTYPES, is_capturing_or_tracing, on_device_of, resolve_backend
from flashcore.cache import SEQ_LENS_DTYPE, KVCache, allocate_kv_cache

MAX_HEAD_DIM = 256


def attention_with_kv_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key_value: KVCache | None = None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    query_lens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    cache_max_len: int | None = None,
    backend: str = "auto",
    check: bool | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """Appends new keys/values to a preallocated KV cache and attends to it, in one call.

    **Side effects first.** The call writes ``k_cache`` and ``v_cache`` in place at each row's offset and
    advances ``seq_lens`` in place. The returned cache tuple holds the same tensor objects that were passed
    in. A call that raises writes nothing: K, V and ``seq_lens`` stay bit-identical.

    **The cache rule.** Let ``L_b = seq_lens[b]`` before the call and ``n_b = query_lens[b]`` (``S_q`` when
    ``query_lens`` is None).

    - Row b holds ``L_b`` tokens at cache positions ``[0, L_b)``.
    - The call writes ``key[b, :, :n_b]`` and ``value[b, :, :n_b]`` at positions ``[L_b, L_b + n_b)``.
    - New token i sits at position ``L_b + i``. It attends to every position ``<= L_b + i`` when causal,
      or to all of ``[0, L_b + n_b)`` when not. ``sliding_window=W`` also hides positions ``<= p - W`` from
      the token at position ``p``: with ``is_causal`` it sees ``(p - W, p]``; without, ``(p - W, L_b + n_b)``.
    - Output rows ``i >= n_b`` are zero, and nothing is written for them.
    - Then ``seq_lens[b] += n_b``, in place. :func:`flashcore.rollback` undoes it: ``seq_lens[b] -= n_b``.
    - Cache memory at positions ``>= seq_lens[b]`` is garbage. It may hold NaN, and it never changes an
      output: it is never loaded unmasked.

    Prefill (``S_q`` large), decode (``S_q == 1``) and mixed batches (``query_lens`` differing per row) are the
    same rule, and one Triton kernel serves them all.

    **Causal alignment is bottom-right.** With ``L_b = 3`` cached tokens and 2 new ones (1 = attended)::

                    cache  0 1 2 | new 3 4
        new token 0 (pos 3)    1 1 1 |     1 0
        new token 1 (pos 4)    1 1 1 |     1 1

    **GQA.** ``H_q`` must be a multiple of ``H_kv``; query head h reads KV head ``h // (H_q // H_kv)``. For
    SmolLM2 (9 query heads over 3 KV heads): q heads 0-2 read kv head 0, 3-5 read kv head 1, 6-8 read 2.

    Args:
        query: ``[B, H_q, S_q, D]``, float16, bfloat16 or float32. Any strides.
        key: ``[B, H_kv, S_q, D]``, the new tokens' keys, same dtype and device. Any strides.
        value: ``[B, H_kv, S_q, D]``, the new tokens' values. Any strides.
        past_key_value: ``(k_cache [B, H_kv, S_max, D], v_cache [B, H_kv, S_max, D], seq_lens [B])``, with
            K and V of the query's dtype and ``seq_lens`` ``torch.int32`` (never converted: a converted copy
            would lose the in-place update). K and V may have any strides (the layout
            :func:`flashcore.allocate_kv_cache` gives is the one the H100 kernels stream fastest); ``seq_lens``
            must be contiguous. None allocates a fresh cache of ``cache_max_len`` tokens (see
            :func:`flashcore.allocate_kv_cache`).
        is_causal: bottom-right causal masking (see above). False lets every new token see all
            ``L_b + n_b`` tokens.
        scale: softmax scale; None means ``1 / sqrt(D)``.
        query_lens: ``int32 [B]``, contiguous, optional. Row b has ``query_lens[b] <= S_q`` valid new
            tokens, the first ones; the rest are padding. None means ``S_q`` for every row.
        sliding_window: W >= 1, or None for no window.
        cache_max_len: only with ``past_key_value=None``: the capacity ``S_max`` of the new cache.
        backend: ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), ``"torch"``
            (plain PyTorch, any device), or ``"auto"``: triton on CUDA or under the interpreter, torch
            otherwise. Nothing ever falls back silently from one backend to the other. Within a backend, the
            first kernel of ``flashcore.kernels.ATTENTION_KERNELS[backend]`` that supports the call runs it
            (on an sm_90 GPU, warp-specialised Gluon kernels take decode and long causal prefill calls; the
            portable Triton kernel takes the rest), eagerly and under CUDA-graph capture alike, so a replayed
            step gives the eager step's bits. The table and its rules: :mod:`flashcore.kernels`.
        check: run the value checks (capacity, negative lengths), which read ``seq_lens`` on the host once
            (one batched reduction, one sync). None means: check, unless the current CUDA stream is being
            captured into a graph or ``torch.compile`` is tracing. With ``check=False`` the kernel still
            never writes out of bounds; tokens past capacity are simply not stored.

    Returns:
        ``(out, past_key_value)``: ``out`` is ``[B, H_q, S_q, D]`` in the query's dtype, contiguous; the cache
        tuple is the (mutated) input tuple, or the newly allocated one.

    Raises:
        TypeError: a tensor argument of the wrong type or dtype (e.g. ``seq_lens`` not ``torch.int32``).
        ValueError: mismatched shapes, heads, head_dim, batch or device; a row that would overflow its cache
            (``L_b + n_b > S_max``; the message names the row and the sizes); ``query_lens`` outside
            ``[0, S_q]``; negative ``seq_lens``; an unknown backend or bad scalar.
        NotImplementedError: the triton backend asked for where it cannot run (CPU without the interpreter).

    Example: ``tests/test_contract.py::test_prefill_then_decode_matches_sdpa_each_step``.
    """
    if past_key_value is None:
        past_key_value = _allocate_for_call(query, key, cache_max_len)
    elif cache_max_len is not None:
        raise ValueError("cache_max_len is only used when past_key_value is None; the passed cache already fixes S_max")
    k_cache, v_cache, seq_lens = past_key_value
    resolved_backend = resolve_backend(backend, query)
    _validate_metadata_once(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, sliding_window)
    if check is None:
        check = not is_capturing_or_tracing()
    if check:
        _validate_lengths(seq_lens, query_lens, query.shape[2], k_cache.shape[2])

    args = (
        query,
        key,
        value,
        k_cache,
        v_cache,
        seq_lens,
        query_lens,
        is_causal,
        scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
        sliding_window or 0,
        resolved_backend,
    )
    # The registered op is what torch.compile traces; in eager mode we skip the dispatcher's per-call
    # overhead, because it is host time larger than a decode step's GPU work.
    if torch.compiler.is_compiling():
        out = torch.ops.flashcore.attention_with_kv_cache(*args)
    else:
        out = _attention_with_kv_cache_impl(*args)
    return out, past_key_value


class AttentionPlan:
    """:func:`attention_with_kv_cache` split in two for a model's layers, as FlashInfer splits ``plan`` from ``run``.

    In one forward a decoder's layers each make the same call, alike in all but their tensors' data: the same shapes,
    dtypes, devices and strides, each layer on its own cache. Constructing a plan validates one such call as
    ``attention_with_kv_cache`` does (its metadata checks; nothing is written) and picks its kernel from the table;
    :meth:`run` then launches that kernel on any layer's tensors, with the contract's effects, and checks nothing.
    On the CPU that per-layer host time put a 30-layer model's decode after 40 tokens 3.5% behind stock transformers;
    with a plan, 0.6% (benchmarks/NOTES.md, entry 49).

    The caller keys its plans by :func:`plan_key` of each call's query, key, value and options, so a call runs on a
    plan made for a call like it; it vouches for the cache tensors (alike across its layers: the same
    ``allocate_kv_cache`` sizes, dtype and device) and checks their capacity itself, as
    :class:`~flashcore.integrations.cache.FlashCoreCache` does. Eager calls and CUDA-graph capture (the plan reads
    no data on the host; the kernels pick their captured variants at run time); while ``torch.compile`` traces, call
    ``attention_with_kv_cache``, whose registered op is what it traces.
    """

    __slots__ = ("kernel", "scale")

    def __init__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        past_key_value: KVCache,
        *,
        query_lens: torch.Tensor | None = None,
        scale: float | None = None,
        backend: str = "auto",
    ) -> None:
        k_cache, v_cache, seq_lens = past_key_value
        resolved_backend = resolve_backend(backend, query)
        _validate_metadata(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, None)
        self.scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        kernels = _kernels()
        call = kernels.KernelCall(query, key, value, k_cache, v_cache, seq_lens, query_lens, True, self.scale, 0)
        self.kernel = kernels.select_kernel(call, resolved_backend)

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        past_key_value: KVCache,
        query_lens: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention with the append, as ``attention_with_kv_cache(...)[0]``; no checks (see the class).

        ``out``, only where :attr:`takes_out`: the tensor to write the output into and return, ``[B, H_q, S_q, D]``
        with a unit stride along D (a token-major one spares a model the copy before its o projection)."""
        k_cache, v_cache, seq_lens = past_key_value
        call = _kernels().KernelCall(query, key, value, k_cache, v_cache, seq_lens, query_lens, True, self.scale, 0)
        with on_device_of(query):
            if out is None:
                return self.kernel.run(call)
            if not self.takes_out:
                raise ValueError(f"the {self.kernel.NAME} kernel writes its own output: pass out=None")
            return self.kernel.run(call, out=out)

    @property
    def takes_out(self) -> bool:
        """Whether :meth:`run` may be given ``out``: the plan's kernel writes into a tensor of any strides."""
        return getattr(self.kernel, "TAKES_OUT", False)


def plan_key(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: torch.Tensor | None,
    scale: float | None,
    backend: str,
) -> tuple:
    """What an :class:`AttentionPlan`'s checks and kernel choice read of a call, but for the cache tensors: two calls
    with one key run on one plan."""
    lengths = query_lens
    if query_lens is not None:
        lengths = (query_lens.shape, query_lens.dtype, query_lens.stride(), query_lens.device)
    return (
        query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(),
        query.dtype, key.dtype, value.dtype, query.device, key.device, value.device, lengths, scale, backend,
    )  # fmt: skip


@torch.library.custom_op("flashcore::attention_with_kv_cache", mutates_args=("k_cache", "v_cache", "seq_lens"))
def _attention_with_kv_cache_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    sliding_window: int,
    backend: str,
) -> torch.Tensor:
    return _attention_with_kv_cache_impl(
        query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window, backend
    )


@_attention_with_kv_cache_op.register_fake
def _(query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window, backend):
    return query.new_empty(query.shape)


def _attention_with_kv_cache_impl(
    query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window, backend
) -> torch.Tensor:
    # Eagerly and under capture alike the same table decides, so that a graph-replayed decode step computes what an
    # eager one does.
    kernels = _kernels()
    call = kernels.KernelCall(
        query, key, value, k_cache, v_cache, seq_lens, query_lens, is_causal, scale, sliding_window
    )
    with on_device_of(query):
        return kernels.select_kernel(call, backend).run(call)


@functools.cache
def _kernels() -> ModuleType:
    """``flashcore.kernels``, imported on first use: the kernels import triton, which a torch-backend user on the CPU
    need not pay for at import time. Cached: an import statement per call was host time on every decode call."""
    from flashcore import kernels

    return kernels


def _allocate_for_call(query: torch.Tensor, key: torch.Tensor, cache_max_len: int | None) -> KVCache:
    if cache_max_len is None:
        raise ValueError(
            "past_key_value is None, so a cache must be allocated: pass cache_max_len=<capacity in tokens>, "
            "or pass past_key_value=flashcore.allocate_kv_cache(...)"
        )
    if key.dim() != 4:
        raise ValueError(f"key must be [B, H_kv, S_q, D], got shape {tuple(key.shape)}")
    batch_size, num_kv_heads, _, head_dim = key.shape
    return allocate_kv_cache(batch_size, num_kv_heads, cache_max_len, head_dim, dtype=query.dtype, device=query.device)


# The metadata that passed _validate_metadata (types, shapes, dtypes, devices, seq_lens/query_lens layout, scalars):
# a decode loop makes the same call once per layer and step, and the checks were the op's largest Python cost
# (NOTES.md, entry 40). Keyed on all that the checks read, so a key seen before passed the same checks.
MAX_VALIDATED_SIGNATURES = 4096
_validated_signatures: set[tuple] = set()


def _validate_metadata_once(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, sliding_window):
    """``_validate_metadata``, skipped for a call whose metadata passed it before."""
    if torch.compiler.is_compiling():
        # Checked once, when traced; a lookup in the set here would make dynamo guard on its contents.
        _validate_metadata(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, sliding_window)
        return
    try:
        lengths = query_lens
        if query_lens is not None:
            lengths = (query_lens.shape, query_lens.dtype, query_lens.stride(), query_lens.device)
        signature = (
            type(query), type(key), type(value), type(k_cache), type(v_cache), type(seq_lens), type(query_lens),
            query.shape, key.shape, value.shape, k_cache.shape, v_cache.shape,
            query.dtype, key.dtype, value.dtype, k_cache.dtype, v_cache.dtype,
            query.device, key.device, value.device, k_cache.device, v_cache.device,
            seq_lens.shape, seq_lens.dtype, seq_lens.stride(), seq_lens.device,
            lengths, type(scale), scale, type(sliding_window), sliding_window,
        )  # fmt: skip
    except (AttributeError, TypeError):  # not tensors where tensors belong: the checks say which
        signature = None
    if signature is not None and signature in _validated_signatures:
        return
    _validate_metadata(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, sliding_window)
    if signature is not None:
        if len(_validated_signatures) >= MAX_VALIDATED_SIGNATURES:
            _validated_signatures.clear()
        _validated_signatures.add(signature)


def _validate_metadata(query, key, value, k_cache, v_cache, seq_lens, query_lens, scale, sliding_window):
    """Shape/dtype/device checks; reads host metadata only, so it is safe under graph capture."""
    for name, tensor in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("seq_lens", seq_lens),
    ):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S_q, D], got shape {tuple(tensor.shape)}")
    batch, num_q_heads, num_new, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[0] != batch or key.shape[2] != num_new or key.shape[3] != head_dim:
        raise ValueError(
            f"key/value must be [B, H_kv, S_q, D] = [{batch}, H_kv, {num_new}, {head_dim}] to match query "
            f"{tuple(query.shape)}, got {tuple(key.shape)}"
        )
    num_kv_heads = key.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of key/value heads ({num_kv_heads}) for GQA; "
            f"check the head dimension (dim 1) of query and key"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (query.shape[-1]) must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name} dtype {tensor.dtype} must match query dtype {query.dtype}; cast with .to({query.dtype})"
            )
    for name, tensor in (
        ("key", key),
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("seq_lens", seq_lens),
    ):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}; move it with .to()")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, H_kv, S_max, D], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    cache_batch, cache_heads, _, cache_head_dim = k_cache.shape
    if (cache_batch, cache_heads, cache_head_dim) != (batch, num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache/v_cache {tuple(k_cache.shape)} must be [B={batch}, H_kv={num_kv_heads}, S_max, "
            f"D={head_dim}] to match key {tuple(key.shape)}; allocate the cache with these sizes"
        )
    _validate_lengths_tensor("seq_lens", seq_lens, batch, query.device)
    if query_lens is not None:
        _validate_lengths_tensor("query_lens", query_lens, batch, query.device)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")


def _validate_lengths_tensor(name: str, tensor, batch: int, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape [{batch}], got {type(tensor).__name__}")
    if tensor.dtype != SEQ_LENS_DTYPE:
        fix = "pass seq_lens.int() once when allocating the cache" if name == "seq_lens" else f"pass {name}.int()"
        raise TypeError(f"{name} must be torch.int32, got {tensor.dtype}; {fix}")
    if tensor.shape != (batch,):
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(tensor.shape)}")
    if batch > 1 and tensor.stride(0) != 1:
        fix = (
            "allocate it with flashcore.allocate_kv_cache (a contiguous copy would not receive the in-place update)"
            if name == "seq_lens"
            else f"pass {name}.contiguous()"
        )
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {tensor.stride(0)}; {fix}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but query is on {device}; move it with .to()")


def _validate_lengths(seq_lens: torch.Tensor, query_lens: torch.Tensor | None, num_new: int, capacity: int) -> None:
    """Value checks in one batched reduction and one host sync; details are gathered only on failure."""
    new_tokens = query_lens if query_lens is not None else torch.full_like(seq_lens, num_new)
    is_bad = (seq_lens < 0) | (new_tokens < 0) | (new_tokens > num_new) | (seq_lens + new_tokens > capacity)
    if not bool(is_bad.any()):
        return
    lengths, news = seq_lens.tolist(), new_tokens.tolist()
    for row, (length, new) in enumerate(zip(lengths, news, strict=True)):
        if length < 0:
            raise ValueError(f"seq_lens[{row}] = {length} is negative; a row holds seq_lens[b] >= 0 tokens")
        if not 0 <= new <= num_new:
            raise ValueError(
                f"query_lens[{row}] = {new} must be in [0, S_q={num_new}]: a row's valid new tokens are the "
                f"first query_lens[b] of the S_q passed"
            )
        if length + new > capacity:
            raise ValueError(
                f"KV cache overflow in row {row}: seq_lens[{row}] = {length} cached + {new} new tokens = "
                f"{length + new} > cache capacity S_max = {capacity}. Allocate a longer cache (max_len / "
                f"cache_max_len) or reset the row; nothing was written"
            )
