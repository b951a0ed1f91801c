"""``FlashCoreCache``: a transformers ``Cache`` whose layers each own one flashcore ``(K, V, seq_lens)`` 3-tuple.

The cache rules (what a row holds, where new tokens land, ``seq_lens += n``) are those of
:func:`flashcore.attention_with_kv_cache`. The cache owns every duty around that call: it allocates the tuples,
answers transformers' questions about them (lengths, mask sizes, beam reordering), and runs the call itself in
:meth:`FlashCoreCache.append_and_attend`, which checks capacity, appends and attends in one launch, and advances
the lengths. ``update()``, which transformers' attention calls first, copies nothing and returns its inputs.

Two lengths are kept. ``seq_lens[b]`` (one per layer) is row b's true token count; left padding is never stored, so
rows differ. ``get_seq_length()`` is the *logical* length that ``generate`` expects: the number of attention-mask
columns consumed so far, pads included, the same for every row and every layer (one tensor per device, shared by
its layers, advanced once per forward). Both live in tensors, so a compiled decode step reads no Python int that
changes per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from flashcore import ops
from flashcore.backends import BACKENDS, is_capturing_or_tracing
from flashcore.cache import KVCache, allocate_kv_cache, rollback

DeviceLike = torch.device | str | int
MAX_PLANS = 64  # ops.AttentionPlans a FlashCoreCache keeps (each a kernel and a scale); past it, it starts over
# What FlashCoreCache reads of a config to size its layers (LlamaConfig's names).
_LLAMA_CONFIG_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")


class FlashCoreLayer(CacheLayerMixin):
    """One decoder layer's 3-tuple, allocated on the first ``update`` (or eagerly) on that layer's device.

    ``keys``/``values`` are the preallocated ``[B, H_kv, max_cache_len, D]`` buffers; slots at or past
    ``seq_lens[b]`` hold garbage. ``logical_length`` is a 0-d int64 tensor, shared with the other layers on the same
    device (see the module docstring).
    """

    is_compileable = True
    is_sliding = False
    is_croppable = True  # by FlashCoreCache.crop, which also moves the shared logical length

    def __init__(self, max_cache_len: int, *, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.max_cache_len = max_cache_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.seq_lens: torch.Tensor | None = None
        self.logical_length: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise NotImplementedError("a FlashCoreLayer is allocated by its FlashCoreCache (it shares the logical length)")

    def allocate(self, key_states: torch.Tensor, logical_length: torch.Tensor) -> None:
        """Allocates the 3-tuple for keys like ``key_states`` (``[B, H_kv, *, D]``) on their device and dtype."""
        batch_size, num_kv_heads, _, head_dim = key_states.shape
        if (num_kv_heads, head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"FlashCoreCache was built for {self.num_kv_heads} KV heads of dim {self.head_dim} (the config's, over "
                f"tp_size) but got key states {tuple(key_states.shape)}; build the cache from this model's config, "
                f"with tp_size=<the tensor-parallel degree> for a model loaded with a tp_plan"
            )
        self.batch_size, self.dtype, self.device = batch_size, key_states.dtype, key_states.device
        self.keys, self.values, self.seq_lens = allocate_kv_cache(
            batch_size, num_kv_heads, self.max_cache_len, head_dim, dtype=self.dtype, device=self.device
        )
        self.logical_length = logical_length
        _mark_static_addresses(self.keys, self.values, self.seq_lens)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(key_states, value_states)``: the keys are appended by :meth:`FlashCoreCache.append_and_attend`."""
        return key_states, value_states

    def check_capacity(self, num_new: int) -> None:
        """Refuses a step of ``num_new`` tokens (pads included) that could overflow a row; one host read."""
        longest = int(self.seq_lens.max()) if self.batch_size else 0
        if longest + num_new > self.max_cache_len:
            raise ValueError(
                f"FlashCoreCache is full: a row holds {longest} tokens and this step brings {num_new} more (pads "
                f"included), {longest + num_new} > max_cache_len={self.max_cache_len}. Nothing was written. Build "
                f"the cache with room for the whole conversation, e.g. FlashCoreCache(model.config, "
                f"max_cache_len={longest + num_new}) or larger, or call cache.reset() to start over."
            )

    def holds_keys_like(self, key_states: torch.Tensor) -> bool:
        """Whether this layer's buffers take ``key_states``: the same dtype, device and batch."""
        return (
            key_states.dtype == self.dtype
            and key_states.device == self.device
            and key_states.shape[0] == self.batch_size
        )

    def get_seq_length(self) -> torch.Tensor | int:
        return self.logical_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Constant across steps (a per-step value would recompile); flashcore's mask function only reads the
        # new tokens' padding columns, never kv_length.
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Empties every row; K and V keep their contents, which are garbage once ``seq_lens`` is 0."""
        if self.is_initialized:
            self.seq_lens.zero_()
            self.logical_length.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorders rows for beam search, copying in place so the buffers keep their (static) addresses."""
        if not self.is_initialized:
            return
        index = beam_idx.to(self.device)
        for tensor in (self.keys, self.values, self.seq_lens):
            tensor.copy_(tensor.index_select(0, index))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "crop the FlashCoreCache, not one of its layers: the layers share the logical length (FlashCoreCache.crop)"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FlashCoreCache cannot repeat rows after allocation; expand the inputs instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("FlashCoreCache cannot drop rows; its buffers are preallocated")

    def offload(self) -> None:
        raise NotImplementedError("FlashCoreCache does not offload layers; the kernel reads K/V where they live")


