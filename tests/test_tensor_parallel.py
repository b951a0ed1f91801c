"""Tensor parallelism through transformers (``tp_plan="auto"``), two CPU processes over gloo: each rank's
attention sees half of the heads, and its ``FlashCoreCache`` holds half of the KV heads. The greedy tokens of
``generate``, of a ``DecodeSession`` and of the serving engine on flashcore equal the single-process run's (issue
30's CPU part; ``benchmarks/bench_multi_gpu.py`` is the NCCL run on GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import seed_of
from tp_worker import engine_tokens

from flashcore.integrations.decode_session import DecodeSession
from flashcore.integrations.llama import apply_flashcore_to_llama, remove_flashcore

NEW_TOKENS = 8
WORKER = Path(__file__).with_name("tp_worker.py")


def save_tiny_llama(folder: Path, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # one per rank at tp_size 2
        head_dim=16,
        vocab_size=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # never stop early
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def test_two_rank_tensor_parallel_matches_one_process(tmp_path, generator, request):
    model = save_tiny_llama(tmp_path, seed_of(request))
    input_ids = torch.randint(3, 256, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # a left-padded row
    input_ids[attention_mask == 0] = 0
    (tmp_path / "inputs.json").write_text(
        json.dumps({"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist()})
    )
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        stock = model.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist()
        apply_flashcore_to_llama(model, backend="torch")
        flashcore = model.generate(input_ids, **kwargs)[:, input_ids.shape[1] :].tolist()
        session = DecodeSession(model, max_cache_len=input_ids.shape[1] + NEW_TOKENS, batch_size=2)
        tokens = [session.prefill(input_ids, attention_mask).clone()]
        tokens += [session.decode_step().clone() for _ in range(NEW_TOKENS - 1)]
        engine = engine_tokens(model, input_ids, attention_mask, NEW_TOKENS)
        remove_flashcore(model)
    assert flashcore == stock

    out = tmp_path / "tp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # The ranks run on the CPU over gloo. With a GPU visible, transformers would give each rank a CUDA device and
    # NCCL, and on a one-GPU host both ranks would share it (NCCL refuses); the two-GPU run is bench_multi_gpu.py.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [*command, str(WORKER), str(tmp_path), str(out), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert (ranks["world_size"], ranks["tp_size"], ranks["cache_kv_heads"]) == (2, 2, 1)
    assert ranks["stock"] == stock, "transformers' own tensor-parallel run left the single process's tokens"
    assert ranks["flashcore"] == stock
    assert ranks["session"] == torch.stack(tokens, dim=1).tolist()
    assert ranks["engine"] == engine


def test_tp_size_sets_the_kv_heads_each_rank_holds():
    from transformers import LlamaConfig

    from flashcore.integrations.cache import FlashCoreCache

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cache = FlashCoreCache(config, max_cache_len=8, max_batch_size=1, device="cpu", dtype=torch.float32, tp_size=2)
    assert cache.get_kv_cache(0)[0].shape == (1, 1, 8, 16)
    with pytest.raises(ValueError, match="tp_size must be a positive int that divides num_key_value_heads=2, got 3"):
        FlashCoreCache(config, max_cache_len=8, tp_size=3)
    unsharded = FlashCoreCache(config, max_cache_len=8)
    with pytest.raises(ValueError, match="with tp_size=<the tensor-parallel degree>"):
        unsharded.update(torch.zeros(1, 1, 3, 16), torch.zeros(1, 1, 3, 16), 0)  # a rank's half of the heads
