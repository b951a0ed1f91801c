"""The OpenAI-compatible HTTP app over one :class:`~flashcore.engine.Engine`: routes, the engine bridge, errors.

Each request is tokenised here, on the event loop, and submitted to the engine, whose thread calls the request's
``on_output`` once per step in which it gained tokens; ``OutputStream`` carries those calls into asyncio with
``loop.call_soon_threadsafe``. A streamed answer leaves as server-sent events (``data: {chunk}`` lines, then
``data: [DONE]``); a plain one is assembled from the same outputs. Whatever way a handler ends (the last token, a
client that hung up, a server shutting down), ``OutputStream.close`` cancels the request, so no row outlives its
client. Every error leaves as OpenAI's JSON error body (:func:`~flashcore.serve.access.error_json`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from flashcore.engine.requests import EngineError, PromptTooLongError, QueueFullError, RequestOutput, SamplingParams
from flashcore.serve.access import LimitRequestBody, RequireApiKey, error_json
from flashcore.serve.protocol import (
    UNSUPPORTED_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingFields,
    TextCompletion,
    Usage,
)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up before the answer; nobody reads it
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# pydantic names the branch of a union that failed in an error's location ("str", "list[TextPart]"): not a field
_UNION_BRANCHES = {
    "str",
    "int",
    "float",
    "bool",
}  # OpenAI's default for /v1/completions; chat defaults to the row's room


class APIError(Exception):
    """An error the client caused (or a full queue), sent as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_json(message, "invalid_request_error" if status != 429 else "rate_limit_error", param, code)


class OutputStream:
    """One request's outputs, carried from the engine's thread into the event loop, in order."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.request_id: str | None = None
        self.is_finished = False

    def push(self, output: RequestOutput) -> None:
        """``on_output``: runs on the engine's thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the loop has closed (server shutdown): nobody is left to read the output
            pass

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.is_finished:
            output = await self.queue.get()
            self.is_finished = output.finished
            yield output

    def close(self) -> None:
        """Frees the request's row now unless it has finished; idempotent, as ``Engine.cancel`` is."""
        if self.request_id is not None and not self.is_finished:
            self.engine.cancel(self.request_id)


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however it ends, a client disconnect included."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def build_app(
    engine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving ``engine``'s model as ``model_name``; it starts the engine on startup and shuts
    it down on exit. With ``api_key``, every route under ``/v1`` needs ``Authorization: Bearer <api_key>``."""
    created = int(time.time())
    tokenizer = engine.tokenizer
    vocab_size = len(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="flashcore", lifespan=lifespan)
    app.add_middleware(LimitRequestBody, max_request_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error_body(error), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = HTTP_ERROR_CODES.get(error.status_code, str(error.status_code))
        body = error_json(str(error.detail), "invalid_request_error", code=code)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def on_server_error(request: Request, error: Exception) -> JSONResponse:
        body = error_json(f"internal error: {type(error).__name__}: {error}", "server_error")
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **engine.stats()}

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=created, max_model_len=engine.max_cache_len)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        check_model(model)
        return model_card().model_dump()

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            message = f"the model '{model}' does not exist; this server serves '{model_name}'"
            raise APIError(404, message, param="model", code="model_not_found")

    def submit(body: SamplingFields, prompt_ids: list[int], default_max_tokens: int, request_id: str) -> OutputStream:
        params = sampling_params(body, default_max_tokens, engine.max_cache_len)
        stream = OutputStream(engine, asyncio.get_running_loop())
        try:
            stream.request_id = engine.submit(prompt_ids, params, on_output=stream.push, request_id=request_id)
        except PromptTooLongError as error:
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise APIError(400, str(error), param=param, code="context_length_exceeded") from None
        except QueueFullError as error:
            raise APIError(429, f"the server is busy, retry later: {error}", code="queue_full") from None
        except EngineError as error:
            raise APIError(400, str(error)) from None
        return stream

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        prompt_ids = render_chat(tokenizer, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = submit(body, prompt_ids, engine.max_cache_len - len(prompt_ids), request_id)
        chunk = ChatCompletionChunk(id=request_id, created=int(time.time()), model=model_name, choices=[])
        shown_ids = prompt_ids if body.return_token_ids else None
        if body.stream:
            return _ClosingStreamingResponse(chat_events(stream, body, chunk, shown_ids), stream.close)
        answer = await collect(stream, request)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, token_ids, last = answer
        choice = ChatChoice(
            message=AssistantMessage(content=text),
            finish_reason=last.finish_reason,
            token_ids=token_ids if body.return_token_ids else None,
        )
        response = ChatCompletion(
            id=request_id,
            created=chunk.created,
            model=model_name,
            choices=[choice],
            usage=usage(last),
            prompt_token_ids=shown_ids,
        )
        return response.model_dump(exclude_none=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompt_ids = tokenize_prompt(tokenizer, body.prompt, vocab_size)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = submit(body, prompt_ids, COMPLETIONS_DEFAULT_MAX_TOKENS, request_id)
        completion = TextCompletion(id=request_id, created=int(time.time()), model=model_name, choices=[])
        shown_ids = prompt_ids if body.return_token_ids else None
        if body.stream:
            return _ClosingStreamingResponse(completion_events(stream, body, completion, shown_ids), stream.close)
        answer = await collect(stream, request)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        text, token_ids, last = answer
        choice = CompletionChoice(
            text=text, finish_reason=last.finish_reason, token_ids=token_ids if body.return_token_ids else None
        )
        update = {"choices": [choice], "usage": usage(last), "prompt_token_ids": shown_ids}
        response = completion.model_copy(update=update)
        return response.model_dump(exclude_none=True)

    return app


def sampling_params(body: SamplingFields, default_max_tokens: int, max_cache_len: int) -> SamplingParams:
    """The engine's ``SamplingParams`` for a request; refuses what flashcore does not implement (400)."""
    for name, off_values in UNSUPPORTED_FIELDS.items():
        value = (body.model_extra or {}).get(name, getattr(body, name, None))
        if value not in off_values:
            raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name)
    if body.n not in (None, 1):
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", param="n")
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, default_max_tokens)
    if max_tokens > max_cache_len:
        message = f"max_tokens must be at most the server's max_cache_len ({max_cache_len}), got {max_tokens}"
        raise APIError(400, message, param="max_tokens")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=() if body.stop is None else body.stop,
            stop_token_ids=body.stop_token_ids or (),
            ignore_eos=body.ignore_eos,
        )
    except EngineError as error:
        raise APIError(400, str(error)) from None


