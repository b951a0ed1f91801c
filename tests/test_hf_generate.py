"""Every generate feature on a model patched by ``apply_flashcore_to_llama`` must match stock transformers (sdpa,
DynamicCache, float32) token for token, and must really run on flashcore's kernel.

Tiny random-weight LLaMA models (GQA and MHA, two layers) cover left-padded batches, seeded sampling, multi-turn
caches, beam search, plain forwards, the compiled decode step, and Qwen2 and Mistral, on both backends. The
reference is always the same model object before ``apply_flashcore_to_llama``.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import BACKENDS, random_prompts, seed_of, tiny_same_attention_model
from transformers import CompileConfig, DynamicCache

from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, FlashCoreCache, apply_flashcore_to_llama

pytest_plugins = ["hf_fixtures"]


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_left_padded_batch_matches_stock_and_stores_no_pads(model, backend, generator, device):
    """Three prompts of different lengths, left-padded: same tokens, and row b stores only its real tokens
    (pads never stored), with the same keys stock stores after its pads (same RoPE positions)."""
    lengths, max_new_tokens = [10, 6, 3], 5
    input_ids, attention_mask = random_prompts(lengths, generator, device)
    greedy = dict(
        attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True
    )
    stock = model.generate(input_ids, **greedy)
    apply_flashcore_to_llama(model, backend=backend)
    ours = model.generate(input_ids, **greedy)
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

    def turn(input_ids, cache):
        return model.generate(input_ids, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=new_tokens, do_sample=False)

    stock_cache = DynamicCache(config=model.config)
    stock_first = turn(first_ids, stock_cache)
    stock_second = turn(torch.cat([stock_first, user_turn], dim=1), stock_cache)

    apply_flashcore_to_llama(model, backend=backend)
    cache = FlashCoreCache(model.config, max_cache_len=64)
    first = turn(first_ids, cache)
    assert torch.equal(first, stock_first)
    launches.clear()
    second = turn(torch.cat([first, user_turn], dim=1), cache)
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
    row's real token count. Its decode steps (one real token per row) carry query_lens on CUDA, where reading the
    mask on the host would wait for the GPU, and pass None on the CPU, where the read is free."""
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
        assert launch.s_q == (9 if index < num_layers else 1)
        if index >= num_layers and device.type == "cpu":
            assert launch.query_lens is None
            continue
        expected = lengths if index < num_layers else [1] * len(lengths)
        assert launch.query_lens is not None and launch.query_lens.tolist() == expected


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
    greedy = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    expected = model.generate(input_ids, **greedy)
    apply_flashcore_to_llama(model, backend="torch")
    compile_config = CompileConfig(backend="aot_eager", mode=None, fullgraph=True)
    compile_config._compile_all_devices = True  # generate only auto-compiles on accelerators otherwise
    counters = _counting_graphs()
    for _ in range(2):
        # The fixture turns compile off for the other tests.
        out = model.generate(input_ids, **greedy, compile_config=compile_config, disable_compile=False)
        assert torch.equal(out, expected)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
@torch.no_grad()
def test_same_attention_architectures_match_stock(architecture, request, generator, device):
    """Qwen2 (q/k/v bias) and Mistral without a window share LLaMA's attention and run patched too."""
    model = tiny_same_attention_model(architecture, seed_of(request), device)
    input_ids, attention_mask = random_prompts([8, 4], generator, device)
    greedy = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    expected = model.generate(input_ids, **greedy)
    apply_flashcore_to_llama(model, backend="torch")
    assert torch.equal(model.generate(input_ids, **greedy), expected)


@pytest.mark.parametrize("lengths", [[6, 6], [6, 3]])
@pytest.mark.parametrize("num_new", [1, 6])
@torch.no_grad()
def test_mask_hook_gives_what_transformers_builds(model, lengths, num_new, generator, device):
    """The ``create_masks_for_generate`` a patched model carries returns what transformers' own function returns for
    it (padded rows and not, prefill and decode); a model switched to another attention gets transformers' result."""
    from transformers.masking_utils import create_masks_for_generate

    apply_flashcore_to_llama(model, backend="torch")
    _, attention_mask = random_prompts(lengths, generator, device)
    cache = FlashCoreCache(model.config, max_cache_len=16)
    patched_attention = model.config._attn_implementation
    try:
        for attention in (patched_attention, "sdpa"):
            model.config._attn_implementation = attention  # "sdpa": as if switched after the patch
            kwargs = dict(
                config=model.config,
                inputs_embeds=torch.empty((len(lengths), num_new, 0), dtype=model.dtype, device=device),
                attention_mask=attention_mask,
                **{CACHE_ARGUMENT_NAME: cache},  # transformers 5.17 names it past_key_values
                position_ids=None,
            )
            expected, got = create_masks_for_generate(**kwargs), model.create_masks_for_generate(**kwargs)
            assert (got is None and expected is None) or torch.equal(got, expected)
    finally:
        model.config._attn_implementation = patched_attention
