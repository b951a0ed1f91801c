"""``Engine``: many requests at once on one patched HF model, by continuous batching over flashcore's cache rows.

**Rows are conversations.** The engine owns an :class:`~flashcore.engine.cache.EngineCache` of ``max_batch_size``
rows of ``max_cache_len`` tokens, and keeps on the host the token ids each row holds (``Row.tokens``, always as
long as the row's ``seq_lens``). A request is placed in a row that holds a prefix of its prompt when one does (a
chat client resends the history, so a conversation's next turn lands where its previous turn left it) and only
the rest of its prompt is prefilled; ``cached_tokens`` counts the reused part. Otherwise it takes an empty row, or
else evicts the least recently used idle row, keeping whatever prefix the two share. A finished or cancelled
request leaves at once: its row goes idle (keeping its tokens for the next turn), and the next step may use it.

**One forward per step.** Each :meth:`Engine.step` admits waiting requests into free rows, then runs one forward
over every running row: one token per decoding row, plus chunks of prompts up to ``max_num_tokens`` per step
(chunked prefill, in arrival order). A step with prompt chunks runs eagerly in the packed layout (the T real
tokens in one ``[1, T]`` batch; :mod:`flashcore.engine.cache`). A decode-only step runs ``[B, 1]`` over the rows
``[0, B)``, B the smallest bucket covering the highest running row, as one CUDA-graph replay per bucket on CUDA
(captured on a bucket's first use; rows come and go by changing buffer contents, never by re-capturing). The
host reads the selected tokens once per step: it needs them to stream text and to check stops.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from flashcore.engine.cache import EngineCache, StepLayout
from flashcore.engine.requests import (
    Completion,
    EngineError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from flashcore.engine.sampling import select_tokens
from flashcore.integrations.llama import CACHE_ARGUMENT_NAME, apply_flashcore_to_llama, flashcore_options

OutputCallback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    on_output: OutputCallback | None
    arrival: int
    generator: torch.Generator | None = None
    row: Row | None = None
    num_computed: int = 0  # prompt tokens in the row's cache
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # the last selected token, fed by the next step
    text: str = ""  # the text sent so far
    decoded: str = ""  # the text of generated[:read_offset]; more than `text` while a stop string may be starting
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


@dataclass(eq=False)
class Row:
    index: int
    tokens: list[int] = field(default_factory=list)  # what the row's cache holds, in order
    request: Request | None = None
    last_used: int = 0


class Engine:
    """Continuous batching over one LLaMA-family HF model (see the module docstring).

    Args:
        model: a loaded ``*ForCausalLM``; patched with ``apply_flashcore_to_llama`` (keeping options it already has).
        tokenizer: its tokenizer (text of the outputs, stop strings, EOS ids).
        max_batch_size: cache rows, so the most requests that run at once.
        max_cache_len: tokens per row: a request's prompt plus ``max_tokens`` must fit.
        max_queue: the most requests waiting for a row; :meth:`submit` raises ``QueueFullError`` past it.
        max_num_tokens: the most tokens one step feeds (decode rows count one each); prompts longer than what is
            left are prefilled in chunks over several steps.
        use_cuda_graph: replay decode-only steps as CUDA graphs (default: when the model is on CUDA).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for the engine's attention launches; None (default) keeps
            the backend the model was patched with (``apply_flashcore_to_llama``'s default: ``"auto"``).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_size: int = 8,
        max_cache_len: int = 2048,
        max_queue: int = 64,
        max_num_tokens: int = 512,
        use_cuda_graph: bool | None = None,
        backend: str | None = None,
    ) -> None:
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_cache_len", max_cache_len),
            ("max_queue", max_queue),
            ("max_num_tokens", max_num_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_num_tokens < max_batch_size:
            raise ValueError(
                f"max_num_tokens={max_num_tokens} must be at least max_batch_size={max_batch_size} (every running row "
                f"feeds one token per step)"
            )
        self.model = apply_flashcore_to_llama(model, **(flashcore_options(model) or {}))
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_num_tokens = max_num_tokens
        self.use_cuda_graph = self.device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs the model on CUDA, it is on {self.device}")
        self.cache = EngineCache(
            model.config,
            num_rows=max_batch_size,
            max_cache_len=max_cache_len,
            device=self.device,
            dtype=model.dtype,
            backend=backend,
        )
        self.rows = [Row(index) for index in range(max_batch_size)]
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._steps = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()
        self._decode = _DecodeBuffers(self)
        self._launched: _Launched | None = None  # a decode step whose tokens are not read yet

    # -- the API (thread-safe) --

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        on_output: OutputCallback | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request and returns its id; ``on_output`` gets its :class:`RequestOutput` s on the engine's thread.

        Raises (before anything is queued): ``PromptTooLongError`` when the prompt plus ``max_tokens`` exceeds
        ``max_cache_len``, ``QueueFullError`` when ``max_queue`` requests wait, ``EngineError`` for an empty prompt,
        ids outside the vocabulary or a duplicate ``request_id``.
        """
        params = params or SamplingParams()
        prompt = [int(token) for token in prompt_token_ids]
        vocab_size = self.model.config.vocab_size
        if not prompt:
            raise EngineError("the prompt is empty: give at least one token")
        if any(token < 0 or token >= vocab_size for token in prompt):
            raise EngineError(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary)")
        if len(prompt) + params.max_tokens > self.max_cache_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}: {len(prompt)} + "
                f"{params.max_tokens} > max_cache_len={self.max_cache_len}, the tokens one conversation can hold; "
                f"shorten the prompt or lower max_tokens"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        with self._lock:
            arrival = next(self._ids)
            if request_id is None:
                request_id = f"req-{arrival}"
            elif request_id in self._requests:
                raise EngineError(f"request_id {request_id!r} is already running or waiting")
            if len(self._waiting) >= self.max_queue:
                waiting = len(self._waiting)
                raise QueueFullError(f"{waiting} requests are waiting (max_queue={self.max_queue}); retry later")
            request = Request(request_id, prompt, params, on_output, arrival, generator)
            self._requests[request_id] = request
            self._waiting.append(request)
            self._work.notify()
        return request_id

    def cancel(self, request_id: str) -> None:
        """Ends a request (its last output says ``"abort"``); its row is free before the next step. Idempotent."""
        with self._lock:
            if request_id in self._requests:
                self._cancelled.add(request_id)
                self._work.notify()

    def stats(self) -> dict[str, int]:
        """Counts: running and waiting requests; free rows (empty) and idle rows (holding an old conversation)."""
        with self._lock:
            running = sum(row.request is not None for row in self.rows)
            idle = sum(row.request is None and bool(row.tokens) for row in self.rows)
            return {
                "running": running,
                "waiting": len(self._waiting),
                "free_rows": self.max_batch_size - running - idle,
                "idle_rows": idle,
                "max_batch_size": self.max_batch_size,
            }

    def warm_up(self) -> None:
        """Captures the decode step's CUDA graph for every bucket now (about a second), rather than on each bucket's
        first use; a server calls it before it takes requests. Nothing on the CPU."""
        if self.use_cuda_graph:
            with self._lock:
                if any(row.request for row in self.rows):
                    raise RuntimeError("warm_up() runs before the first request")
                self._decode.capture_all()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._cancelled or self._launched) or any(row.request for row in self.rows)

    def start(self) -> None:
        """Steps on a background thread while there is work, until :meth:`shutdown`."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="flashcore-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stops the background thread after its current step; running requests are aborted."""
        with self._lock:
            self._stopping = True
            self._cancelled.update(self._requests)
            self._work.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.step()  # delivers the aborts

    def generate(
        self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Offline batch: runs every prompt (token ids or text) to completion; returns them in order.

        Runs the steps on the calling thread (with no background thread started) or waits for the background thread.
        """
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params_list)} SamplingParams; give one or one each")
        done: dict[str, Completion] = {}
        ids: list[str] = []
        received: dict[str, tuple[list[int], list[str]]] = {}

        def collect(output: RequestOutput) -> None:
            token_ids, texts = received.setdefault(output.request_id, ([], []))
            token_ids += output.token_ids
            texts.append(output.text)
            if output.finished:
                done[output.request_id] = Completion(
                    output.request_id, [], token_ids, "".join(texts), output.finish_reason, output.cached_tokens
                )

        prompt_ids: dict[str, list[int]] = {}
        for prompt, request_params in zip(prompts, params_list, strict=True):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            while True:
                try:
                    ids.append(self.submit(token_ids, request_params, on_output=collect))
                    prompt_ids[ids[-1]] = list(token_ids)
                    break
                except QueueFullError:
                    self._run_until(lambda: len(self._waiting) < self.max_queue)
        self._run_until(lambda: len(done) == len(ids))
        for request_id in ids:
            done[request_id].prompt_token_ids = prompt_ids[request_id]
        return [done[request_id] for request_id in ids]

    # -- stepping --

    def step(self) -> None:
        """One scheduling round and (when any row runs) one forward; calls the outputs' callbacks.

        Decode-only steps overlap the host with the device: a step launches its forward and returns, and the next
        call reads its tokens. While nothing changes between two decode steps (no request finishes, is cancelled or
        can be admitted), the next step is launched first, fed the previous step's tokens on the device, and the
        previous step's tokens are read and processed while it runs. A request that stops on EOS or a stop string
        is found one step late: its row computed one token too many, which is dropped (the row's length on the
        host, ``Row.tokens``, never counts it, and a row's length is set anew when a request takes it).
        """
        outputs: list[tuple[Request, RequestOutput]] = []
        with self._lock:
            self._steps += 1
            cancelled, self._cancelled = self._cancelled, set()
            can_admit = bool(self._waiting) and any(row.request is None for row in self.rows)
        launched = self._launched
        if launched is not None and not cancelled and not can_admit and self._can_continue(launched):
            self._launched = self._launch_decode(launched.rows, previous=launched)
            outputs += self._complete(launched)
        else:
            if launched is not None:
                self._launched = None
                outputs += self._complete(launched)
            with self._lock:
                for request_id in cancelled:
                    request = self._requests.get(request_id)
                    if request is not None:
                        outputs.append((request, self._finish(request, "abort")))
                self._admit()
            running = [row for row in self.rows if row.request is not None]
            if running:
                feeds = self._plan(running)
                if all(chunk is None for _, _, chunk in feeds):
                    self._launched = self._launch_decode([row for row, _, _ in feeds])
                else:
                    outputs += self._complete(self._launch_packed(feeds))
        for request, output in outputs:
            if request.on_output is not None:
                request.on_output(output)

    def _run_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            if self._thread is None:
                self.step()
            else:
                time.sleep(0.001)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not (
                    self._waiting or self._cancelled or self._launched or any(row.request for row in self.rows)
                ):
                    self._work.wait()
                if self._stopping:
                    return
            self.step()

    def _admit(self) -> None:
        """Moves waiting requests into rows, in arrival order, while rows are free (called under the lock)."""
        while self._waiting:
            row, keep = self._pick_row(self._waiting[0].prompt)
            if row is None:
                return
            request = self._waiting.popleft()
            self.cache.set_row_length(row.index, keep)
            del row.tokens[keep:]
            row.request, request.row = request, row
            request.num_computed = request.cached_tokens = keep

    def _pick_row(self, prompt: list[int]) -> tuple[Row | None, int]:
        """The row for a prompt and how many of its tokens the row keeps.

        A row whose tokens the prompt starts with (the longest such), else an empty row, else the least recently
        used idle row (keeping the prefix they share). At least one prompt token is always prefilled, for its logits.
        """
        idle = [row for row in self.rows if row.request is None]
        if not idle:
            return None, 0
        limit = len(prompt) - 1
        best, best_keep = None, -1
        for row in idle:
            if row.tokens and len(row.tokens) <= len(prompt) and row.tokens == prompt[: len(row.tokens)]:
                if len(row.tokens) > best_keep:
                    best, best_keep = row, len(row.tokens)
        if best is not None:
            return best, min(best_keep, limit)
        empty = next((row for row in idle if not row.tokens), None)
        if empty is not None:
            return empty, 0
        row = min(idle, key=lambda candidate: candidate.last_used)
        return row, min(_common_prefix_len(row.tokens, prompt), limit)

    def _plan(self, running: list[Row]) -> list[tuple[Row, Request, list[int] | None]]:
        """What each running row feeds this step, by row: ``None`` for a decoding row (its request's pending token),
        else the next chunk of its prompt. Decoding rows first (one token each), then prompt chunks in arrival order
        while ``max_num_tokens`` lasts."""
        budget = self.max_num_tokens - sum(not row.request.is_prefilling for row in running)
        feeds = [(row, row.request, None) for row in running if not row.request.is_prefilling]
        for row in sorted(running, key=lambda r: r.request.arrival):
            request = row.request
            if request.is_prefilling and budget > 0:
                chunk = request.prompt[request.num_computed : request.num_computed + budget]
                feeds.append((row, request, chunk))
                budget -= len(chunk)
        return sorted(feeds, key=lambda feed: feed[0].index)

    def _can_continue(self, launched: _Launched) -> bool:
        """Whether the next step may be launched before ``launched`` is read: the same rows, all still decoding,
        and none at its last token (a length stop is known ahead; only EOS and stop strings are found late)."""
        for row in launched.rows:
            request = row.request
            if request is None or request.finish_reason is not None or request is not launched.requests[row.index]:
                return False
            if len(request.generated) + 2 > request.params.max_tokens:
                return False
        return len(launched.rows) == sum(row.request is not None for row in self.rows)

    def _launch_decode(self, rows: list[Row], previous: _Launched | None = None) -> _Launched:
        """Launches one decode step over ``rows`` (sorted by index): from the host's view of the rows, or, after
        ``previous``, from its tokens on the device (positions advance by one on the device)."""
        buffers = self._decode
        if previous is None:
            buffers.fill(rows)
        else:
            buffers.advance(previous.row_index, previous.tokens)
        logits = buffers.run(rows[-1].index + 1)
        row_index = torch.tensor([row.index for row in rows], device=self.device)
        if len(rows) != rows[-1].index + 1:
            logits = logits.index_select(0, row_index)
        requests = [row.request for row in rows]
        tokens = select_tokens(logits, [r.params for r in requests], [r.generator for r in requests], self._generator)
        host, event = buffers.to_host(tokens)
        return _Launched(
            rows=rows,
            requests={row.index: row.request for row in rows},
            feeds=[(row, row.request, None) for row in rows],
            sampling=list(zip(rows, requests, strict=True)),
            tokens=tokens,
            row_index=row_index,
            host=host,
            event=event,
        )

    def _launch_packed(self, feeds: list[tuple[Row, Request, list[int] | None]]) -> _Launched:
        """Runs a step with prompt chunks in the packed layout (eagerly); read at once by the caller."""
        num_rows = feeds[-1][0].index + 1
        chunks = [[request.pending] if chunk is None else chunk for _, request, chunk in feeds]
        width = max(map(len, chunks))
        tokens, positions, slots, keep, sampling = [], [], [], [], []
        query_lens = [0] * num_rows
        for (row, request, _), chunk in zip(feeds, chunks, strict=True):
            start = len(row.tokens)
            tokens += chunk
            positions += range(start, start + len(chunk))
            slots += range(row.index * width, row.index * width + len(chunk))
            query_lens[row.index] = len(chunk)
            if request.num_computed + len(chunk) >= len(request.prompt):  # the prompt ends here, or a decoding row
                keep.append(len(tokens) - 1)
                sampling.append((row, request))
        device = self.device
        layout = StepLayout(
            num_rows,
            torch.tensor(query_lens, dtype=torch.int32, device=device),
            token_index=torch.tensor(slots, device=device),
            max_new=width,
        )
        keep_index = torch.tensor(keep, dtype=torch.long, device=device)
        logits = self._run_model(torch.tensor([tokens], device=device), torch.tensor([positions], device=device),
                                 layout, keep_index)[0]  # fmt: skip
        selected = None
        if sampling:
            params = [request.params for _, request in sampling]
            generators = [request.generator for _, request in sampling]
            selected = select_tokens(logits, params, generators, self._generator)
        feeds = [(row, request, chunk) for (row, request, _), chunk in zip(feeds, chunks, strict=True)]
        return _Launched(rows=[], requests={}, feeds=feeds, sampling=sampling, tokens=selected, row_index=None,
                         host=selected)  # fmt: skip

    def _complete(self, launched: _Launched) -> list[tuple[Request, RequestOutput]]:
        """Reads a launched step's tokens (its one host sync) and takes them: the fed tokens join their rows, the
        selected ones their requests. Rows whose request ended since the launch are skipped."""
        if launched.event is not None:
            launched.event.synchronize()
        tokens = launched.host.tolist() if launched.host is not None else []
        for row, request, chunk in launched.feeds:
            if request.finish_reason is not None or row.request is not request:
                continue
            fed = [request.pending] if chunk is None else chunk
            row.tokens.extend(fed)
            row.last_used = self._steps
            if request.is_prefilling:
                request.num_computed += len(fed)
        outputs = []
        with self._lock:
            for (row, request), token in zip(launched.sampling, tokens, strict=True):
                if request.finish_reason is None and row.request is request:
                    outputs.append((request, self._on_token(request, token)))
        return outputs

    def _run_model(self, input_ids, position_ids, layout: StepLayout, logits_to_keep) -> torch.Tensor:
        self.cache.layout = layout
        with torch.inference_mode():
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache_position=position_ids[0],  # read by transformers < 5.24 only; flashcore's mask ignores it
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{CACHE_ARGUMENT_NAME: self.cache},
            ).logits

    # -- per request (under the lock) --

    def _on_token(self, request: Request, token: int) -> RequestOutput:
        """Takes a selected token: checks stops, updates the text; returns the request's output for this step."""
        params = request.params
        request.generated.append(token)
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif len(request.generated) >= params.max_tokens:
            reason = "length"
        request.pending = token
        if reason != "stop":  # a stop token is not text
            self._detokenize(request, final=reason is not None)
        text = request.decoded
        hold = 0
        if params.stop:
            since = max(0, len(request.text) - max(map(len, params.stop)))
            cut = min((i for i in (text.find(stop, since) for stop in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            elif reason is None:  # a stop string may be starting at the end: hold that tail back
                starts = (n for stop in params.stop for n in range(1, len(stop)) if text.endswith(stop[:n]))
                hold = max(starts, default=0)
        new_text = text[len(request.text) : len(text) - hold]
        request.text += new_text
        if reason is not None:
            return self._finish(request, reason, [token], new_text)
        return self._output(request, [token], new_text, None)

    def _detokenize(self, request: Request, final: bool) -> None:
        """Extends ``request.decoded`` with the text of its new tokens, decoding a window of a few tokens rather than
        the whole answer (vLLM's incremental detokenisation): the text of ``generated[prefix:read]`` is already in
        ``decoded``, and decoding from ``prefix`` again keeps the tokenizer's spacing of the tokens that follow. A
        character split across tokens decodes to U+FFFD and waits for the rest (unless the request ends)."""
        ids = request.generated
        prefix_text = self.tokenizer.decode(ids[request.prefix_offset : request.read_offset], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[request.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            request.decoded += text[len(prefix_text) :]
            request.prefix_offset, request.read_offset = request.read_offset, len(ids)

    def _finish(self, request: Request, reason: str, token_ids=(), text: str = "") -> RequestOutput:
        request.finish_reason = reason
        if request.row is not None:
            request.row.request = None
            request.row = None
        if request in self._waiting:
            self._waiting.remove(request)
        self._requests.pop(request.request_id, None)
        return self._output(request, list(token_ids), text, reason)

    def _output(self, request: Request, token_ids: list[int], text: str, reason: str | None) -> RequestOutput:
        return RequestOutput(
            request.request_id,
            token_ids,
            text,
            reason,
            len(request.prompt),
            len(request.generated),
            request.cached_tokens,
        )


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


@dataclass(eq=False)
class _Launched:
    """A launched step: what it fed, whose tokens it selected, and where they arrive on the host."""

    rows: list[Row]  # decode steps: the rows, by index
    requests: dict[int, Request]  # decode steps: each row's request at launch
    feeds: list[tuple[Row, Request, list[int] | None]]
    sampling: list[tuple[Row, Request]]
    tokens: torch.Tensor | None  # selected, on the device
    row_index: torch.Tensor | None  # decode steps: the rows' indices, on the device
    host: torch.Tensor | None  # the selected tokens on the host, once `event` has completed
    event: torch.cuda.Event | None = None


class _DecodeBuffers:
    """The decode step's inputs in static device buffers (tokens, positions, ``query_lens`` of every row), and on
    CUDA its graphs: one per bucket of rows (powers of two, and all rows), captured on first use or by
    :meth:`Engine.warm_up`, each after one eager warm-up with every ``query_lens`` 0 (which writes nothing). A
    step over rows ``[0, B)`` runs the smallest bucket that holds them; rows inside it that do not step have
    ``query_lens`` 0.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        rows, device = engine.max_batch_size, engine.device
        self.buckets = sorted({min(2**i, rows) for i in range(rows.bit_length() + 1)})
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.query_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.use_graphs = engine.use_cuda_graph
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Two pinned host buffers, alternating: a step's tokens land in one while the other's are being read.
        pinned = device.type == "cuda"
        self.host = [torch.empty(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.next_host = 0
        self.bucket = 0

    def fill(self, rows: list[Row]) -> None:
        """Inputs from the host: each row's pending token at its position (its length); the other rows idle."""
        self.bucket = self.bucket_for(rows[-1].index + 1)
        values = [0] * (3 * self.bucket)
        for row in rows:
            index = row.index
            values[index], values[self.bucket + index], values[2 * self.bucket + index] = (
                row.request.pending, len(row.tokens), 1
            )  # fmt: skip
        host = torch.tensor(values).view(3, self.bucket).to(self.engine.device, non_blocking=True)
        self.tokens[: self.bucket].copy_(host[0, :, None])
        self.positions[: self.bucket].copy_(host[1, :, None])
        self.query_lens[: self.bucket].copy_(host[2])

    def advance(self, row_index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Inputs from the previous decode step, on the device: its tokens, one position further."""
        self.tokens.index_copy_(0, row_index, tokens[:, None])
        self.positions[: self.bucket] += self.query_lens[: self.bucket, None]

    def bucket_for(self, rows: int) -> int:
        return next(size for size in self.buckets if size >= rows) if self.use_graphs else rows

    def run(self, rows: int) -> torch.Tensor:
        """Logits ``[rows, V]`` of the step the buffers hold (the bucket's graph replayed, or the model eagerly)."""
        if not self.use_graphs:
            layout = StepLayout(self.bucket, self.query_lens[: self.bucket])
            step = (self.tokens[: self.bucket], self.positions[: self.bucket], layout, 1)
            return self.engine._run_model(*step)[:, -1][:rows]
        if self.bucket not in self.graphs:
            self.graphs[self.bucket] = self._capture(self.bucket)
        graph, logits = self.graphs[self.bucket]
        graph.replay()
        return logits[:rows]

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Starts copying ``tokens`` to the host: the returned view holds them once the returned event (None on the
        CPU, where the copy is done on return) has completed."""
        host = self.host[self.next_host][: tokens.shape[0]]
        self.next_host ^= 1
        host.copy_(tokens, non_blocking=True)
        if tokens.device.type != "cuda":
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event

    def capture_all(self) -> None:
        for bucket in self.buckets:
            if bucket not in self.graphs:
                self.graphs[bucket] = self._capture(bucket)

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        saved = self.query_lens.clone()
        self.query_lens.zero_()
        layout = StepLayout(bucket, self.query_lens[:bucket])
        step = (self.tokens[:bucket], self.positions[:bucket], layout, 1)
        self.engine._run_model(*step)  # warm-up: compiles and autotunes; query_lens 0 writes nothing
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.engine._run_model(*step)[:, -1]
        self.query_lens.copy_(saved)
        return graph, logits
