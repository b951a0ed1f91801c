"""One rank of ``test_tensor_parallel.py``'s run, started by ``torchrun --nproc-per-node 2`` on the CPU (gloo).

Loads the test's saved model with transformers' ``tp_plan="auto"`` (each rank holds half of the heads), then writes,
from rank 0, the greedy tokens of stock ``generate``, of ``generate`` on flashcore, of a ``DecodeSession`` and of the
serving engine, with the KV heads each rank's cache held.

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py MODEL_FOLDER OUT_JSON NEW_TOKENS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hf_models import IdsTokenizer
from transformers import AutoModelForCausalLM

from flashcore.engine import Engine, SamplingParams
from flashcore.integrations.decode_session import DecodeSession
from flashcore.integrations.llama import apply_flashcore_to_llama


def main(folder: str, out_path: str, new_tokens: int) -> None:
    inputs = json.loads(Path(folder, "inputs.json").read_text())
    input_ids, attention_mask = torch.tensor(inputs["input_ids"]), torch.tensor(inputs["attention_mask"])
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        stock = model.generate(input_ids, **kwargs)
        apply_flashcore_to_llama(model, backend="torch")
        flashcore = model.generate(input_ids, **kwargs)
        session = DecodeSession(model, max_cache_len=input_ids.shape[1] + new_tokens, batch_size=input_ids.shape[0])
        tokens = [session.prefill(input_ids, attention_mask).clone()]
        tokens += [session.decode_step().clone() for _ in range(new_tokens - 1)]
        engine = engine_tokens(model, input_ids, attention_mask, new_tokens)
    result = {
        "world_size": dist.get_world_size(),
        "tp_size": model.tp_size,
        "stock": stock[:, input_ids.shape[1] :].tolist(),
        "flashcore": flashcore[:, input_ids.shape[1] :].tolist(),
        "session": torch.stack(tokens, dim=1).tolist(),
        "engine": engine,
        "cache_kv_heads": session.cache.get_kv_cache(0)[0].shape[1],
    }
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()


def engine_tokens(model, input_ids, attention_mask, new_tokens: int) -> list[list[int]]:
    """The engine's greedy tokens for each row's real tokens (a shared helper: the test runs it in one process)."""
    engine = Engine(model, IdsTokenizer(), max_batch_size=2, max_cache_len=input_ids.shape[1] + new_tokens)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [completion.token_ids for completion in engine.generate(prompts, params)]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