def render_chat(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the messages through the tokenizer's chat template, with the generation prompt."""
    # OpenAI's "developer" messages are what chat templates call "system".
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001  (jinja templates raise their own errors on messages they refuse)
        raise APIError(400, f"the model's chat template refused the messages: {error}", param="messages") from None
    # The template already wrote the special tokens (BOS, role markers): the tokenizer must not add them again.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_prompt(tokenizer, prompt: str | list, vocab_size: int) -> list[int]:
    """A completions prompt's token ids: a string through the tokenizer, or token ids as given (checked)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt must be one prompt, got a batch of {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt)["input_ids"]
    else:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            message = f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}"
            raise APIError(400, message, param="prompt")
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise APIError(400, "prompt must hold at least one token", param="prompt")
    return prompt_ids


async def collect(stream: OutputStream, request: Request) -> tuple[str, list[int], RequestOutput] | None:
    """A whole answer: ``(text, token ids, last output)``, or None if the client hung up (which cancels it)."""
    parts: list[str] = []
    token_ids: list[int] = []

    async def gather() -> RequestOutput:
        async for output in stream:
            parts.append(output.text)
            token_ids.extend(output.token_ids)
        return output

    answer = asyncio.ensure_future(gather())
    hang_up = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({answer, hang_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hang_up.cancel()
        if not answer.done():
            answer.cancel()
        stream.close()
    if not answer.done() or answer.cancelled():
        return None
    return "".join(parts), token_ids, answer.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(output: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        total_tokens=output.prompt_tokens + output.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.cached_tokens),
    )


def _event(model) -> str:
    return f"data: {json.dumps(model.model_dump(exclude_none=True))}\n\n"


async def chat_events(
    stream: OutputStream, body: ChatCompletionRequest, chunk: ChatCompletionChunk, prompt_ids: list[int] | None
) -> AsyncIterator[str]:
    """SSE of a chat answer: the role, the content as it grows, the finish reason, maybe usage, then [DONE]."""
    role = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
    yield _event(chunk.model_copy(update={"choices": [role], "prompt_token_ids": prompt_ids}))
    async for output in stream:
        if output.text or output.token_ids:
            choice = ChatChunkChoice(
                delta=ChatDelta(content=output.text), token_ids=output.token_ids if body.return_token_ids else None
            )
            yield _event(chunk.model_copy(update={"choices": [choice]}))
        if output.finished:
            finish = ChatChunkChoice(delta=ChatDelta(), finish_reason=output.finish_reason)
            yield _event(chunk.model_copy(update={"choices": [finish]}))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _event(chunk.model_copy(update={"usage": usage(output)}))
    yield "data: [DONE]\n\n"


async def completion_events(
    stream: OutputStream, body: CompletionRequest, completion: TextCompletion, prompt_ids: list[int] | None
) -> AsyncIterator[str]:
    """SSE of a completion: the text as it grows (the last chunk has the finish reason), maybe usage, [DONE]."""
    is_first = True
    async for output in stream:
        choice = CompletionChoice(
            text=output.text,
            finish_reason=output.finish_reason,
            token_ids=output.token_ids if body.return_token_ids else None,
        )
        update = {"choices": [choice], "prompt_token_ids": prompt_ids if is_first else None}
        is_first = False
        yield _event(completion.model_copy(update=update))
        if output.finished and body.stream_options is not None and body.stream_options.include_usage:
            yield _event(completion.model_copy(update={"usage": usage(output)}))
    yield "data: [DONE]\n\n"


def _validation_error_body(error: RequestValidationError) -> dict:
    """A 400 body for a request FastAPI could not parse or validate, naming the first bad field as ``param``."""
    errors = error.errors()
    if errors and errors[0]["type"] == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "")
        return error_json(f"the request body is not valid JSON: {reason}", "invalid_request_error")

    def field_path(loc) -> str:
        parts = (str(part) for part in loc if part != "body")
        return ".".join(part for part in parts if part not in _UNION_BRANCHES and "[" not in part)

    described = [f"{field_path(item['loc']) or 'body'}: {item['msg']}" for item in errors]
    param = field_path(errors[0]["loc"]) if errors else ""
    return error_json("; ".join(described), "invalid_request_error", param=param or None)
