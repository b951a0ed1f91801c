"""The engine (``flashcore.engine``): continuous batching must not change what a request gets.

Greedy completions equal stock transformers' ``generate`` of the same prompt run alone, token for token, while
requests of different lengths arrive at different steps, share steps with prompt chunks, wait for rows and evict
idle ones; a conversation's next turn reuses its row; seeded sampling does not depend on the batch; cancel,
stops and bad requests behave. The reference is the same weights in an unpatched copy of the model.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import TEST_DEVICE
from hf_models import VOCAB_SIZE, IdsTokenizer, tiny_llama

from flashcore.engine import Engine, EngineError, PromptTooLongError, QueueFullError, SamplingParams
from flashcore.engine.sampling import filtered_probs
from flashcore.integrations.llama import flashcore_options

GREEDY = dict(temperature=0)


@pytest.fixture
def models(request):
    """``(stock, engine_model)``: one random tiny LLaMA and a copy for the engine to patch."""
    stock = tiny_llama("gqa", seed=request.node.name.__hash__() % 2**31, device=TEST_DEVICE)
    return stock, copy.deepcopy(stock)


def stock_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    inputs = torch.tensor([prompt], device=TEST_DEVICE)
    # Every token is real, as the engine takes it. Without a mask, generate would mask each token equal to the pad
    # id (0), which a generated token fed back in a next turn's prompt can be.
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(rng: random.Random, count: int, lengths: tuple[int, int]) -> list[list[int]]:
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(*lengths))] for _ in range(count)]


def run_staggered(engine: Engine, prompts, params, rng: random.Random) -> dict[int, list[int]]:
    """Submits the requests a few at a time between steps; returns each request's tokens by prompt index."""
    tokens: dict[int, list[int]] = {}
    finished = set()

    def on_output(index):
        def callback(output):
            tokens.setdefault(index, []).extend(output.token_ids)
            if output.finished:
                finished.add(index)

        return callback

    pending = list(range(len(prompts)))
    while pending or len(finished) < len(prompts):
        for _ in range(rng.randrange(0, 3) if pending else 0):
            if pending:
                index = pending.pop(0)
                engine.submit(prompts[index], params[index], on_output=on_output(index))
        engine.step()
    return tokens


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_staggered_requests_match_stock_greedy(models, backend):
    """12 requests over 4 rows, arriving at random steps, prompts chunked 16 tokens a step: each equals stock."""
    stock, model = models
    rng = random.Random(1)
    prompts = random_prompts(rng, 12, (2, 40))
    params = [SamplingParams(max_tokens=rng.randrange(1, 16), **GREEDY) for _ in prompts]
    engine = Engine(model, IdsTokenizer(), max_batch_size=4, max_cache_len=64, max_num_tokens=16, backend=backend)
    got = run_staggered(engine, prompts, params, rng)
    for index, prompt in enumerate(prompts):
        assert got[index] == stock_greedy(stock, prompt, params[index].max_tokens), f"request {index}"
    assert engine.stats() == {"running": 0, "waiting": 0, "free_rows": 0, "idle_rows": 4, "max_batch_size": 4}


def test_interpreter_mixed_step_matches_stock(models):
    """One short case on the Triton kernel (interpreted on the CPU): a decode row and a prompt chunk in one step."""
    stock, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=2, max_cache_len=32, max_num_tokens=8, backend="triton")
    rng = random.Random(2)
    prompts = random_prompts(rng, 2, (4, 12))
    got = {0: [], 1: []}
    engine.submit(
        prompts[0], SamplingParams(max_tokens=3, **GREEDY), on_output=lambda out: got[0].extend(out.token_ids)
    )
    engine.step()  # the first prompt alone
    engine.submit(
        prompts[1], SamplingParams(max_tokens=2, **GREEDY), on_output=lambda out: got[1].extend(out.token_ids)
    )
    while engine.has_work():
        engine.step()
    for index in (0, 1):
        assert got[index] == stock_greedy(stock, prompts[index], len(got[index]))


def test_fused_projections_and_layer_kernels_match_stock(models):
    """The engine's options of DecodeSession's: packed mixed steps (per-token RoPE positions in one [1, T] row) and
    decode steps through the fused GEMMs and flashcore's layer kernels (interpreted on the CPU) keep stock's tokens."""
    stock, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=2, max_cache_len=32, max_num_tokens=8, backend="torch",
                    fuse_projections=True, layer_kernels=True)  # fmt: skip
    assert flashcore_options(model) == {
        "backend": "auto", "layer_kernels": True, "fuse_projections": True, "onednn_linears": None
    }  # fmt: skip
    rng = random.Random(3)
    prompts = random_prompts(rng, 3, (3, 10))
    params = [SamplingParams(max_tokens=3, **GREEDY) for _ in prompts]
    got = run_staggered(engine, prompts, params, rng)
    for index, prompt in enumerate(prompts):
        assert got[index] == stock_greedy(stock, prompt, 3), f"request {index}"


