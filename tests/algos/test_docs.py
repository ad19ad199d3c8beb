"""docs/algorithms.md stays executable: every ```python block runs, in order, in one
namespace, and the printed lists in its comments are what the code prints."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_algorithms_doc_examples_run():
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2, "docs/algorithms.md lost its examples"
    namespace: dict = {}
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(DOC), "exec"), namespace)
        # a comment line "# [...]" / "# (...)" right after a print states its output
        printed = out.getvalue().splitlines()
        stated = [
            m.group(1) for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(\[.*\]|\(.*?\))", block, re.M)
        ]
        stated += [m.group(1) for m in re.finditer(r"^# (\[.*\])$", block, re.M)]
        for claim in stated:
            assert any(line.startswith(claim) for line in printed), (claim, printed)


def test_algorithms_doc_names_every_algorithm():
    from polyrl.algos import algorithm_names

    text = DOC.read_text()
    for name in algorithm_names():
        assert f"| `{name}` |" in text, f"docs/algorithms.md has no table row for {name!r}"
