"""FlashCoreCache used the wrong way: each misuse raises an error that names the fix, before anything is written.

A tiny random-weight LlamaConfig (the real SmolLM2 has 30 layers, 9/3 heads, head dim 64), the torch backend, CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, FlashCoreCache, apply_flashcore_to_llama, remove_flashcore


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=101, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def run_forward(model, input_ids, cache):
    with torch.no_grad():
        return model(input_ids=input_ids, **{CACHE_ARGUMENT_NAME: cache}, use_cache=True)


def test_unsupported_config_names_the_model_type():
    with pytest.raises(NotImplementedError, match="'gpt2'.*num_key_value_heads"):
        FlashCoreCache(GPT2Config(), max_cache_len=16)


def test_unpatched_model_refuses_the_cache_and_writes_nothing():
    """A stock attention would attend to the new tokens only and ignore the cached ones: refused by name."""
    model = tiny_llama()
    cache = FlashCoreCache(model.config, max_cache_len=16, max_batch_size=1, device="cpu", dtype=torch.float32)
    lengths_before = cache.get_kv_cache(0)[2].clone()
    with pytest.raises(RuntimeError, match="apply_flashcore_to_llama"):
        run_forward(model, torch.randint(1, 101, (1, 5)), cache)
    assert torch.equal(cache.get_kv_cache(0)[2], lengths_before)


def test_cache_is_refused_again_after_remove_flashcore():
    model = apply_flashcore_to_llama(tiny_llama(), backend="torch")
    cache = FlashCoreCache(model.config, max_cache_len=16)
    run_forward(model, torch.randint(1, 101, (1, 5)), cache)  # positive control: the patched model takes it
    assert int(cache.get_kv_cache(0)[2][0]) == 5
    remove_flashcore(model)
    with pytest.raises(RuntimeError, match="apply_flashcore_to_llama"):
        run_forward(model, torch.randint(1, 101, (1, 2)), cache)
    assert int(cache.get_kv_cache(0)[2][0]) == 5


@pytest.mark.parametrize("allocated_when", ["built", "first_forward"])
def test_other_batch_size_names_max_batch_size(allocated_when):
    model = apply_flashcore_to_llama(tiny_llama(), backend="torch")
    if allocated_when == "built":
        cache = FlashCoreCache(model.config, max_cache_len=16, max_batch_size=2, device="cpu", dtype=torch.float32)
    else:
        cache = FlashCoreCache(model.config, max_cache_len=16)
        run_forward(model, torch.randint(1, 101, (2, 3)), cache)
    lengths_before = cache.get_kv_cache(0)[2].clone()
    with pytest.raises(ValueError, match="max_batch_size=2"):
        run_forward(model, torch.randint(1, 101, (1, 3)), cache)
    assert torch.equal(cache.get_kv_cache(0)[2], lengths_before)


def test_first_update_allocates_the_device_and_a_layer_in_another_dtype_is_refused():
    """Where the cache names each layer's device, the first update allocates every layer there in its keys' dtype;
    a later layer whose keys come in another dtype is refused by name, before its row is written."""
    model = tiny_llama()
    cache = FlashCoreCache(model.config, max_cache_len=16, device="cpu")
    keys = torch.randn(1, 2, 3, 16)
    cache.in_patched_forward = True  # what a patched decoder's pre-hook announces
    cache.update(keys, keys, 0)
    assert all(layer.is_initialized and layer.dtype == torch.float32 for layer in cache.layers)
    lengths_before = cache.get_kv_cache(1)[2].clone()
    with pytest.raises(ValueError, match=r"torch.float32 keys in layer 1.*torch.float64.*dtype="):
        cache.update(keys.double(), keys.double(), 1)
    assert torch.equal(cache.get_kv_cache(1)[2], lengths_before)


@pytest.mark.parametrize(
    ("held", "planned", "message"),
    [
        ((1, torch.float32), (1, torch.float16), "k_cache dtype torch.float32 must match query dtype torch.float16"),
        ((1, torch.float32), (2, torch.float32), r"k_cache/v_cache .* must be \[B=2"),
    ],
    ids=["dtype", "batch"],
)
def test_append_and_attend_refuses_keys_unlike_the_layer_after_a_plan_exists(held, planned, message):
    """A direct append_and_attend (no update() before it) with keys of another dtype or batch than its layer holds
    gets the op's refusal, before anything is written, although a plan for keys like them exists (made on a layer
    that holds them: without ``device``, each layer is allocated for the keys of its own first step)."""
    cache = FlashCoreCache(tiny_llama().config, max_cache_len=16)

    def step(layer_idx, batch, dtype):
        query, keys = torch.randn(batch, 4, 1, 16, dtype=dtype), torch.randn(batch, 2, 1, 16, dtype=dtype)
        return cache.append_and_attend(layer_idx, query, keys, keys)

    step(1, *held)  # layer 1 holds these keys
    step(0, *planned)  # layer 0 holds the others, and plans their step
    before = [tensor.clone() for tensor in cache.get_kv_cache(1)]
    with pytest.raises((TypeError, ValueError), match=message):
        step(1, *planned)
    for was, now in zip(before, cache.get_kv_cache(1), strict=True):  # bit for bit, the garbage included
        torch.testing.assert_close(now, was, rtol=0, atol=0, equal_nan=True)
