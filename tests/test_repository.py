"""The README's two commands and CI stay in step."""

import pathlib
import re

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
