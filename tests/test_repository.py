"""The README's two commands and CI stay in step."""

import os
import pathlib
import re

import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = text.index("```bash")
    assert text[:first_block].count("\n") <= 2  # only the title above the commands
    commands = _readme_commands()
    assert len(commands) == 2
    assert "examples/logistic_regression.py" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines()


def test_the_default_step_alone_compiles_with_the_legacy_emitters(request):
    """``tests/conftest.py`` gives XLA:CPU its earlier emitters in the default
    step only (``addopts``' mark expression): the other steps compile as users
    do. Fails if the flag were set in another step, missing in the default
    one (on the jaxlib releases it was checked with), or the default
    expression drifted from ``pyproject.toml``."""
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert f"-m '{conftest.DEFAULT_STEP_MARKEXPR}'" in addopts
    for expr in ("slow", "examples", "x64 and not slow and not examples", "manual", ""):
        assert not conftest.default_step_codegen(expr, {})
    checked_jaxlib = conftest._jaxlib_release() <= conftest.LEGACY_EMITTERS_JAXLIB
    assert conftest.default_step_codegen(conftest.DEFAULT_STEP_MARKEXPR, {}) == checked_jaxlib
    assert not conftest.default_step_codegen(conftest.DEFAULT_STEP_MARKEXPR, {"D3P_TEST_LEGACY_EMITTERS": "0"})
    in_effect = conftest.LEGACY_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "").split()
    assert in_effect == conftest.default_step_codegen(request.config.option.markexpr)
