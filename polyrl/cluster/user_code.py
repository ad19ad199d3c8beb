"""User code: the modules that register a user's rewards, tasks or losses.

``polyrl train --import my_rewards`` (or ``polyrl.RunConfig.imports = ["my_rewards"]``
in gin) imports ``my_rewards`` in the driver and in every Ray worker of the run, so what
it registers (``@polyrl.rewards.register_reward``, ``polyrl.data.tasks.register_task``,
``polyrl.algos`` entries) exists wherever it is looked up. The directory polyrl was started
from is importable in the driver and in the workers.

Workers import the modules at start through Ray's ``worker_process_setup_hook``
(:func:`runtime_env`): every actor of the job runs it, whoever creates the actor.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

__all__ = ["UserCodeError", "import_modules", "runtime_env", "setup_worker", "IMPORTS_ENV"]

# The module names a worker imports at start (comma-separated), set by runtime_env().
IMPORTS_ENV = "POLYRL_IMPORTS"


class UserCodeError(ImportError):
    """A module named by ``--import`` / ``RunConfig.imports`` cannot be found."""


def _cwd_importable() -> str:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def import_modules(names: Iterable[str]) -> list[ModuleType]:
    """Import each module name (``pkg.mod``; not a file path), with the current
    directory importable. A module that does not exist raises :class:`UserCodeError`
    naming it and the fix; errors raised by the module's own code propagate unchanged."""
    cwd = _cwd_importable()
    modules = []
    for name in names:
        if not name:
            continue
        if name.endswith(".py") or os.sep in name:
            raise UserCodeError(
                f"--import {name!r} (polyrl.RunConfig.imports): give a module name, not a "
                f"file path, e.g. --import {os.path.splitext(os.path.basename(name))[0]!r}"
            )
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # the module exists but imports something missing: its own error
            raise UserCodeError(
                f"--import {name!r} (polyrl.RunConfig.imports): no module named {e.name!r} "
                f"in {cwd} or on PYTHONPATH; run polyrl from the directory that holds "
                f"{name.replace('.', '/')}.py or add its directory to PYTHONPATH"
            ) from None
    return modules


def runtime_env(imports: Iterable[str] = ()) -> dict[str, Any]:
    """The job-level Ray ``runtime_env`` of a run: the driver's ``sys.path`` (with the
    current directory) as the workers' PYTHONPATH, and a setup hook that imports
    ``imports`` in every worker before it runs anything."""
    _cwd_importable()
    return {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join(sys.path),
            IMPORTS_ENV: ",".join(imports),
        },
        "worker_process_setup_hook": "polyrl.cluster.user_code.setup_worker",
    }


def setup_worker() -> None:
    """Ray's worker setup hook: import the run's user modules (``POLYRL_IMPORTS``); with
    ``--debug``, ``breakpoint()`` in any worker of the run (a user's own Ray task too)
    pauses through polyrl.observe.debug, listening on DebugConfig.host (role ``task`` until a
    role worker's constructor names its role)."""
    from polyrl.observe.debug import setup_worker as setup_debugger

    setup_debugger("task", 0)
    import_modules(os.environ.get(IMPORTS_ENV, "").split(","))
