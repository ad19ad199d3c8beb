"""The GSM8K env with every turn run as a Python program (experiments/bench/gsm8k_tool.py):
a random-weight model never writes a ``<tool_call>``, so this env times the multi-turn
path's full cost (a sandbox run, an observation and a continued prefix every turn).
Imported by the benchmark's run (``RunConfig.imports``) in the driver and every worker.

Two envs: ``bench/gsm8k_every_turn`` runs each turn's text in the sandbox (a fresh,
namespaced Python subprocess per call); ``bench/gsm8k_every_turn_nosandbox`` is its
control without the subprocess: the same ``python`` tool (name, schema, the env worker's
``ToolEnv.step`` and its threads) whose function only compiles the text in the worker's
own process, never running it, and returns the observation the sandbox would give for a
text that fails to compile (what a random model's turn does): the same traceback lines
under the tool's "exited with status 1" text. A text that compiles gets what an empty
program's run returns. The generate time between the two runs is the sandbox's."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
import threading
import traceback
import warnings

from polyrl.envs import register_env
from polyrl.envs.parsers import ParseResult
from polyrl.envs.sandbox import SandboxLimits, SandboxResult
from polyrl.envs.tasks import MathPythonEnv
from polyrl.envs.tools import PYTHON, ToolCall, ToolError, _python_failure

EVERY_TURN = "bench/gsm8k_every_turn"
NO_SANDBOX = "bench/gsm8k_every_turn_nosandbox"


@register_env(EVERY_TURN)
class EveryTurnPython(MathPythonEnv):
    """The GSM8K env, with every turn a ``python`` call of the turn's text."""

    def parse(self, turn):
        return ParseResult("", [ToolCall("python", {"code": turn.text}, turn.text)], [])


def compile_only(code: str) -> str:
    """The ``python`` tool's result for ``code`` without the sandbox: ``code`` written to a
    ``main.py`` and compiled here as the sandbox's interpreter compiles it, never run. A
    syntax error raises the tool's failure (a ``ToolError``: the env's observation is
    ``"error: "`` and it) with what the sandbox's stderr holds for it: the compiler's
    warnings (as a fresh interpreter shows them) and the error's lines; a program that
    compiles returns an empty program's output.

    The file is there because CPython reads an error's line back from the file the code
    was compiled under (the last 999-byte piece of a longer line, in 3.11): compiled
    from a string alone, a long line's error would quote more than the sandbox's."""
    workdir = tempfile.mkdtemp(prefix="polyrl-nosandbox-")
    try:
        path = os.path.join(workdir, "main.py")
        with open(path, "w", encoding="utf-8") as f:  # as the sandbox writes it
            f.write(code)
        with open(path, encoding="utf-8") as f:  # and its interpreter reads it
            source = f.read()
        shown, error = _compiled(source, path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if error is None:
        return _empty_program()
    if getattr(error, "filename", None) == path:
        error.filename = "main.py"  # the sandbox's name (its working directory's file)
    stderr = "".join([*shown, *traceback.format_exception_only(type(error), error)])
    failed = SandboxResult(stdout="", stderr=stderr, exit_code=1, reason=None)
    raise ToolError(_python_failure(failed, SandboxLimits()))


_WARNING_STATE = threading.Lock()  # catch_warnings swaps the process's warning filters


def _compiled(source: str, path: str) -> tuple[list[str], Exception | None]:
    """``source`` compiled under ``path``: the warnings a fresh interpreter prints for it
    (as ``warnings`` writes them, under the sandbox's name ``main.py``) and the error,
    if any."""
    with _WARNING_STATE, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        # a fresh interpreter shows DeprecationWarning for __main__ alone; the compiler
        # warns in the name of module "main" (main.py), so those stay unseen there
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            compile(source, path, "exec")
            error = None
        except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte, on some versions
            error = e
    lines = source.split("\n")
    shown = [
        warnings.formatwarning(w.message, w.category, "main.py", w.lineno, lines[w.lineno - 1])
        for w in caught
    ]
    return shown, error


@functools.cache
def _empty_program() -> str:
    """What the sandbox's ``python`` tool returns for an empty program (one real run, the
    first time a text compiles in this process)."""
    return PYTHON.fn("")


@register_env(NO_SANDBOX)
class EveryTurnCompiled(EveryTurnPython):
    """:class:`EveryTurnPython` whose ``python`` tool compiles the text in-process
    (:func:`compile_only`) instead of running it in the sandbox."""

    tools = (dataclasses.replace(PYTHON, fn=compile_only),)
