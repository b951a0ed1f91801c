"""The HF integration's entry points: ``apply_flashcore_to_llama`` (its docstring's example: stock ``generate``
on a patched model matches stock transformers and builds a FlashCoreCache), ``remove_flashcore``, what a patched
model refuses, and FlashCoreCache's capacity and allocation.

The reference is always the same model object before ``apply_flashcore_to_llama`` (or after ``remove_flashcore``).
The other HF test files: test_hf_generate.py (every generate feature against stock), test_hf_smollm2.py (the real
model), test_hf_gpu.py (CUDA only).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import BACKENDS, random_prompts, tiny_config, tiny_llama
from transformers import DynamicCache

from flashcore.integrations.cache import FlashCoreLayer
from flashcore.integrations.llama import (
    ATTENTION_IMPLEMENTATION,
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)

pytest_plugins = ["hf_fixtures"]


@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 16), ("triton", 6)])
@torch.no_grad()
def test_generate_greedy_matches_stock(model, backend, max_new_tokens, generator, device, launches):
    """Greedy, one prompt; the cache generate builds is a FlashCoreCache sized for exactly the fed tokens."""
    input_ids, _ = random_prompts([11], generator, device)
    expected = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    apply_flashcore_to_llama(model, backend=backend)
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    cache, fed = getattr(out, CACHE_ARGUMENT_NAME), 11 + max_new_tokens - 1  # the last token is never fed
    assert isinstance(cache, FlashCoreCache)
    assert cache.max_cache_len == fed
    assert cache.get_kv_cache(1)[2].tolist() == [fed]
    assert int(cache.get_seq_length()) == fed
    assert {launch.backend for launch in launches} == {backend}


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_full_cache_raises_before_writing(model, backend, generator, device):
    apply_flashcore_to_llama(model, backend=backend)
    cache = FlashCoreCache(model.config, max_cache_len=10)
    prompt, _ = random_prompts([8], generator, device)
    model(prompt, **{CACHE_ARGUMENT_NAME: cache})
    before = [tuple(t.clone() for t in cache.get_kv_cache(i)) for i in range(len(cache.layers))]
    logical_before = int(cache.get_seq_length())

    too_long, _ = random_prompts([3], generator, device)
    with pytest.raises(ValueError, match=r"max_cache_len=10.*FlashCoreCache\(model.config, max_cache_len=11\)"):
        model(too_long, **{CACHE_ARGUMENT_NAME: cache})
    for layer_idx, tensors in enumerate(before):
        for expected, actual in zip(tensors, cache.get_kv_cache(layer_idx), strict=True):
            # Bitwise, garbage slots included: torch.empty memory may hold NaN patterns, which == would reject.
            assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    assert int(cache.get_seq_length()) == logical_before

    with pytest.raises(ValueError, match="max_cache_len"):
        model.generate(
            too_long, **{CACHE_ARGUMENT_NAME: FlashCoreCache(model.config, max_cache_len=4)}, max_new_tokens=3
        )

    exactly_full, _ = random_prompts([2], generator, device)  # positive control: 8 + 2 == max_cache_len
    model(exactly_full, **{CACHE_ARGUMENT_NAME: cache})
    assert cache.get_kv_cache(0)[2].tolist() == [10]

    cache.reset()  # empties the rows in place: the whole capacity is usable again
    model(torch.cat([prompt, exactly_full], dim=1), **{CACHE_ARGUMENT_NAME: cache})
    assert cache.get_kv_cache(1)[2].tolist() == [10]
    assert int(cache.get_seq_length()) == 10


@torch.no_grad()
def test_capacity_is_read_on_the_host_only_when_the_count_shows_no_room(model, generator, device, monkeypatch):
    """The cache counts the logical length on the host (an upper bound of every row's length): while it shows
    room, a forward checks capacity without reading seq_lens (no host sync); at the limit, it reads them."""
    reads = []
    check_capacity = FlashCoreLayer.check_capacity
    monkeypatch.setattr(FlashCoreLayer, "check_capacity", lambda layer, n: reads.append(n) or check_capacity(layer, n))
    apply_flashcore_to_llama(model, backend="torch")
    input_ids, attention_mask = random_prompts([8, 5], generator, device)
    cache = FlashCoreCache(model.config, max_cache_len=12)
    out = model.generate(
        input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=5, do_sample=False
    )
    assert reads == [] and int(cache.get_seq_length()) == 12  # 8 + 4 fed tokens: exactly full, never read
    with pytest.raises(ValueError, match="max_cache_len=12"):
        model(out[:, -1:], attention_mask=torch.ones_like(out), **{CACHE_ARGUMENT_NAME: cache})
    assert reads == [1]
    cache.reset()
    model(input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT_NAME: cache})
    assert reads == [1] and cache.get_kv_cache(0)[2].tolist() == [8, 5]


def test_cache_allocation_per_layer_device_and_checks(device):
    """All of max_batch_size, device (one per layer here) and dtype given: allocated at construction; otherwise
    on the first update, which must then agree with what was given."""
    config = tiny_llama("gqa", 0, "cpu").config
    cache = FlashCoreCache(config, max_cache_len=12, max_batch_size=2, device=[device, device], dtype=torch.float16)
    assert cache.is_initialized and cache.is_compileable and cache.max_cache_len == 12
    k_cache, v_cache, seq_lens = cache.get_kv_cache(1)
    assert k_cache.shape == v_cache.shape == (2, 2, 12, 16)
    assert (k_cache.dtype, k_cache.device.type, seq_lens.dtype) == (torch.float16, device.type, torch.int32)
    assert seq_lens.tolist() == [0, 0] and int(cache.get_seq_length()) == 0

    lazy = FlashCoreCache(config, max_cache_len=12, dtype=torch.float16)
    assert not lazy.is_initialized
    keys = torch.zeros((1, 2, 3, 16), device=device)
    with pytest.raises(ValueError, match="dtype=torch.float16"):
        lazy.update(keys, keys, 0)
    with pytest.raises(ValueError, match="max_cache_len"):
        FlashCoreCache(config, max_cache_len=0)


@torch.no_grad()
def test_apply_is_idempotent_and_remove_restores_stock(model, generator, device):
    input_ids, _ = random_prompts([6], generator, device)
    expected = model.generate(input_ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    attention = model.model.layers[0].self_attn
    assert apply_flashcore_to_llama(model, backend="torch") is model
    hooks = (len(attention._forward_pre_hooks), len(model.model._forward_pre_hooks))
    assert apply_flashcore_to_llama(model, backend="torch") is model
    # One hook, on the decoder: it hands the cache to every layer's attention through the forward's kwargs.
    assert (len(attention._forward_pre_hooks), len(model.model._forward_pre_hooks)) == hooks == (0, 1)
    assert model.config._attn_implementation == ATTENTION_IMPLEMENTATION
    assert "flash" not in ATTENTION_IMPLEMENTATION  # transformers would treat it as FlashAttention

    assert remove_flashcore(model) is model
    assert model.config._attn_implementation == "sdpa"
    assert (len(attention._forward_pre_hooks), len(model.model._forward_pre_hooks)) == (0, 0)
    assert "_prepare_cache_for_generation" not in model.__dict__
    out = model.generate(input_ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert type(getattr(out, CACHE_ARGUMENT_NAME)) is DynamicCache
    assert remove_flashcore(model) is model  # removing twice is a no-op


@torch.no_grad()
def test_refuses_what_it_cannot_run(model, generator, device):
    from transformers import MistralConfig, MistralForCausalLM

    input_ids, _ = random_prompts([5], generator, device)
    apply_flashcore_to_llama(model, backend="torch")
    with pytest.raises(TypeError, match="FlashCoreCache"):
        model.generate(input_ids, **{CACHE_ARGUMENT_NAME: DynamicCache(config=model.config)}, max_new_tokens=2)
    with pytest.raises(TypeError, match="FlashCoreCache"):
        model(input_ids, **{CACHE_ARGUMENT_NAME: DynamicCache(config=model.config)})
    with pytest.raises(NotImplementedError, match="inference-only"), torch.enable_grad():
        model(input_ids, use_cache=False)
    with pytest.raises(NotImplementedError, match="2-D padding mask"):
        model(input_ids, attention_mask=torch.ones((1, 1, 5, 5), dtype=torch.bool, device=device), use_cache=False)
    with pytest.raises(ValueError, match="backend"):
        apply_flashcore_to_llama(model, backend="cuda")

    windowed = MistralForCausalLM(tiny_config(MistralConfig, "gqa", sliding_window=16))
    with pytest.raises(NotImplementedError, match="sliding_window=16"):
        apply_flashcore_to_llama(windowed)
    with pytest.raises(NotImplementedError, match="sliding"):
        FlashCoreCache(windowed.config, max_cache_len=8)


@pytest.mark.skipif(
    CACHE_ARGUMENT_NAME == "past_key_values", reason="before transformers 5.24 past_key_values is the current name"
)
@torch.no_grad()
def test_decoder_refuses_deprecated_cache_name(model, generator, device):
    """The decoder's pre-hook runs before transformers' deprecation shim renames past_key_values= to cache=, so it
    would miss that cache and the shim would then drop it for the one the hook built; the hook refuses it instead."""
    apply_flashcore_to_llama(model, backend="torch")
    input_ids, _ = random_prompts([5], generator, device)
    cache = FlashCoreCache(model.config, max_cache_len=8)
    with pytest.raises(TypeError, match="cache="):
        model.model(input_ids, past_key_values=cache)
    assert not cache.is_initialized
    model.model(input_ids, cache=cache)  # positive control: the current name
    assert cache.get_kv_cache(0)[2].tolist() == [5]
