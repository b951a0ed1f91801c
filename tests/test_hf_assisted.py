"""Assisted generation on a ``FlashCoreCache``: ``crop`` rolls every layer back, and ``generate`` with prompt lookup
or a draft model gives stock transformers' greedy tokens (tiny random models here; the real SmolLM2 in
test_hf_smollm2.py)."""

from __future__ import annotations

import pytest
import torch
from hf_models import seed_of, tiny_llama

from flashcore.integrations.llama import (
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)

pytest_plugins = ["hf_fixtures"]


def repetitive_prompt(generator: torch.Generator, device) -> torch.Tensor:
    """A prompt that repeats itself, so that prompt lookup finds candidates and some are accepted."""
    phrase = torch.randint(3, 200, (1, 12), generator=generator)
    return torch.cat([phrase, phrase, phrase[:, :6]], dim=1).to(device)


def assistant_options(assistant: str, draft_seed: int, device) -> dict:
    """``generate``'s options for prompt lookup (3 tokens), or for a draft model (a tiny random one)."""
    if assistant == "prompt_lookup":
        return dict(prompt_lookup_num_tokens=3)
    draft = tiny_llama("gqa", draft_seed, device)
    draft.generation_config.disable_compile = True
    return dict(assistant_model=draft)


@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 24), ("triton", 6)])
@pytest.mark.parametrize("assistant", ["prompt_lookup", "draft_model"])
@torch.no_grad()
def test_assisted_greedy_matches_stock(
    model, assistant, backend, max_new_tokens, generator, device, request, monkeypatch
):
    ids = repetitive_prompt(generator, device)
    options = assistant_options(assistant, seed_of(request) + 1, device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **options)
    expected = model.generate(ids, **kwargs)
    removed = []
    crop = FlashCoreCache.crop

    def recording_crop(cache, max_length):
        before = int(cache.layers[0].logical_length)
        crop(cache, max_length)
        removed.append(before - int(cache.layers[0].logical_length))

    monkeypatch.setattr(FlashCoreCache, "crop", recording_crop)
    apply_flashcore_to_llama(model, backend=backend)
    out = model.generate(ids, **kwargs)
    remove_flashcore(model)
    assert torch.equal(out, expected)
    assert removed, "generate never cropped the cache: no verify step ran"
    if assistant == "prompt_lookup" and backend == "torch":
        assert any(removed), "every candidate was accepted: no rollback ran"


@torch.no_grad()
def test_crop_rolls_back_every_layer_and_the_logical_length(model, generator, device):
    apply_flashcore_to_llama(model)
    cache = FlashCoreCache(model.config, max_cache_len=32)
    ids = torch.randint(3, 200, (2, 10), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1: 3 pads, never stored
    model(ids, attention_mask=mask, **{CACHE_ARGUMENT_NAME: cache})
    lengths = [layer.seq_lens.tolist() for layer in cache.layers]
    assert lengths == [[10, 7]] * len(cache.layers) and cache.get_seq_length() == 10

    cache.crop(-4)  # transformers 5.24's meaning: remove 4
    assert [layer.seq_lens.tolist() for layer in cache.layers] == [[6, 3]] * len(cache.layers)
    assert int(cache.get_seq_length()) == 6
    cache.crop(torch.tensor(5, device=device))  # earlier versions' meaning: keep the first 5; a tensor, as 5.17 passes
    assert [layer.seq_lens.tolist() for layer in cache.layers] == [[5, 2]] * len(cache.layers)
    cache.crop(0)
    cache.crop(9)  # keeps more than it holds: nothing to do
    assert int(cache.get_seq_length()) == 5

    before = [layer.seq_lens.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match=r"cannot roll back 3 tokens of row 1, which holds seq_lens\[1\] = 2"):
        cache.crop(-3)  # row 1 would lose a token it never stored (a pad)
    with pytest.raises(ValueError, match="cannot crop 6 tokens from a FlashCoreCache that holds 5"):
        cache.crop(-6)
    with pytest.raises(TypeError, match="crop takes an int"):
        cache.crop(1.5)
    with pytest.raises(TypeError, match="crop takes an int"):
        cache.crop(torch.tensor(-1.0))
    assert all(torch.equal(layer.seq_lens, saved) for layer, saved in zip(cache.layers, before, strict=True))
    assert int(cache.get_seq_length()) == 5
    remove_flashcore(model)


@pytest.mark.parametrize("assistant", ["prompt_lookup", "draft_model"])
@torch.no_grad()
def test_assisted_batch_is_refused_as_stock_refuses_it(model, assistant, generator, device, request):
    """transformers runs assisted generation at batch size 1 only: a left-padded batch gets stock's own error on
    flashcore too, before the cache is touched (the session's speculative step takes batches:
    test_decode_session.py)."""
    ids = torch.cat([repetitive_prompt(generator, device)] * 2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    kwargs |= assistant_options(assistant, seed_of(request) + 1, device)
    with pytest.raises(ValueError) as stock_error:
        model.generate(ids, **kwargs)
    apply_flashcore_to_llama(model)
    try:
        with pytest.raises(ValueError) as flashcore_error:
            model.generate(ids, **kwargs)
    finally:
        remove_flashcore(model)
    assert str(flashcore_error.value) == str(stock_error.value) and "batch" in str(stock_error.value)
