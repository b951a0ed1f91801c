"""``Engine``: many requests at once on one patched HF model, by continuous batching over flashcore's cache rows.

The engine is the API and the loop; its parts are one concept each, as in nano-vllm:

- :mod:`flashcore.engine.scheduler`: which request takes which row (a conversation's next turn lands in the row
  that holds its history) and what each running row feeds a step; host only;
- :mod:`flashcore.engine.runner`: runs a planned step on the model (packed layout for prompt chunks, graph-replayed
  decode buckets) and selects the next tokens (:mod:`flashcore.engine.sampling`);
- :mod:`flashcore.engine.stops`: a selected token's effect on its request (stops, streamed text);
- :mod:`flashcore.engine.cache`: the rows as a ``FlashCoreCache`` and the step's layout in it.

:meth:`Engine.step` is one scheduling round and at most one forward; :meth:`Engine.start` runs steps on a
background thread, and :meth:`Engine.submit` / :meth:`Engine.cancel` are safe from any thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

import torch

from flashcore.engine.cache import EngineCache
from flashcore.engine.requests import (
    Completion,
    EngineError,
    OutputCallback,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from flashcore.engine.runner import LaunchedStep, ModelRunner
from flashcore.engine.scheduler import Request, Scheduler
from flashcore.engine.stops import take_token
from flashcore.integrations.llama import (
    apply_flashcore_to_llama,
    flashcore_options,
    model_layer_devices,
    model_tp_size,
)


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
        fuse_projections, layer_kernels: ``apply_flashcore_to_llama``'s options of those names, set on the model (in
            place), as :class:`~flashcore.integrations.decode_session.DecodeSession` takes them: one GEMM each for
            q/k/v and gate/up; the norms, RoPE and SiLU-and-mul on flashcore's Triton kernels (on the CPU they run in
            Triton's interpreter). None (default) turns them on for a model on one CUDA device without tensor
            parallelism, where they make a 64-row decode step 1.5x faster (``benchmarks/NOTES.md``, entry 45), and
            otherwise keeps what the model has (off if it is not patched). Pass False to keep them off.
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
        fuse_projections: bool | None = None,
        layer_kernels: bool | None = None,
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
        self.device = next(model.parameters()).device
        options = flashcore_options(model) or {}
        on_by_default = self.device.type == "cuda" and model_tp_size(model) == 1
        for name, value in (("fuse_projections", fuse_projections), ("layer_kernels", layer_kernels)):
            if value is None and on_by_default:
                value = True
            if value is not None:
                options[name] = value
        self.model = apply_flashcore_to_llama(model, **options)
        self.tokenizer = tokenizer
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_num_tokens = max_num_tokens
        self.use_cuda_graph = self.device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs the model on CUDA, it is on {self.device}")
        layer_devices = sorted({str(device) for device in model_layer_devices(model)})
        if layer_devices != [str(self.device)]:
            raise NotImplementedError(
                f"the engine runs a model on one device (or one per tensor-parallel rank), but device_map spread this "
                f"one over {layer_devices}: load it on one device, or with tp_plan='auto' under torchrun"
            )
        cache = EngineCache(
            model.config,
            num_rows=max_batch_size,
            max_cache_len=max_cache_len,
            device=self.device,
            dtype=model.dtype,
            backend=backend,
            tp_size=model_tp_size(model),
        )
        self.runner = ModelRunner(self.model, cache, num_rows=max_batch_size, use_cuda_graph=self.use_cuda_graph)
        self.scheduler = Scheduler(max_batch_size, max_num_tokens)
        self.rows = self.scheduler.rows
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._requests: dict[str, Request] = {}  # submitted and not finished
        self._cancelled: set[str] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._launched: LaunchedStep | None = None  # a decode step whose tokens are not read yet

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
            if len(self.scheduler.waiting) >= self.max_queue:
                waiting = len(self.scheduler.waiting)
                raise QueueFullError(f"{waiting} requests are waiting (max_queue={self.max_queue}); retry later")
            request = Request(request_id, prompt, params, on_output, arrival, generator)
            self._requests[request_id] = request
            self.scheduler.waiting.append(request)
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
                "waiting": len(self.scheduler.waiting),
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
                self.runner.decode.capture_all()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.scheduler.waiting or self._cancelled or self._launched) or any(
                row.request for row in self.rows
            )

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
                    self._run_until(lambda: len(self.scheduler.waiting) < self.max_queue)
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
        scheduler, runner = self.scheduler, self.runner
        with self._lock:
            scheduler.steps += 1
            cancelled, self._cancelled = self._cancelled, set()
            can_admit = scheduler.can_admit()
        launched = self._launched
        if (
            launched is not None
            and not cancelled
            and not can_admit
            and scheduler.can_continue(launched.rows, launched.requests)
        ):
            self._launched = runner.launch_decode(launched.rows, previous=launched)
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
                for row, keep in scheduler.admit():
                    runner.cache.set_row_length(row.index, keep)
            feeds = scheduler.plan()
            if feeds and all(chunk is None for _, _, chunk in feeds):
                self._launched = runner.launch_decode([row for row, _, _ in feeds])
            elif feeds:
                outputs += self._complete(runner.launch_packed(feeds))
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
                    self.scheduler.waiting or self._cancelled or self._launched or any(row.request for row in self.rows)
                ):
                    self._work.wait()
                if self._stopping:
                    return
            self.step()

    def _complete(self, launched: LaunchedStep) -> list[tuple[Request, RequestOutput]]:
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
            row.last_used = self.scheduler.steps
            if request.is_prefilling:
                request.num_computed += len(fed)
        outputs = []
        with self._lock:
            for (row, request), token in zip(launched.sampling, tokens, strict=True):
                if request.finish_reason is None and row.request is request:
                    outputs.append((request, self._take(request, token)))
        return outputs

    # -- per request (under the lock) --

    def _take(self, request: Request, token: int) -> RequestOutput:
        """A selected token's output: :func:`~flashcore.engine.stops.take_token`, and the end of the request if it
        stops there."""
        reason, text = take_token(request, token, self.tokenizer, self.eos_token_ids)
        if reason is not None:
            return self._finish(request, reason, [token], text)
        return self._output(request, [token], text, None)

    def _finish(self, request: Request, reason: str, token_ids=(), text: str = "") -> RequestOutput:
        request.finish_reason = reason
        if request.row is not None:
            request.row.request = None
            request.row = None
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
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


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids
