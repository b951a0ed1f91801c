"""Runs the steps the scheduler plans, on the model: no policy here (:mod:`flashcore.engine.scheduler` decides).

A step with prompt chunks runs eagerly in the packed layout: every row's new tokens in one ``[1, T]`` batch, whose
attention :class:`~flashcore.engine.cache.EngineCache` scatters to rows and runs as one launch of the mixed-row
kernel. A decode-only step runs ``[B, 1]`` over the rows ``[0, B)`` from static buffers (:class:`DecodeBuffers`),
on CUDA as the replay of the graph captured for the smallest bucket that holds B; the next step can be fed from the
device (the previous step's tokens, positions one further), which lets the engine launch it before it reads the
previous tokens. Each launch ends with the selection of the next tokens (:mod:`flashcore.engine.sampling`) and
their copy to the host, which the engine reads when it completes the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashcore.backends import captured_graph, kernels_as_captured
from flashcore.engine.cache import EngineCache, StepLayout
from flashcore.engine.sampling import select_tokens, to_device
from flashcore.engine.scheduler import Feed, Request, Row
from flashcore.integrations.llama import CACHE_ARGUMENT_NAME


@dataclass(eq=False)
class LaunchedStep:
    """A launched step: what it fed, whose tokens it selected, and where they arrive on the host."""

    rows: list[Row]  # decode steps: the rows, by index
    requests: dict[int, Request]  # decode steps: each row's request at launch
    feeds: list[tuple[Row, Request, list[int] | None]]
    sampling: list[tuple[Row, Request]]
    tokens: torch.Tensor | None  # selected, on the device
    row_index: torch.Tensor | None  # decode steps: the rows' indices, on the device
    host: torch.Tensor | None  # the selected tokens on the host, once `event` has completed
    event: torch.cuda.Event | None = None


class ModelRunner:
    """The model, its :class:`EngineCache`, the decode buffers and graphs, and the engine's sampling generator."""

    def __init__(self, model, cache: EngineCache, *, num_rows: int, use_cuda_graph: bool) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.use_cuda_graph = use_cuda_graph
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.decode = DecodeBuffers(self, num_rows)

    def launch_decode(self, rows: list[Row], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Launches one decode step over ``rows`` (sorted by index): from the host's view of the rows, or, after
        ``previous``, from its tokens on the device (positions advance by one on the device)."""
        buffers = self.decode
        if previous is None:
            buffers.fill(rows)
        else:
            buffers.advance(previous.row_index, previous.tokens)
        span = rows[-1].index - buffers.first_row + 1
        logits = buffers.run(span)
        if previous is not None:
            row_index = previous.row_index  # the same rows
        else:
            row_index = to_device([row.index - buffers.first_row for row in rows], torch.long, self.device)
        if len(rows) != span:
            logits = logits.index_select(0, row_index)
        requests = [row.request for row in rows]
        tokens = select_tokens(logits, [r.params for r in requests], [r.generator for r in requests], self.generator)
        host, event = buffers.to_host(tokens)
        return LaunchedStep(
            rows=rows,
            requests={row.index: row.request for row in rows},
            feeds=[(row, row.request, None) for row in rows],
            sampling=list(zip(rows, requests, strict=True)),
            tokens=tokens,
            row_index=row_index,
            host=host,
            event=event,
        )

    def launch_packed(self, feeds: list[Feed]) -> LaunchedStep:
        """Runs a step with prompt chunks in the packed layout (eagerly); read at once by the caller."""
        first_row = feeds[0][0].index  # rows below it do not step: the launch leaves them out
        num_rows = feeds[-1][0].index + 1 - first_row
        chunks = [[request.pending] if chunk is None else chunk for _, request, chunk in feeds]
        width = max(map(len, chunks))
        tokens, positions, slots, keep, sampling = [], [], [], [], []
        query_lens = [0] * num_rows
        for (row, request, _), chunk in zip(feeds, chunks, strict=True):
            start = len(row.tokens)
            tokens += chunk
            positions += range(start, start + len(chunk))
            slot = (row.index - first_row) * width
            slots += range(slot, slot + len(chunk))
            query_lens[row.index - first_row] = len(chunk)
            if request.num_computed + len(chunk) >= len(request.prompt):  # the prompt ends here, or a decoding row
                keep.append(len(tokens) - 1)
                sampling.append((row, request))
        device = self.device
        layout = StepLayout(
            num_rows,
            torch.tensor(query_lens, dtype=torch.int32, device=device),
            token_index=torch.tensor(slots, device=device),
            max_new=width,
            first_row=first_row,
        )
        keep_index = torch.tensor(keep, dtype=torch.long, device=device)
        logits = self.run_model(torch.tensor([tokens], device=device), torch.tensor([positions], device=device),
                                 layout, keep_index)[0]  # fmt: skip
        selected = None
        if sampling:
            params = [request.params for _, request in sampling]
            generators = [request.generator for _, request in sampling]
            selected = select_tokens(logits, params, generators, self.generator)
        feeds = [(row, request, chunk) for (row, request, _), chunk in zip(feeds, chunks, strict=True)]
        return LaunchedStep(rows=[], requests={}, feeds=feeds, sampling=sampling, tokens=selected, row_index=None,
                         host=selected)  # fmt: skip

    def run_model(self, input_ids, position_ids, layout: StepLayout, logits_to_keep) -> torch.Tensor:
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


class DecodeBuffers:
    """The decode step's inputs in static device buffers (tokens, positions, ``query_lens`` of every row), and on
    CUDA its graphs: one per bucket of rows (powers of two, and all rows), captured on first use or by
    ``Engine.warm_up``, each after one eager warm-up with every ``query_lens`` 0 (which writes nothing). A step over
    rows ``[0, B)`` runs the smallest bucket that holds them; rows inside it that do not step have ``query_lens``
    0."""

    def __init__(self, runner: ModelRunner, rows: int) -> None:
        self.runner = runner
        device = runner.device
        self.buckets = sorted({min(2**i, rows) for i in range(rows.bit_length() + 1)})
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.query_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.use_graphs = runner.use_cuda_graph
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Two pinned host buffers, alternating: a step's tokens land in one while the other's are being read.
        pinned = device.type == "cuda"
        self.host = [torch.empty(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.next_host = 0
        self.bucket = 0
        self.first_row = 0

    def fill(self, rows: list[Row]) -> None:
        """Inputs from the host: each row's pending token at its position (its length); the other rows idle."""
        # Graphs run rows [0, bucket); an eager step starts at its lowest row (a lone request in row 5 runs one row).
        self.first_row = 0 if self.use_graphs else rows[0].index
        self.bucket = self.bucket_for(rows[-1].index + 1 - self.first_row)
        values = [0] * (3 * self.bucket)
        for row in rows:
            index = row.index - self.first_row
            values[index], values[self.bucket + index], values[2 * self.bucket + index] = (
                row.request.pending, len(row.tokens), 1
            )  # fmt: skip
        host = to_device(values, torch.long, self.runner.device).view(3, self.bucket)
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
            layout = StepLayout(self.bucket, self.query_lens[: self.bucket], first_row=self.first_row)
            step = (self.tokens[: self.bucket], self.positions[: self.bucket], layout, 1)
            return self.runner.run_model(*step)[:, -1][:rows]
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
        with kernels_as_captured():  # warm-up: compiles what the capture replays; query_lens 0 writes nothing
            self.runner.run_model(*step)
        with captured_graph(pool=self.pool) as graph:
            logits = self.runner.run_model(*step)[:, -1]
        self.query_lens.copy_(saved)
        return graph, logits
