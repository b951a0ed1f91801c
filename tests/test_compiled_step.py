"""generate's compiled decode step on a patched model (``integrations/compiled_step.py``): ``torch.compile``'s code
captured as flashcore's CUDA graphs, against eager flashcore and stock transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import ON_GPU
from hf_models import random_prompts, seed_of, tiny_llama
from transformers import CompileConfig

from flashcore.integrations.compiled_step import CompiledStep, captures_cuda_graphs
from flashcore.integrations.llama import (
    CACHE_ARGUMENT_NAME,
    FlashCoreCache,
    apply_flashcore_to_llama,
    remove_flashcore,
)

needs_cuda_graphs = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")


@pytest.mark.parametrize(
    ("compile_kwargs", "captures"),
    [
        (CompileConfig().to_dict(), True),  # HF's default: mode "reduce-overhead"
        (dict(backend="inductor", mode="max-autotune"), True),
        (dict(backend="inductor", mode=None, options={"triton.cudagraphs": True}), True),
        (dict(backend="inductor", mode="default"), False),
        (dict(backend="inductor", mode="max-autotune-no-cudagraphs"), False),
        (dict(backend="inductor", mode=None, options={"emulate_precision_casts": True}), False),
        (dict(backend="aot_eager", mode="reduce-overhead"), False),
    ],
)
def test_captures_what_asks_for_cuda_graphs_from_inductor(compile_kwargs, captures):
    assert captures_cuda_graphs(compile_kwargs) is captures


def test_modes_lose_their_cuda_graphs_only():
    """What CompiledStep hands torch.compile: the asked mode or options, without inductor's CUDA graphs."""
    model = torch.nn.Linear(2, 2)
    for asked, mode, options in [
        ({"mode": "reduce-overhead"}, "default", None),
        ({"mode": "max-autotune"}, "max-autotune-no-cudagraphs", None),
        (
            {"mode": None, "options": {"triton.cudagraphs": True, "debug": False}},
            None,
            {"triton.cudagraphs": False, "debug": False},
        ),
    ]:
        step = CompiledStep(model, {"backend": "inductor", "fullgraph": False, **asked})
        assert (step.compile_kwargs["mode"], step.compile_kwargs.get("options")) == (mode, options)
        assert step.asked == {"backend": "inductor", "fullgraph": False, **asked}  # what get_compiled_call compares


def test_get_compiled_call_is_transformers_off_cuda_and_removed_with_the_patch(request):
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), "cpu"), backend="torch")
    assert "get_compiled_call" in model.__dict__
    assert not isinstance(model.get_compiled_call(CompileConfig()), CompiledStep)  # a CPU model: HF's torch.compile
    remove_flashcore(model)
    assert "get_compiled_call" not in model.__dict__


def _generate(model, prompts, mask, new_tokens: int, *, compiled: bool, **extra):
    cache = FlashCoreCache(model.config, max_cache_len=prompts.shape[1] + new_tokens)
    return model.generate(
        prompts, attention_mask=mask, **{CACHE_ARGUMENT_NAME: cache}, max_new_tokens=new_tokens, do_sample=False,
        disable_compile=not compiled, **extra,
    )  # fmt: skip


@pytest.mark.gpu
@needs_cuda_graphs
@torch.no_grad()
def test_generate_replays_one_graph_per_kind_of_step(generator, request):
    """HF's compiled generate on CUDA runs through a CompiledStep: eager flashcore's tokens (fp32: no near-tie can
    flip), one captured kind of step (the decode step), hidden states of their own at every step, and a new cache
    or a new apply call starts over."""
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), "cuda"), backend="triton")
    prompts, mask = random_prompts([9, 5], generator, "cuda")
    extra = dict(return_dict_in_generate=True, output_hidden_states=True)
    eager = _generate(model, prompts, mask, 12, compiled=False, **extra)
    compiled = _generate(model, prompts, mask, 12, compiled=True, **extra)
    step = model._flashcore_state.compiled_step
    assert isinstance(step, CompiledStep) and step.captured == 1
    assert torch.equal(compiled.sequences, eager.sequences)
    # Steps 3 on replay the graph: each step's hidden states must be its own, not the graph's last.
    for eager_step, compiled_step in zip(eager.hidden_states[1:], compiled.hidden_states[1:], strict=True):
        for eager_layer, compiled_layer in zip(eager_step, compiled_step, strict=True):
            torch.testing.assert_close(compiled_layer, eager_layer, rtol=1e-4, atol=1e-4)
    assert torch.equal(_generate(model, prompts, mask, 12, compiled=True), eager.sequences)
    assert step.captured == 1  # the new cache dropped the last one's graph; this call captured its own
    apply_flashcore_to_llama(model, backend="triton", fuse_projections=True)
    assert model._flashcore_state.compiled_step is None  # the fused weights are new tensors
    assert torch.equal(_generate(model, prompts, mask, 12, compiled=True), eager.sequences)
    remove_flashcore(model)


