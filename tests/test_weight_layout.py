"""``apply_flashcore_to_llama(input_major_weights=...)``: projection weights stored input-major must give the
row-major model's logits and stock's greedy tokens, keep every Parameter's shape, values, name and tie, add no
memory, and be undone by ``input_major_weights=False`` and ``remove_flashcore``.

The references are the same model object with row-major weights run through flashcore (so only the layout differs),
and stock ``generate`` before ``apply_flashcore_to_llama``.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import PAD_ID, random_prompts, seed_of, tiny_config, tiny_llama
from test_fused_projections import prefill_and_decode_logits

from flashcore.integrations.llama import apply_flashcore_to_llama, flashcore_options, remove_flashcore
from flashcore.integrations.weight_layout import is_input_major

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def tied_llama(attention: str, seed: int, device):
    """Input embeddings and LM head share one Parameter, as in SmolLM2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = tiny_config(LlamaConfig, attention, max_position_embeddings=512, bos_token_id=1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def converted_weights(model, fused: bool = False) -> list[torch.Tensor]:
    """Every weight the option covers: each layer's projections and the LM head; with ``fused``, the o and down
    projections and the LM head (q/k/v and gate/up share their fused weight, which stays row-major)."""
    kept = ("o_proj", "down_proj") if fused else PROJECTIONS["self_attn"] + PROJECTIONS["mlp"]
    return [
        getattr(getattr(layer, module), name).weight
        for layer in model.model.layers
        for module, names in PROJECTIONS.items()
        for name in names
        if name in kept
    ] + [model.lm_head.weight]


def storage_bytes(model) -> int:
    """Bytes of the distinct storages behind the parameters: a second copy of any weight would add to it."""
    storages = {parameter.untyped_storage().data_ptr(): parameter.untyped_storage().nbytes() for parameter in
                model.parameters()}  # fmt: skip
    return sum(storages.values())


@pytest.mark.parametrize("build", [tiny_llama, tied_llama], ids=["untied", "tied"])
@pytest.mark.parametrize("fuse_projections", [False, True])
def test_input_major_weights_match_row_major(build, fuse_projections, device, generator, request):
    model = build("gqa", seed_of(request), device)
    input_ids, attention_mask = random_prompts([7, 3, 5], generator, device)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    stock_tokens = model.generate(input_ids, **kwargs)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    bytes_before = storage_bytes(model)
    options = dict(backend="torch", fuse_projections=fuse_projections)
    apply_flashcore_to_llama(model, input_major_weights=False, **options)
    expected = prefill_and_decode_logits(model, input_ids, attention_mask)

    apply_flashcore_to_llama(model, input_major_weights=True, **options)

    assert flashcore_options(model)["input_major_weights"] is True
    assert all(is_input_major(weight) for weight in converted_weights(model, fuse_projections))
    if fuse_projections:
        for layer in model.model.layers:
            assert layer.self_attn._fused_projection.weight.is_contiguous()
            assert layer.mlp._fused_projection.weight.is_contiguous()
    assert model.state_dict().keys() == state.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert storage_bytes(model) == bytes_before
    if build is tied_llama:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # fp32: only the GEMMs' summation order differs.
    torch.testing.assert_close(
        prefill_and_decode_logits(model, input_ids, attention_mask), expected, rtol=1e-5, atol=1e-5
    )
    assert torch.equal(model.generate(input_ids, **kwargs), stock_tokens)

    remove_flashcore(model)
    assert all(weight.is_contiguous() for weight in converted_weights(model))
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    if build is tied_llama:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.generate(input_ids, **kwargs), stock_tokens)


def test_default_picks_fp32_on_the_cpu(device, request):
    """None converts fp32 CPU weights (faster there) and leaves CUDA and 16-bit CPU weights row-major (slower there:
    benchmarks/probes/results/cpu_weight_layout.json)."""
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), device), backend="torch")
    assert flashcore_options(model)["input_major_weights"] is None
    converted = [is_input_major(weight) for weight in converted_weights(model)]
    assert converted == [device.type == "cpu"] * len(converted)

    half = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), "cpu").to(torch.bfloat16), backend="torch")
    assert all(weight.is_contiguous() for weight in converted_weights(half))
    apply_flashcore_to_llama(half, backend="torch", input_major_weights=True)  # asked for: converted anyway
    assert all(is_input_major(weight) for weight in converted_weights(half))
    apply_flashcore_to_llama(half, backend="torch", input_major_weights=False)
    assert all(weight.is_contiguous() for weight in converted_weights(half))


def test_unfusing_keeps_input_major_weights(device, generator, request):
    """Turning fuse_projections off gives each projection its own storage, input-major again."""
    model = tiny_llama("gqa", seed_of(request), device)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=True, input_major_weights=True)
    apply_flashcore_to_llama(model, backend="torch", input_major_weights=True)
    for layer in model.model.layers:
        assert "_fused_projection" not in layer.self_attn.__dict__
        pointers = {
            getattr(layer.self_attn, name).weight.untyped_storage().data_ptr() for name in PROJECTIONS["self_attn"][:3]
        }
        assert len(pointers) == 3
    assert all(is_input_major(weight) for weight in converted_weights(model))
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("fuse_projections", [False, True])
def test_input_major_model_saves_and_reloads(fuse_projections, device, request, tmp_path):
    from transformers import LlamaForCausalLM

    model = tiny_llama("gqa", seed_of(request), device)
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=fuse_projections, input_major_weights=True)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).to(device)
    for (name, saved), (reloaded_name, loaded) in zip(
        model.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert name == reloaded_name and torch.equal(saved, loaded), name
