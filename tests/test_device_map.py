"""``device_map``: each layer's cache lives on that layer's device, as far as one CPU can show it.

A CPU machine has one real device, so two things are tested here: accelerate's dispatch (``device_map`` with its
hooks, every module on the CPU) leaves flashcore's tokens equal to the undispatched model's, for ``generate`` and a
``DecodeSession``; and a model whose second layer sits on the ``meta`` device (a mocked split) gets a cache whose
layers follow the layers' devices, and a session that refuses one CUDA graph over several devices. Where
activations and cache rows really cross devices, on two GPUs, the last test runs (``FLASHCORE_TEST_DEVICE=cuda``),
and ``benchmarks/bench_multi_gpu.py`` measures a Llama-3.2-1B-shaped model.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU
from hf_models import IdsTokenizer, random_prompts, seed_of, tiny_llama

from flashcore.engine import Engine
from flashcore.integrations.cache import FlashCoreCache
from flashcore.integrations.decode_session import DecodeSession
from flashcore.integrations.llama import apply_flashcore_to_llama, model_layer_devices

NEW_TOKENS = 6


def session_tokens(model, input_ids, attention_mask) -> list:
    session = DecodeSession(model, max_cache_len=input_ids.shape[1] + NEW_TOKENS, batch_size=input_ids.shape[0])
    tokens = [session.prefill(input_ids, attention_mask).clone()]
    tokens += [session.decode_step().clone() for _ in range(NEW_TOKENS - 1)]
    return torch.stack(tokens, dim=1).tolist()


def test_dispatched_model_keeps_the_tokens(generator, request):
    from accelerate import dispatch_model

    model = tiny_llama("gqa", seed_of(request), "cpu")
    dispatched = tiny_llama("gqa", seed_of(request), "cpu")
    layers = [f"model.layers.{index}" for index in range(model.config.num_hidden_layers)]
    device_map = {name: "cpu" for name in ("model.embed_tokens", *layers, "model.norm", "model.rotary_emb", "lm_head")}
    # force_hooks: with one device, accelerate (and from_pretrained) would not install the hooks that move
    # activations and keyword arguments between layers; here they run as they do across GPUs.
    dispatch_model(dispatched, device_map=device_map, force_hooks=True)
    assert hasattr(dispatched.model.layers[1], "_hf_hook")
    input_ids, attention_mask = random_prompts([9, 5], generator, "cpu")
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        expected = model.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist()
        apply_flashcore_to_llama(dispatched, backend="torch")
        assert dispatched.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist() == expected
        assert session_tokens(dispatched, input_ids, attention_mask) == expected


def test_cache_and_session_follow_each_layers_device(request):
    model = tiny_llama("gqa", seed_of(request), "cpu")
    model.model.layers[1].to("meta")  # a mocked split: layer 1 on another device
    assert model_layer_devices(model) == [torch.device("cpu"), torch.device("meta")]
    session = DecodeSession(model, max_cache_len=16, batch_size=2)
    assert not session.use_cuda_graph
    assert [session.cache.get_kv_cache(index)[0].device.type for index in range(2)] == ["cpu", "meta"]
    assert session.token.device.type == "cpu"  # the session's buffers stay with the input embeddings
    with pytest.raises(ValueError, match=r"use_cuda_graph=True needs the model on one device.*\['cpu', 'meta'\]"):
        DecodeSession(model, max_cache_len=16, batch_size=2, use_cuda_graph=True)
    with pytest.raises(ValueError, match=r"compile=True needs the model on one device.*\['cpu', 'meta'\]"):
        DecodeSession(model, max_cache_len=16, batch_size=2, compile=True)
    # The engine's rows share one seq_lens tensor: it takes one device (per tensor-parallel rank) and says so.
    with pytest.raises(NotImplementedError, match=r"the engine runs a model on one device.*\['cpu', 'meta'\]"):
        Engine(model, IdsTokenizer())


def test_lazy_cache_allocates_each_layer_where_its_keys_are(request):
    config = tiny_llama("gqa", seed_of(request), "meta").config
    heads, head_dim = config.num_key_value_heads, config.head_dim
    cache = FlashCoreCache(config, max_cache_len=8, device=["cpu", "meta"])
    cache.in_patched_forward = True
    for layer_idx, device in enumerate(("cpu", "meta")):
        keys = torch.zeros(1, heads, 3, head_dim, device=device)
        cache.update(keys, keys, layer_idx)
    # accelerate's hooks between devices break a compiled step: generate must not compile over such a cache.
    assert not cache.is_compileable and FlashCoreCache(config, max_cache_len=8, device="cpu").is_compileable
    k0, _, lens0 = cache.get_kv_cache(0)
    k1, _, lens1 = cache.get_kv_cache(1)
    assert (k0.device.type, lens0.device.type, k1.device.type, lens1.device.type) == ("cpu", "cpu", "meta", "meta")
    with pytest.raises(ValueError, match="built with device=cpu but layer 1 got keys with device meta"):
        other = FlashCoreCache(config, max_cache_len=8, device="cpu")
        other.in_patched_forward = True
        other.update(torch.zeros(1, heads, 3, head_dim, device="meta"), torch.zeros(1, heads, 3, head_dim), 1)


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_layers_on_two_gpus_keep_the_tokens(generator, request):
    """Layer 0 on the first GPU, layer 1 on the second: flashcore's kernels must launch on each layer's GPU (Triton
    launches on the current device) and each layer's cache must live there. fp32, so that both runs compute the same
    bits on the same kernels."""
    from accelerate import dispatch_model

    model = tiny_llama("gqa", seed_of(request), "cuda:0")
    split = tiny_llama("gqa", seed_of(request), "cpu")
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                  "model.rotary_emb": 1, "lm_head": 1}  # fmt: skip
    dispatch_model(split, device_map=device_map)
    assert model_layer_devices(split) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    input_ids, attention_mask = random_prompts([9, 5], generator, "cuda:0")
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        apply_flashcore_to_llama(model)
        expected = model.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist()
        assert session_tokens(model, input_ids, attention_mask) == expected
        apply_flashcore_to_llama(split)
        assert split.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist() == expected
        assert session_tokens(split, input_ids, attention_mask) == expected
