"""The chat's terminal: status lines on stderr, and user turns read from a terminal or a pipe.

Kept apart from ``generate.py`` (the model and the conversation); it imports the standard library only, so the chat
parses its arguments before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import sys

BLOCK_MARKER = '"""'
MULTILINE_HELP = f"A line holding only {BLOCK_MARKER} opens a multi-line message, and another one sends it"


def note(message: str) -> None:
    """A status line ([load], [stats], [reset], ...) on stderr, which keeps stdout to the conversation."""
    print(message, file=sys.stderr, flush=True)


def read_line(is_interactive: bool, prompt: str) -> str | None:
    """One line without its newline, or None at end of input. From a pipe, the prompt and the line are echoed
    so that stdout reads like a terminal session (and shows the prompt while waiting)."""
    if not is_interactive:
        print(prompt, end="", flush=True)
        line = sys.stdin.readline()
        print(line.rstrip("\n"), flush=True)
        return line.rstrip("\n") if line else None
    with contextlib.suppress(EOFError):
        return input(prompt)
    print()


def read_turns(is_interactive: bool):
    """Yields user turns: each non-empty line, or the lines between two BLOCK_MARKER lines as one turn.

    Ctrl-C at the prompt drops what is being typed (a line or an open block) and prints a hint; a second Ctrl-C
    in a row, or end of input, returns. An open block is sent at end of input.
    """
    block: list[str] | None = None
    was_interrupted = False
    while True:
        try:
            line = read_line(is_interactive, "> " if block is None else "... ")
        except KeyboardInterrupt:
            print(flush=True)
            if was_interrupted:
                return
            was_interrupted, block = True, None
            note("[interrupted] press Ctrl-C again or Ctrl-D to quit")
            continue
        was_interrupted = False
        if line is None or (block is not None and line.strip() == BLOCK_MARKER):
            if block and "\n".join(block).strip():
                yield "\n".join(block).strip()
            if line is None:
                return
            block = None
        elif line.strip() == BLOCK_MARKER:
            block = []
        elif block is not None:
            block.append(line)
        elif line.strip():
            yield line.strip()
