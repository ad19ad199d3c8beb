"""docs/agents.md "Tools" and "The Python sandbox" stay executable: each ```python block of
those sections runs, in order, in one namespace, and each ``print(...)  # value`` prints
that value."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

from polyrl.envs.tools import TOOLS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "agents.md"
SECTIONS = ("## Tools\n", "## The Python sandbox\n")


def _section(text: str, heading: str) -> str:
    body = text.split(heading, 1)[1]
    return body.split("\n## ", 1)[0]


def test_tools_and_sandbox_examples_run_and_print_what_they_say():
    text = DOC.read_text()
    blocks = [
        block
        for heading in SECTIONS
        for block in re.findall(r"```python\n(.*?)```", _section(text, heading), flags=re.S)
    ]
    assert len(blocks) == 2, "docs/agents.md lost its tool or sandbox example"
    namespace: dict = {}
    try:
        for block in blocks:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, str(DOC), "exec"), namespace)
            stated = re.findall(r"^print\(.*\)  # (.*)$", block, flags=re.M)
            assert out.getvalue().splitlines() == stated
    finally:
        TOOLS.pop("to_cm", None)