@pytest.mark.gpu
@needs_cuda_graphs
@torch.no_grad()
def test_replayed_calls_return_their_own_logits(generator, request):
    """Called directly, a CompiledStep's third call (the first replay) and fourth give the logits of an eager forward
    on a copy of the cache, and the third's survive the fourth. An argument it cannot capture names itself."""
    model = apply_flashcore_to_llama(tiny_llama("gqa", seed_of(request), "cuda"), backend="triton")
    step = model.get_compiled_call(CompileConfig())
    assert isinstance(step, CompiledStep)
    batch, vocab = 3, model.config.vocab_size
    cache = FlashCoreCache(model.config, max_cache_len=32, max_batch_size=batch, device="cuda", dtype=torch.float32)
    reference = FlashCoreCache(model.config, max_cache_len=32, max_batch_size=batch, device="cuda", dtype=torch.float32)
    prompt = torch.randint(0, vocab, (batch, 6), generator=generator, device="cpu").cuda()
    for target in (cache, reference):
        model(input_ids=prompt, **{CACHE_ARGUMENT_NAME: target}, use_cache=True)
    logits = []
    for position in range(6, 10):
        token = torch.randint(0, vocab, (batch, 1), generator=generator, device="cpu").cuda()
        positions = torch.full((batch, 1), position, device="cuda")
        inputs = dict(input_ids=token, position_ids=positions, use_cache=True)
        out = step(**inputs, **{CACHE_ARGUMENT_NAME: cache}, return_dict=True)
        expected = model(**inputs, **{CACHE_ARGUMENT_NAME: reference}).logits
        torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-4)
        logits.append((out.logits, expected))
    assert step.captured == 1
    torch.testing.assert_close(logits[2][0], logits[2][1], rtol=1e-4, atol=1e-4)  # after the fourth call
    with pytest.raises(NotImplementedError, match="input_ids is a set"):
        step(input_ids={1}, **{CACHE_ARGUMENT_NAME: cache})
    remove_flashcore(model)


def test_a_kind_of_call_is_what_its_graph_depends_on(request):
    """The key CompiledStep captures a graph under (checked on the CPU; capture needs CUDA): tensors by shape,
    stride, dtype and device, other values by type and value, the cache by identity; the tensors listed in order
    and put back in the same places."""
    from flashcore.integrations import compiled_step

    model = tiny_llama("gqa", seed_of(request), "cpu")
    caches = [FlashCoreCache(model.config, max_cache_len=8) for _ in range(2)]
    used = []

    def kind(**kwargs):
        tensors = []
        key = tuple(
            (name, compiled_step._signature(value, name, tensors, used.append)) for name, value in kwargs.items()
        )
        return key, tensors

    ids = torch.zeros(2, 1, dtype=torch.long)
    base, tensors = kind(input_ids=ids, mask={"a": ids, "b": None}, keep=1, cache=caches[0])
    assert [id(tensor) for tensor in tensors] == [id(ids), id(ids)] and used == [caches[0]]
    assert (
        kind(input_ids=torch.ones(2, 1, dtype=torch.long), mask={"a": ids, "b": None}, keep=1, cache=caches[0])[0]
        == base
    )
    for other in [
        dict(input_ids=torch.zeros(2, 2, dtype=torch.long)),  # shape
        dict(input_ids=torch.zeros(2, 1, dtype=torch.int32)),  # dtype
        dict(input_ids=torch.zeros(1, 2, dtype=torch.long).t()),  # stride
        dict(keep=True),  # a bool is not the int 1
        dict(cache=caches[1]),
    ]:
        assert kind(**{**dict(input_ids=ids, mask={"a": ids, "b": None}, keep=1, cache=caches[0]), **other})[0] != base

    replaced = [torch.full((2, 1), 7), torch.full((2, 1), 8)]
    rebuilt = compiled_step._with_tensors((ids, {"a": ids, "b": None}, 3), iter(replaced))
    assert rebuilt[0] is replaced[0] and rebuilt[1]["a"] is replaced[1] and rebuilt[1]["b"] is None and rebuilt[2] == 3
    outputs = {"logits": replaced[0], "cache": caches[0], "hidden_states": (replaced[1],)}
    own = compiled_step._own_tensors(outputs)
    assert own["cache"] is caches[0] and torch.equal(own["logits"], replaced[0])
    assert own["logits"].data_ptr() != replaced[0].data_ptr()
    assert own["hidden_states"][0].data_ptr() != replaced[1].data_ptr()