class FlashCoreCache(Cache):
    """A ``transformers.Cache`` with one preallocated flashcore 3-tuple per decoder layer.

    Pass it to ``generate`` (or a forward call) of a model patched by
    :func:`flashcore.integrations.llama.apply_flashcore_to_llama`; ``generate`` builds one by itself when none is
    passed. Every layer is allocated on its first ``update``, on the device and in the dtype of that layer's keys,
    so layers may live on different devices (``device_map="auto"``); where ``device`` names each layer's device
    (``generate`` passes the model's), the first update on a device allocates every layer there, in its keys'
    dtype. With ``max_batch_size``, ``device`` and ``dtype`` all given, all layers are allocated at construction.

    ``get_kv_cache(layer_idx)`` returns a layer's ``(k_cache, v_cache, seq_lens)``, the tuple that
    :func:`flashcore.attention_with_kv_cache` reads and writes; :meth:`append_and_attend` is the call the patched
    model makes on it. Beam search is supported (``reorder_cache`` copies rows in place), and so is assisted
    generation (``crop`` rolls the rows back). Works only with a patched model: a stock attention would never see
    the cached tokens.

    Args:
        config: the model's config (its text config is used); every layer must be full attention.
        max_cache_len: S_max, the capacity of every row in tokens. Pads of a left-padded prompt are not stored,
            but a step is refused when the longest row plus that step's ``S_q`` (pads included) exceeds it.
        max_batch_size: B; None takes it from the first update.
        device: one device, or a sequence with one device per layer; None takes each layer's from its keys.
        dtype: element type of K and V; None takes it from the first update.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for the launches on this cache; None (default) uses the
            backend given to ``apply_flashcore_to_llama``.
        tp_size: the tensor-parallel degree of a model loaded with transformers' ``tp_plan``, whose attention sees
            ``num_key_value_heads / tp_size`` KV heads on each rank: each rank's cache holds those. None: the
            model's ``tp_size`` where ``generate`` or ``DecodeSession`` builds the cache, else 1.
    """

    def __init__(
        self,
        config,
        max_cache_len: int,
        *,
        max_batch_size: int | None = None,
        device: DeviceLike | Sequence[DeviceLike] | None = None,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
        tp_size: int | None = None,
    ) -> None:
        text_config = config.get_text_config(decoder=True)
        missing = [name for name in _LLAMA_CONFIG_FIELDS if getattr(text_config, name, None) is None]
        if missing:
            raise NotImplementedError(
                f"FlashCoreCache holds LLaMA-family caches (llama, mistral, qwen2 configs); this config "
                f"(model_type {getattr(text_config, 'model_type', None)!r}) has no {', '.join(missing)}"
            )
        check_full_attention_only(text_config)
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int (tokens per row), got {max_cache_len!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive int or None, got {max_batch_size!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
        num_layers = text_config.num_hidden_layers
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        num_kv_heads = _local_kv_heads(text_config.num_key_value_heads, tp_size)
        layers = [
            FlashCoreLayer(max_cache_len, num_kv_heads=num_kv_heads, head_dim=head_dim) for _ in range(num_layers)
        ]
        super().__init__(layers=layers)
        self._max_cache_len = max_cache_len
        self._max_batch_size = max_batch_size
        self._dtype = dtype
        self._devices = _per_layer_devices(device, num_layers)
        if len(set(self._devices) - {None}) > 1:
            # A model that device_map spread over several devices: accelerate's hooks between its layers break a
            # compiled step into pieces, and the eager code between them cannot announce the forward (update()'s
            # check), so generate must not compile its steps.
            for layer in layers:
                layer.is_compileable = False
        # One logical length per device, shared by the layers there: advanced once per forward, not once per layer.
        self._logical_lengths: dict[torch.device, torch.Tensor] = {}
        # The logical length as the host knows it, which bounds every row's seq_lens (a forward adds at most S_q to
        # each): while it shows room, no forward needs a host read to check capacity. None once a step ran under
        # compilation, or under capture while no owner counts the replays (count_replayed_tokens), whose replays
        # advance the rows without running Python: for good without an owner, else until the next reset().
        self._host_length: int | None = 0
        self._replays_counted = False
        # True from a patched decoder's pre-hook to its last layer (eager forwards): update() refuses to serve a
        # forward that no patched decoder announced, whose stock attention would never see the cached tokens.
        self.in_patched_forward = False
        self.backend = backend
        # append_and_attend's validated calls, one per kind (prefill, decode, device): ops.AttentionPlan.
        self._plans: dict[tuple, ops.AttentionPlan] = {}
        if max_batch_size is not None and dtype is not None and device is not None:
            for layer_idx, layer_device in enumerate(self._devices):
                empty = torch.empty((max_batch_size, num_kv_heads, 0, head_dim), dtype=dtype, device=layer_device)
                self._allocate_layer(layer_idx, empty)

    @property
    def max_cache_len(self) -> int:
        """S_max, the capacity of every row in tokens."""
        return self._max_cache_len

    @property
    def max_batch_size(self) -> int | None:
        """B as given at construction (None: taken from the first update)."""
        return self._max_batch_size

    def get_kv_cache(self, layer_idx: int) -> KVCache:
        """Layer ``layer_idx``'s ``(k_cache, v_cache, seq_lens)``: see :func:`flashcore.attention_with_kv_cache`."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            raise ValueError(f"layer {layer_idx} of the FlashCoreCache is not allocated yet; it is on the first update")
        return layer.keys, layer.values, layer.seq_lens

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocates the layer on first use and returns ``(key_states, value_states)``; nothing is copied.

        Refuses keys that do not match the cache (dtype, device, a batch other than the allocated one), and a
        forward of a model that :func:`~flashcore.integrations.llama.apply_flashcore_to_llama` did not patch
        (eagerly; a compiled or captured step was announced when it was traced).
        """
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            self._allocate_layer(layer_idx, key_states)
        elif key_states.shape[0] != layer.batch_size:
            raise ValueError(
                f"FlashCoreCache was allocated for max_batch_size={layer.batch_size} rows, but this forward has "
                f"{key_states.shape[0]}; build the cache with max_batch_size={key_states.shape[0]}, or leave "
                f"max_batch_size None to take it from the first forward. Nothing was written"
            )
        elif key_states.dtype != layer.dtype:
            raise ValueError(
                f"FlashCoreCache holds {layer.dtype} keys in layer {layer_idx} (allocated with the first layer on its "
                f"device), but this forward has {key_states.dtype} there; build the cache with dtype=<the keys' "
                f"dtype>, or run every layer in one dtype. Nothing was written"
            )
        # Context first: a traced or captured step reads no Python state (dynamo would guard on it).
        if not is_capturing_or_tracing() and not self.in_patched_forward:
            raise RuntimeError(
                "FlashCoreCache was passed to a model that apply_flashcore_to_llama has not patched: its attention "
                "would never see the cached tokens. Call flashcore.integrations.llama.apply_flashcore_to_llama(model) "
                "first, or give the unpatched model a transformers DynamicCache"
            )
        return key_states, value_states

    def append_and_attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        query_lens: torch.Tensor | None = None,
        scale: float | None = None,
        backend: str = "auto",
        token_major: bool = False,
    ) -> torch.Tensor:
        """One layer's step: :func:`flashcore.attention_with_kv_cache` on ``get_kv_cache(layer_idx)``, whose
        contract says what is appended where; returns its output ``[B, H_q, S_q, D]``. With ``token_major``, stored
        token-major (its ``transpose(1, 2)`` contiguous, as a model's o projection reads it) where the call's kernel
        writes into a given tensor (``AttentionPlan.takes_out``: the Gluon prefill kernel), else contiguous as always.

        Layer 0 refuses a step that could overflow before anything is written (every layer holds the same lengths,
        and layer 0 runs first): with no host read while the logical length the host has counted shows room, else
        with one. Under CUDA-graph capture and while ``torch.compile`` traces no host read is allowed and none is
        made (``generate`` has checked the whole call up front, and the kernel never writes past capacity anyway).
        The last layer advances the logical length by ``S_q`` (pads included). ``backend`` is used unless the cache
        was built with its own. An eager call is validated and its kernel picked once per kind of call (prefill,
        decode, device), not once per layer: an :class:`flashcore.ops.AttentionPlan`, which this cache may use
        because it allocates every layer of a device alike.
        """
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            self._allocate_layer(layer_idx, key)
        num_new = query.shape[2]
        if layer_idx == 0:
            self._check_capacity(layer, num_new)
        backend = self.backend or backend
        cache = (layer.keys, layer.values, layer.seq_lens)
        # The op's checks run once at trace time; a layer unlike the keys (a caller that skipped update()'s checks)
        # gets the op's refusal, before anything is written.
        if torch.compiler.is_compiling() or not layer.holds_keys_like(key):
            out, _ = ops.attention_with_kv_cache(
                query, key, value, cache, query_lens=query_lens, scale=scale, backend=backend, check=False
            )
        else:
            # Validated and dispatched once per kind of call rather than once per layer: this cache allocates all of
            # a device's layers alike, and the plan's key covers the rest of what the op would check. Under CUDA-graph
            # capture too (the plan reads no data on the host), so that a captured prefill writes its output
            # token-major as an eager one does; a plan of its own there, since the kernels a capture may run are
            # fewer (the torch backend's reads lengths on the host: not under capture).
            plan_key = (ops.plan_key(query, key, value, query_lens, scale, backend), is_capturing_or_tracing())
            plan = self._plans.get(plan_key)
            if plan is None:
                if len(self._plans) >= MAX_PLANS:  # a new prompt length makes a new kind of call
                    self._plans.clear()
                plan = self._plans[plan_key] = ops.AttentionPlan(
                    query, key, value, cache, query_lens=query_lens, scale=scale, backend=backend
                )
            out = None
            if token_major and plan.takes_out:
                batch, num_heads, num_new, head_dim = query.shape
                out = query.new_empty(batch, num_new, num_heads, head_dim).transpose(1, 2)
            out = plan.run(query, key, value, cache, query_lens, out=out)
        if layer_idx == len(self.layers) - 1:
            for logical_length in self._logical_lengths.values():
                logical_length.add_(num_new)
            if not is_capturing_or_tracing():
                self.in_patched_forward = False
        return out

    def crop(self, max_length: int) -> None:
        """Forgets the last tokens of every row and layer, as ``Cache.crop`` does (assisted generation, prompt lookup).

        ``max_length`` is an int, or a one-element integer tensor (read on the host).
        ``max_length <= 0`` removes ``-max_length`` tokens (transformers 5.24's meaning); ``max_length > 0`` keeps the
        first ``max_length`` (mask columns, pads included, as ``get_seq_length()`` counts them; the meaning of
        earlier versions, a no-op when the cache holds no more). The removed tokens are the latest of every row, never
        its left padding, so each layer's rows roll back by the same count (:func:`flashcore.rollback`): no copy, the
        slots become garbage that the next step writes over. One host read of the logical length, and of layer 0's
        lengths to check that every row holds the tokens removed; raises before anything changes otherwise.
        """
        if isinstance(max_length, torch.Tensor) and max_length.numel() == 1 and not max_length.is_floating_point():
            max_length = int(max_length)  # transformers 5.17's assisted decoding passes the count as a tensor
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"crop takes an int (tokens to keep, or minus tokens to remove), got {max_length!r}")
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return
        length = int(layers[0].logical_length)
        to_remove = -max_length if max_length <= 0 else max(length - max_length, 0)
        if to_remove == 0:
            return
        if to_remove > length:
            raise ValueError(f"cannot crop {to_remove} tokens from a FlashCoreCache that holds {length}")
        self.rollback_rows(to_remove)
        for logical_length in self._logical_lengths.values():
            logical_length.sub_(to_remove)
        if self._host_length is not None:
            self._host_length -= to_remove

    def rollback_rows(self, num_tokens: int | torch.Tensor, *, check: bool | None = None) -> None:
        """:func:`flashcore.rollback` on every allocated layer: each row forgets its last ``num_tokens`` (an int, or
        int32 ``[B]`` per row). Every layer holds the same lengths, so layer 0's check (``check``'s meaning is
        ``rollback``'s) covers them all. The logical length is left as it is: rows that roll back different counts
        no longer share one (``crop`` moves it for a count common to every row)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        for index, layer in enumerate(layers):
            # Under device_map the layers live on several devices; .to is free where the counts are already there.
            counts = num_tokens.to(layer.seq_lens.device) if isinstance(num_tokens, torch.Tensor) else num_tokens
            rollback((layer.keys, layer.values, layer.seq_lens), counts, check=check if index == 0 else False)

    def reset(self) -> None:
        """Empties every row in place; see ``FlashCoreLayer.reset``."""
        super().reset()
        if self._host_length is not None or self._replays_counted:
            self._host_length = 0

    def count_replayed_tokens(self, num_tokens: int) -> None:
        """For the one owner of this cache's captured steps (a ``DecodeSession``): a replay (or a compiled step already
        traced) is about to append at most ``num_tokens`` to every row, with no Python in the cache. An owner that
        calls this before every replay keeps the host's bound on the rows' lengths through them from each ``reset()``
        on, so that a prefill after a reset needs no host read to check capacity: the read makes the host wait for the
        GPU in the first layer (0.1-0.7 ms of a 16 x 512-token prefill, inside the host clock's spread; NOTES.md, entry
        84). Replays by anyone else must not touch a cache whose owner counts."""
        self._replays_counted = True
        if self._host_length is not None:
            self._host_length += num_tokens

    def reserve_replayed_tokens(self, num_tokens: int) -> None:
        """:meth:`count_replayed_tokens` for a replay that must not overflow a row (a captured prefill): refuses it
        first, as an eager forward's first layer does (ValueError, nothing written), with a host read only where
        the host's bound on the rows' lengths shows no room."""
        self._replays_counted = True
        self._check_capacity(self.layers[0], num_tokens)

    def _check_capacity(self, layer: FlashCoreLayer, num_new: int) -> None:
        if is_capturing_or_tracing():
            # A capture appends nothing now, and its replays are counted where an owner counts them. A traced step
            # also runs once, uncounted.
            if torch.compiler.is_compiling() or not self._replays_counted:
                self._host_length = None
            return
        if self._host_length is None or self._host_length + num_new > self.max_cache_len:
            layer.check_capacity(num_new)  # one host read; pads are never stored, so the rows may still have room
        if self._host_length is not None:
            self._host_length += num_new

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: DeviceLike
    ) -> None:
        """Allocates every layer now, as transformers' ``Cache.early_initialization`` does (for ``export``)."""
        empty = torch.empty((batch_size, num_heads, 0, head_dim), dtype=dtype, device=device)
        for layer_idx, layer in enumerate(self.layers):
            if not layer.is_initialized:
                self._allocate_layer(layer_idx, empty)

    def _allocate_layer(self, layer_idx: int, key_states: torch.Tensor) -> None:
        self._check_first_update(layer_idx, key_states)
        device = key_states.device
        if device not in self._logical_lengths:
            self._logical_lengths[device] = torch.zeros((), dtype=torch.int64, device=device)
            _mark_static_addresses(self._logical_lengths[device])
        self.layers[layer_idx].allocate(key_states, self._logical_lengths[device])
        if self._devices[layer_idx] is None:
            return
        # The other layers declared on this device as well, like this one: one burst at the first forward, not an
        # allocation between each two layers (in a CPU prefill of 40 tokens those cost 0.4 ms; NOTES.md, entry 48).
        for layer, declared in zip(self.layers, self._devices, strict=True):
            if not layer.is_initialized and declared is not None and _is_same_device(declared, device):
                layer.allocate(key_states, self._logical_lengths[device])

    def _check_first_update(self, layer_idx: int, key_states: torch.Tensor) -> None:
        expected_device = self._devices[layer_idx]
        for name, expected, got, is_same in (
            ("max_batch_size", self._max_batch_size, key_states.shape[0], _equals),
            ("dtype", self._dtype, key_states.dtype, _equals),
            ("device", expected_device, key_states.device, _is_same_device),
        ):
            if expected is not None and not is_same(expected, got):
                raise ValueError(
                    f"FlashCoreCache was built with {name}={expected} but layer {layer_idx} got keys with {name} "
                    f"{got}; build the cache with {name}={got} or leave it None"
                )


