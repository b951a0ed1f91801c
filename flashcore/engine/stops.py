"""A selected token's effect on its request: the stop checks and the text to stream.

A request stops on EOS (unless ``ignore_eos``) or one of its ``stop_token_ids`` (neither is text), at
``max_tokens``, or when its text contains one of its ``stop`` strings (the text ends before it). The text grows by
incremental detokenisation, as vLLM's does: a window of a few tokens is decoded again rather than the whole answer,
and decoding from a few tokens back keeps the tokenizer's spacing of the tokens that follow. Text that may be the
start of a stop string, or half of a character split across tokens (U+FFFD), is held back until the next token
says what it is.
"""

from __future__ import annotations

from flashcore.engine.scheduler import Request


def take_token(request: Request, token: int, tokenizer, eos_token_ids: set[int]) -> tuple[str | None, str]:
    """Appends a selected ``token`` to ``request``; returns its finish reason (None while it runs) and the new text
    to send."""
    params = request.params
    request.generated.append(token)
    request.pending = token
    reason = None
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        reason = "stop"
    elif len(request.generated) >= params.max_tokens:
        reason = "length"
    if reason != "stop":  # a stop token is not text
        _detokenize(request, tokenizer, final=reason is not None)
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
    return reason, new_text


def _detokenize(request: Request, tokenizer, final: bool) -> None:
    """Extends ``request.decoded`` with the text of its new tokens: the text of ``generated[prefix:read]`` is already
    in it, so the new text is what decoding ``generated[prefix:]`` adds (held while it ends in U+FFFD, unless
    ``final``)."""
    ids = request.generated
    prefix_text = tokenizer.decode(ids[request.prefix_offset : request.read_offset], skip_special_tokens=True)
    text = tokenizer.decode(ids[request.prefix_offset :], skip_special_tokens=True)
    if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
        request.decoded += text[len(prefix_text) :]
        request.prefix_offset, request.read_offset = request.read_offset, len(ids)
