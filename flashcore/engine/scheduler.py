"""The engine's policy: which request takes which row, and what each running row feeds a step. Host only: nothing
here touches a tensor (the runner does), so the rules read on their own.

**Rows are conversations.** Each of the cache's rows keeps, in ``Row.tokens``, the ids its K/V hold (as many as
the row's ``seq_lens``). A request takes a row that holds a prefix of its prompt when one does (a chat client
resends the history, so a conversation's next turn lands where its previous turn left it) and only the rest of its
prompt is prefilled; ``Request.cached_tokens`` counts the reused part. Otherwise it takes an empty row, or else
evicts the least recently used idle row, keeping whatever prefix the two share. A finished or cancelled request
leaves its row at once; the row stays idle, with its tokens, for the next turn.

**A step** feeds one token per decoding row, then chunks of prompts in arrival order while ``max_num_tokens``
lasts (chunked prefill).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flashcore.engine.requests import OutputCallback, SamplingParams

Feed = tuple["Row", "Request", "list[int] | None"]
"""What one row feeds a step: its request, and the next chunk of the prompt, or None for a decoding row (the
request's pending token)."""


@dataclass(eq=False)
class Request:
    """One request's state from submission to its last output."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    on_output: OutputCallback | None
    arrival: int
    generator: object | None = None  # a torch.Generator for a seeded request
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
    """One cache row: the ids its K/V hold and the request running in it (None: idle or empty)."""

    index: int
    tokens: list[int] = field(default_factory=list)  # what the row's cache holds, in order
    request: Request | None = None
    last_used: int = 0


class Scheduler:
    """The rows and the waiting queue, and the rules above. The engine calls it under its lock."""

    def __init__(self, num_rows: int, max_num_tokens: int) -> None:
        self.rows = [Row(index) for index in range(num_rows)]
        self.waiting: deque[Request] = deque()
        self.max_num_tokens = max_num_tokens
        self.steps = 0

    def running(self) -> list[Row]:
        return [row for row in self.rows if row.request is not None]

    def can_admit(self) -> bool:
        return bool(self.waiting) and any(row.request is None for row in self.rows)

    def admit(self) -> list[tuple[Row, int]]:
        """Moves waiting requests into rows, in arrival order, while rows are free; returns each row taken and how
        many of its tokens it keeps (the caller sets the row's length in the cache)."""
        taken = []
        while self.waiting:
            row, keep = self.pick_row(self.waiting[0].prompt)
            if row is None:
                break
            request = self.waiting.popleft()
            del row.tokens[keep:]
            row.request, request.row = request, row
            request.num_computed = request.cached_tokens = keep
            taken.append((row, keep))
        return taken

    def pick_row(self, prompt: list[int]) -> tuple[Row | None, int]:
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

    def plan(self) -> list[Feed]:
        """What each running row feeds this step, by row: ``None`` for a decoding row (its request's pending token),
        else the next chunk of its prompt. Decoding rows first (one token each), then prompt chunks in arrival order
        while ``max_num_tokens`` lasts."""
        running = self.running()
        budget = self.max_num_tokens - sum(not row.request.is_prefilling for row in running)
        feeds = [(row, row.request, None) for row in running if not row.request.is_prefilling]
        for row in sorted(running, key=lambda r: r.request.arrival):
            request = row.request
            if request.is_prefilling and budget > 0:
                chunk = request.prompt[request.num_computed : request.num_computed + budget]
                feeds.append((row, request, chunk))
                budget -= len(chunk)
        return sorted(feeds, key=lambda feed: feed[0].index)

    def can_continue(self, rows: list[Row], requests: dict[int, Request]) -> bool:
        """Whether the next decode step may be launched before the last one (over ``rows``, whose requests were
        ``requests`` by row index) is read: the same rows, all still decoding, and none at its last token (a length
        stop is known ahead; only EOS and stop strings are found late)."""
        for row in rows:
            request = row.request
            if request is None or request.finish_reason is not None or request is not requests[row.index]:
                return False
            if len(request.generated) + 2 > request.params.max_tokens:
                return False
        return len(rows) == sum(row.request is not None for row in self.rows)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
