"""``apply_flashcore_to_llama(fuse_projections=True)``: one GEMM for q/k/v and one for gate/up must give the unfused
model's logits and greedy tokens, add no memory, and be undone by ``fuse_projections=False`` and ``remove_flashcore``.

The reference is the same model object before fusing, run through flashcore (so only the projections differ),
and stock ``generate`` before ``apply_flashcore_to_llama``.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import PAD_ID, random_prompts, seed_of, tiny_llama, tiny_same_attention_model

from flashcore.integrations.cache import FlashCoreCache
from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, apply_flashcore_to_llama, remove_flashcore

FUSED = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def tiny_qwen2(seed: int, device):
    """Qwen2: the q/k/v projections have a bias, which is fused too."""
    model = tiny_same_attention_model("qwen2", seed, device)
    with torch.no_grad():  # Qwen2 initialises biases to zero; random ones make the fused bias matter
        for layer in model.model.layers:
            for name in FUSED["self_attn"]:
                getattr(layer.self_attn, name).bias.normal_(std=0.1)
    return model


def build(architecture: str, seed: int, device):
    return tiny_qwen2(seed, device) if architecture == "qwen2" else tiny_llama(architecture, seed, device)


def weight_bytes(model) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


@torch.no_grad()
def prefill_and_decode_logits(model, input_ids, attention_mask, steps: int = 3) -> torch.Tensor:
    """Logits of a left-padded prefill and a few greedy decode steps through one FlashCoreCache."""
    cache = FlashCoreCache(model.config, max_cache_len=input_ids.shape[1] + steps)
    out = model(input_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT_NAME: cache}, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        next_ids = logits[-1].argmax(dim=-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_ids)], dim=1)
        out = model(next_ids, attention_mask=attention_mask, **{CACHE_ARGUMENT_NAME: cache}, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("architecture", ["gqa", "mha", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_model_matches_unfused(architecture, backend, device, generator, request):
    model = build(architecture, seed_of(request), device)
    input_ids, attention_mask = random_prompts([7, 3, 5], generator, device)
    stock_tokens = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID
    )
    apply_flashcore_to_llama(model, backend=backend)
    expected = prefill_and_decode_logits(model, input_ids, attention_mask)
    bytes_before = weight_bytes(model)

    apply_flashcore_to_llama(model, backend=backend, fuse_projections=True)
    apply_flashcore_to_llama(model, backend=backend, fuse_projections=True)  # idempotent

    assert weight_bytes(model) == bytes_before
    for layer in model.model.layers:
        for module_name, names in FUSED.items():
            module = getattr(layer, module_name)
            fused = module._fused_projection.weight
            # The HF parameters are views of the concatenated weight: no second copy exists.
            assert [getattr(module, name).weight.data_ptr() for name in names][0] == fused.data_ptr()
            assert fused.shape[0] == sum(getattr(module, name).out_features for name in names)
    # fp32: only the GEMMs' summation order differs (one GEMM of 3 outputs vs three of one).
    torch.testing.assert_close(
        prefill_and_decode_logits(model, input_ids, attention_mask), expected, rtol=1e-5, atol=1e-5
    )
    tokens = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID
    )
    assert torch.equal(tokens, stock_tokens)


def test_unfuse_gives_each_projection_its_storage_back(device, generator, request):
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), device), backend="torch")
    input_ids, attention_mask = random_prompts([6, 4], generator, device)
    expected = prefill_and_decode_logits(model, input_ids, attention_mask)
    original = {name: parameter.clone() for name, parameter in model.named_parameters()}

    apply_flashcore_to_llama(apply_flashcore_to_llama(model, backend="torch", fuse_projections=True), backend="torch")

    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, original[name]), name
    for layer in model.model.layers:
        for module_name, names in FUSED.items():
            module = getattr(layer, module_name)
            assert "forward" not in module.__dict__ and "_fused_projection" not in module.__dict__
            pointers = [getattr(module, name).weight.untyped_storage().data_ptr() for name in names]
            assert len(set(pointers)) == len(names)
    torch.testing.assert_close(prefill_and_decode_logits(model, input_ids, attention_mask), expected)


def test_remove_flashcore_also_unfuses(device, generator, request):
    """The fused forward calls flashcore's attention directly, so removing flashcore must remove it too."""
    model = tiny_llama("gqa", seed_of(request), device)
    input_ids, attention_mask = random_prompts([6, 4], generator, device)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD_ID)
    expected = model.generate(input_ids, **kwargs)

    remove_flashcore(apply_flashcore_to_llama(model, backend="torch", fuse_projections=True))

    for layer in model.model.layers:
        assert "forward" not in layer.self_attn.__dict__ and "forward" not in layer.mlp.__dict__
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model.generate(input_ids, **kwargs), expected)


def test_fused_model_saves_and_reloads(device, request, tmp_path):
    """The HF parameters are views of the fused weight; save_pretrained must still write each of them."""
    from transformers import LlamaForCausalLM

    model = tiny_llama("gqa", seed_of(request), device)
    apply_flashcore_to_llama(model, backend="torch", fuse_projections=True)
    model.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).to(device)
    for (name, saved), (reloaded_name, loaded) in zip(
        model.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert name == reloaded_name and torch.equal(saved, loaded), name


def test_fuse_refuses_mixed_biases_before_changing_anything(device, request):
    model = tiny_llama("gqa", seed_of(request), device)
    layer = model.model.layers[-1].self_attn
    layer.k_proj.bias = torch.nn.Parameter(torch.zeros(layer.k_proj.out_features, device=device))
    with pytest.raises(NotImplementedError, match="bias"):
        apply_flashcore_to_llama(model, backend="torch", fuse_projections=True)
    assert "_flashcore_state" not in model.__dict__
    assert all("_fused_projection" not in layer.self_attn.__dict__ for layer in model.model.layers)