def test_layer_options_default_to_on_with_cuda(models):
    """Unset, ``fuse_projections`` and ``layer_kernels`` are on for a model on CUDA and off on the CPU; False keeps
    them off anywhere."""
    _, model = models
    Engine(model, IdsTokenizer(), max_batch_size=1, max_cache_len=8, use_cuda_graph=False)
    on_cuda = model.device.type == "cuda"
    assert flashcore_options(model) == {
        "backend": "auto", "layer_kernels": on_cuda, "fuse_projections": on_cuda, "onednn_linears": None
    }  # fmt: skip
    Engine(model, IdsTokenizer(), max_batch_size=1, max_cache_len=8, use_cuda_graph=False,
           fuse_projections=False, layer_kernels=False)  # fmt: skip
    assert flashcore_options(model) == {
        "backend": "auto", "layer_kernels": False, "fuse_projections": False, "onednn_linears": None
    }  # fmt: skip


def test_next_turn_reuses_the_row(models):
    """A prompt that extends a finished request's tokens lands in its row; the tokens equal a cold run's."""
    stock, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=2, max_cache_len=96, max_num_tokens=32, backend="torch")
    rng = random.Random(3)
    first_prompt, other = random_prompts(rng, 2, (10, 20))
    first = engine.generate([first_prompt, other], SamplingParams(max_tokens=6, **GREEDY))[0]
    # The answer's last token was selected but never fed, so the row holds the prompt and all but that token.
    second_prompt = first_prompt + first.token_ids + [7, 8, 9]
    second = engine.generate([second_prompt], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert second.cached_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert second.token_ids == stock_greedy(stock, second_prompt, 5)


def test_seeded_sampling_does_not_depend_on_the_batch(models):
    _, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=4, max_cache_len=64, backend="torch")
    rng = random.Random(4)
    prompt, *others = random_prompts(rng, 4, (5, 30))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    alone = engine.generate([prompt], seeded)[0].token_ids
    crowd = [seeded, SamplingParams(max_tokens=9, temperature=0.8), SamplingParams(max_tokens=5, seed=1), seeded]
    together = engine.generate([prompt, others[0], others[1], prompt], crowd)
    assert together[0].token_ids == alone
    assert together[3].token_ids == alone
    unseeded = engine.generate([prompt] * 2, SamplingParams(max_tokens=12, temperature=1.0))
    assert unseeded[0].token_ids != alone or unseeded[1].token_ids != alone  # not everything is seeded


def test_filtered_probs_match_transformers_warpers():
    """Per-row temperature, top-k and top-p equal transformers' warpers applied row by row."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5)) * 3
    temperature, top_k, top_p = [0.7, 1.0, 1.3, 0.5], [0, 10, 3, 50], [1.0, 0.9, 0.5, 0.8]
    got = filtered_probs(
        logits, temperature=torch.tensor(temperature), top_k=torch.tensor(top_k), top_p=torch.tensor(top_p)
    )
    for row in range(4):
        scores = TemperatureLogitsWarper(temperature[row])(None, logits[row : row + 1])
        if top_k[row]:
            scores = TopKLogitsWarper(top_k[row])(None, scores)
        if top_p[row] < 1:
            scores = TopPLogitsWarper(top_p[row])(None, scores)
        torch.testing.assert_close(got[row], scores.softmax(-1)[0], rtol=1e-5, atol=1e-7)


def test_stops_and_lengths(models):
    _, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=2, max_cache_len=64, backend="torch")
    prompt = random_prompts(random.Random(6), 1, (8, 9))[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 8
    stop_id = free_run.token_ids[3]
    by_id = engine.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop_id], **GREEDY))[0]
    first = free_run.token_ids.index(stop_id)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free_run.token_ids[: first + 1]
    assert by_id.text == IdsTokenizer().decode(free_run.token_ids[:first])  # the stop token is not text
    stop_text = f"<{free_run.token_ids[2]}><{free_run.token_ids[3]}"  # ends inside a token's text
    by_text = engine.generate([prompt], SamplingParams(max_tokens=8, stop=[stop_text], **GREEDY))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == free_run.text[: free_run.text.index(stop_text)]


def test_cancel_frees_the_row_and_reports_abort(models):
    _, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=1, max_cache_len=64, backend="torch")
    outputs = []
    request_id = engine.submit([1, 2, 3], SamplingParams(max_tokens=50, **GREEDY), on_output=outputs.append)
    waiting_id = engine.submit([4, 5], SamplingParams(max_tokens=2, **GREEDY), on_output=outputs.append)
    engine.step()
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
    engine.cancel(request_id)
    engine.cancel(request_id)  # idempotent
    while engine.has_work():
        engine.step()
    reasons = {out.request_id: out.finish_reason for out in outputs if out.finished}
    assert reasons == {request_id: "abort", waiting_id: "length"}
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


def test_bad_requests_are_refused_before_queueing(models):
    _, model = models
    engine = Engine(model, IdsTokenizer(), max_batch_size=1, max_cache_len=16, max_queue=1, backend="torch")
    with pytest.raises(PromptTooLongError, match="max_cache_len=16"):
        engine.submit(list(range(1, 12)), SamplingParams(max_tokens=6))
    with pytest.raises(EngineError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(EngineError, match=r"\[0, 256\)"):
        engine.submit([VOCAB_SIZE], SamplingParams())
    for field, value in (("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("max_tokens", 0), ("stop", [""])):
        with pytest.raises(EngineError, match=field):
            SamplingParams(**{field: value})
    engine.submit([1], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError, match="max_queue=1"):
        engine.submit([1], SamplingParams(max_tokens=1))
    assert engine.stats()["waiting"] == 1