def check_full_attention_only(config) -> None:
    """Refuses configs with sliding-window or other non-full attention layers (flashcore's window is not wired in)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({layer_type for layer_type in layer_types if layer_type != "full_attention"})
        if other:
            raise NotImplementedError(
                f"flashcore supports full-attention layers only, but this config has layer types {other}; "
                f"sliding-window layers are not wired into the integration yet"
            )
    elif getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError(
            f"flashcore supports full-attention layers only, but this config has sliding_window="
            f"{config.sliding_window}; sliding-window layers are not wired into the integration yet"
        )


def _mark_static_addresses(*tensors: torch.Tensor) -> None:
    # Fixed addresses let inductor keep CUDA graphs although the compiled step mutates these tensors, and
    # guard=False lets a new cache of the same shapes reuse the compiled graph instead of recompiling.
    # Marking is not allowed while dynamo traces; only a compiled prefill would allocate there. Off CUDA there are
    # no CUDA graphs to keep, and on the CPU the marks were a quarter of a layer's allocation time.
    if not torch.compiler.is_compiling():
        for tensor in tensors:
            if tensor.is_cuda:
                torch._dynamo.mark_static_address(tensor, guard=False)


def _equals(expected, got) -> bool:
    return expected == got


def _is_same_device(expected: torch.device, got: torch.device) -> bool:
    if expected.type != got.type:
        return False
    # "cuda" means the current CUDA device, whichever index that is.
    return expected.index is None or expected.index == (got.index if got.index is not None else 0)


def _local_kv_heads(num_kv_heads: int, tp_size: int | None) -> int:
    """The KV heads one tensor-parallel rank holds: transformers shards the K/V projections by heads."""
    tp_size = 1 if tp_size is None else tp_size
    if not isinstance(tp_size, int) or tp_size < 1 or num_kv_heads % tp_size:
        raise ValueError(
            f"tp_size must be a positive int that divides num_key_value_heads={num_kv_heads}, got {tp_size!r}"
        )
    return num_kv_heads // tp_size


def _per_layer_devices(device, num_layers: int) -> list[torch.device | None]:
    # Parsed once here: torch.device("cpu") from a string was a visible part of each layer's first update on the CPU.
    if device is None or isinstance(device, (torch.device, str, int)):
        return [None if device is None else torch.device(device)] * num_layers
    devices = list(device)
    if len(devices) != num_layers:
        raise ValueError(f"device must be one device or one per layer ({num_layers}), got {len(devices)} devices")
    return [None if layer_device is None else torch.device(layer_device) for layer_device in devices]
