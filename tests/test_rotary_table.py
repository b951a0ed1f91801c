"""A session's rotary table must give, for any positions, bitwise what the model's own rotary module returns, and
stand aside where that module's output depends on more than the position."""

from __future__ import annotations

import pytest
import torch
from hf_models import seed_of, tiny_llama

from flashcore.integrations.rotary_table import RotaryTable, rotary_table_for, rotary_table_installed

NUM_POSITIONS = 300

# transformers' rope_parameters of a few RoPE types whose cos and sin depend on the position only.
ROPE_PARAMETERS = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "llama3": dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
}  # fmt: skip


@pytest.mark.parametrize("rope", list(ROPE_PARAMETERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_the_rotary_modules_outputs(rope, dtype, device, generator, request):
    model = tiny_llama("gqa", seed_of(request), device)
    model.config.rope_parameters = ROPE_PARAMETERS[rope]
    rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    model.model.rotary_emb = rotary_emb
    model.to(dtype)
    table = rotary_table_for(model, NUM_POSITIONS)
    assert isinstance(table, RotaryTable)

    for shape in ((1, 1), (3, 1), (2, 17)):  # a decode step, a batch's step, a prefill
        positions = torch.randint(0, NUM_POSITIONS, shape, generator=generator).to(device)
        hidden = torch.empty(*shape, model.config.hidden_size, dtype=dtype, device=device)
        expected_cos, expected_sin = rotary_emb(hidden, positions)
        with rotary_table_installed(model, table):
            cos, sin = model.model.rotary_emb(hidden, positions)
        assert model.model.rotary_emb is rotary_emb
        assert cos.dtype == sin.dtype == dtype and cos.shape == expected_cos.shape
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


def test_a_position_past_the_table_reads_its_last_row(device, request):
    model = tiny_llama("gqa", seed_of(request), device)
    table = rotary_table_for(model, NUM_POSITIONS)
    hidden = torch.empty(1, 1, model.config.hidden_size, device=device)
    last = table(hidden, torch.tensor([[NUM_POSITIONS - 1]], device=device))
    past = table(hidden, torch.tensor([[NUM_POSITIONS + 5]], device=device))
    assert all(torch.equal(a, b) for a, b in zip(last, past, strict=True))


def test_length_dependent_rope_keeps_the_rotary_module(device, request):
    model = tiny_llama("gqa", seed_of(request), device)
    model.config.rope_parameters = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    assert rotary_table_for(model, NUM_POSITIONS) is None
    with rotary_table_installed(model, None):
        assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"


def test_the_rotary_module_comes_back_after_an_error(device, request):
    model = tiny_llama("gqa", seed_of(request), device)
    rotary_emb = model.model.rotary_emb
    with pytest.raises(RuntimeError, match="inside"):
        with rotary_table_installed(model, rotary_table_for(model, NUM_POSITIONS)):
            raise RuntimeError("inside")
    assert model.model.rotary_emb is rotary_emb
