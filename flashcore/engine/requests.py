"""What a request to the :class:`~flashcore.engine.engine.Engine` carries in and what it gets back.

``SamplingParams`` follows the OpenAI request fields (and vLLM's class of the same name), validated on
construction so that a bad field is refused before the request is queued. ``RequestOutput`` is one step's news
for one request: the tokens it gained, their text, and, on its last output, why it finished.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


class EngineError(ValueError):
    """A request the engine refuses as given (a client error: HTTP 400). Nothing was queued."""


class PromptTooLongError(EngineError):
    """The prompt plus ``max_tokens`` does not fit one cache row (``max_cache_len``)."""


class QueueFullError(RuntimeError):
    """``max_queue`` requests are already waiting (HTTP 429: retry later). Nothing was queued."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Args:
        max_tokens: the most new tokens (>= 1).
        temperature: 0 for greedy; otherwise logits are divided by it before top-k / top-p and sampling.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (0 < p <= 1).
        top_k: keep the ``top_k`` most likely tokens; 0 (or -1, vLLM's spelling) keeps all.
        seed: a seed for this request alone: the same seed and prompt give the same tokens whatever else runs.
        stop: strings that end the completion; the text stops before the first one that appears.
        stop_token_ids: token ids that end the completion (the tokenizer's EOS ids always do, unless
            ``ignore_eos``); the stop token is not part of the text.
        ignore_eos: keep generating through EOS (benchmarks), up to ``max_tokens``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = (
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "an int >= 0 (0 or -1 = off)"),
            ("seed", self.seed is None or _is_int(self.seed), "an int or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "token ids (ints >= 0)"),
        )
        for name, is_valid, expected in checks:
            if not is_valid:
                raise EngineError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """One step's news for one request, handed to the request's ``on_output`` callback (on the engine's thread).

    ``token_ids`` and ``text`` are new since the previous output of this request. ``finish_reason`` is set on the
    last output only: ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens`` or a full
    row) or ``"abort"`` (cancelled). The usage counts are the request's totals so far; ``cached_tokens`` is how
    many prompt tokens were already in the row it was given (a conversation's earlier turns).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


OutputCallback = Callable[[RequestOutput], None]


@dataclass
class Completion:
    """A finished request, as :meth:`Engine.generate <flashcore.engine.engine.Engine.generate>` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))
