"""Tiny random-weight HF models and left-padded prompts, shared by the tests of the HF integration.

Each model is built from a seed (:func:`seed_of` derives one from the test id) so that stock transformers and
flashcore run the same weights; the tests compare the two on one model object, before and after
``apply_flashcore_to_llama``.
"""

from __future__ import annotations

import zlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, PreTrainedModel

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


def tiny_config(config_class: type[PretrainedConfig], attention: str, **extra) -> PretrainedConfig:
    """Two layers of ``TINY_CONFIGS[attention]`` for any LLaMA-like config class, sdpa attention, no EOS (random
    weights: stopping early would leave little to compare)."""
    return config_class(
        vocab_size=VOCAB_SIZE, intermediate_size=128, num_hidden_layers=2, initializer_range=0.1,
        pad_token_id=PAD_ID, eos_token_id=None, attn_implementation="sdpa", **TINY_CONFIGS[attention], **extra,
    )  # fmt: skip


def tiny_llama(attention: str, seed: int, device) -> LlamaForCausalLM:
    config = tiny_config(LlamaConfig, attention, max_position_embeddings=512, bos_token_id=1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device).eval()


def tiny_same_attention_model(architecture: str, seed: int, device) -> PreTrainedModel:
    """A two-layer Qwen2 (q/k/v bias) or Mistral (no window) with the GQA sizes of TINY_CONFIGS."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[architecture]
    config = tiny_config(config_class, "gqa", sliding_window=None)
    torch.manual_seed(seed)
    return model_class(config).to(device).eval()


def bf16_llama(seed: int, device, head_dim: int = 64, **sizes) -> LlamaForCausalLM:
    """A random bf16 LLaMA, head dim 64 by default (on the H100 its decode steps run the Gluon kernel), for GPU
    tests."""
    config = LlamaConfig(
        head_dim=head_dim, max_position_embeddings=2048, pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=None, **sizes
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


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


class IdsTokenizer:
    """A tokenizer for random-weight models: token ids written as text, so stop strings can be tested."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{token}>" for token in ids)

    def encode(self, text: str) -> list[int]:
        return [int(part) for part in text.replace("<", " ").replace(">", " ").split()]
