"""``apply_flashcore_to_llama(onednn_linears=...)``: the projections and the LM head on oneDNN must give
``F.linear``'s logits and stock's greedy tokens, leave every weight as it was, and be undone by
``onednn_linears=False`` and ``remove_flashcore``.

The references are the same model object with its linears on ``F.linear``, run through flashcore (so only the GEMMs
differ), and stock ``generate`` before ``apply_flashcore_to_llama``. oneDNN is a CPU library, so these tests build
their models on the CPU on any test device.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import PAD_ID, random_prompts, seed_of, tiny_llama
from test_fused_projections import build, prefill_and_decode_logits

from flashcore.integrations.llama import apply_flashcore_to_llama, flashcore_options, remove_flashcore
from flashcore.integrations.onednn_linears import linears

CPU = torch.device("cpu")


def onednn_calls(model, input_ids) -> int:
    """How many oneDNN linears one forward runs, counted by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, torch.no_grad():
        model(input_ids, use_cache=False)
    return sum(event.count for event in profile.key_averages() if event.key.endswith("_linear_pointwise"))


def on_onednn(model) -> list[bool]:
    return ["forward" in linear.__dict__ for linear in linears(model)]


@pytest.mark.parametrize("architecture", ["gqa", "qwen2"])  # qwen2: q/k/v with a bias
@pytest.mark.parametrize("fuse_projections", [False, True])
def test_onednn_linears_match_f_linear(architecture, fuse_projections, generator, request):
    model = build(architecture, seed_of(request), CPU)
    input_ids, attention_mask = random_prompts([7, 3, 5], generator, CPU)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    stock_tokens = model.generate(input_ids, **kwargs)
    values = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    options = dict(backend="torch", fuse_projections=fuse_projections)
    apply_flashcore_to_llama(model, onednn_linears=False, **options)
    pointers = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}  # fusing moved some
    expected = prefill_and_decode_logits(model, input_ids, attention_mask)
    assert onednn_calls(model, input_ids) == 0

    apply_flashcore_to_llama(model, onednn_linears=True, **options)
    apply_flashcore_to_llama(model, onednn_linears=True, **options)  # idempotent

    assert flashcore_options(model)["onednn_linears"] is True
    assert all(on_onednn(model))
    layers = len(model.model.layers)
    # Fused q/k/v and gate/up are one F.linear each; the o and down projections and the LM head stay on oneDNN.
    assert onednn_calls(model, input_ids) == (2 if fuse_projections else 7) * layers + 1
    for name, tensor in model.state_dict().items():  # the weights are untouched: same storage, same values
        assert tensor.data_ptr() == pointers[name] and torch.equal(tensor, values[name]), name
    # fp32: only the GEMMs' summation order differs.
    torch.testing.assert_close(
        prefill_and_decode_logits(model, input_ids, attention_mask), expected, rtol=1e-5, atol=1e-5
    )
    assert torch.equal(model.generate(input_ids, **kwargs), stock_tokens)

    remove_flashcore(model)
    assert not any(on_onednn(model))
    assert onednn_calls(model, input_ids) == 0
    assert torch.equal(model.generate(input_ids, **kwargs), stock_tokens)


def test_default_picks_fp32_on_the_cpu(request):
    """None runs fp32 CPU linears on oneDNN and leaves 16-bit ones on F.linear, picked anew by each call (a model
    moved after the patch); False turns it off."""
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), CPU), backend="torch")
    assert flashcore_options(model)["onednn_linears"] is None
    assert all(on_onednn(model))
    apply_flashcore_to_llama(model, backend="torch", onednn_linears=False)
    assert not any(on_onednn(model))

    half = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), CPU).to(torch.bfloat16), backend="torch")
    assert not any(on_onednn(half))

    moved = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), CPU), backend="torch")
    assert all(on_onednn(moved))
    apply_flashcore_to_llama(moved.to(torch.bfloat16), backend="torch")  # picked anew where the model is now
    assert not any(on_onednn(moved))


def test_default_leaves_a_gpu_model_as_it_is(device, request):
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), device), backend="torch")
    assert on_onednn(model) == [device.type == "cpu"] * len(linears(model))


def test_true_refuses_what_it_cannot_run_before_changing_anything(request):
    model = tiny_llama("gqa", seed_of(request), CPU)
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = lambda input: torch.nn.Linear.forward(hooked, input)  # as accelerate's hooks replace it
    with pytest.raises(NotImplementedError, match="onednn_linears=True found a linear whose forward"):
        apply_flashcore_to_llama(model, backend="torch", onednn_linears=True)
    assert "_flashcore_state" not in model.__dict__
    assert on_onednn(model).count(True) == 1  # the hooked one, as it was

    apply_flashcore_to_llama(model, backend="torch")  # None keeps the other forward
    assert hooked.__dict__["forward"] is not None and on_onednn(model).count(True) == len(linears(model))
    remove_flashcore(model)
    assert "forward" in hooked.__dict__ and on_onednn(model).count(True) == 1

    for other in (tiny_llama("gqa", seed_of(request), CPU).to("meta"), tiny_llama("gqa", 0, CPU).half()):
        with pytest.raises(ValueError, match="onednn_linears=True runs fp32 CPU linears"):
            apply_flashcore_to_llama(other, backend="torch", onednn_linears=True)
        assert "_flashcore_state" not in other.__dict__
