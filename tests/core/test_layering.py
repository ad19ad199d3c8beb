"""docs/design.md "Who may import whom", enforced.

import-linter reads the contracts in setup.cfg. It analyses a package tree on disk, but
polyrl's backends/ and algos/ sit beside polyrl/ and are only *installed* inside it, so
the test stages the installed layout (polyrl/ + polyrl/backends + polyrl/algos) in a
temporary directory and lints that.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
FRAMEWORKS = {"torch", "jax", "jaxlib", "flax", "optax", "vllm"}


def _stage(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "polyrl", dst / "polyrl", ignore=ignore)
    shutil.copytree(ROOT / "backends", dst / "polyrl" / "backends", ignore=ignore)
    shutil.copytree(ROOT / "algos", dst / "polyrl" / "algos", ignore=ignore)
    return dst


def _lint(staged: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(staged)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "setup.cfg")],
        cwd=staged,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold(tmp_path):
    result = _lint(_stage(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    # Each contract was checked (not skipped because a module went missing).
    assert result.stdout.count("KEPT") == 9, result.stdout


@pytest.mark.parametrize(
    ("where", "source", "contract"),
    [
        ("polyrl/algos/_violation.py", "import torch\n", "algos/ is pure math"),
        ("polyrl/algos/_violation.py", "from polyrl.backends import base\n", "algos/ is pure math"),
        (
            "polyrl/backends/jax_pjit/_violation.py",
            "import polyrl.backends.torch_fsdp\n",
            "the two backends never import each other",
        ),
        ("polyrl/rewards/_violation.py", "def f():\n    import jax\n", "never touch a framework"),
        ("polyrl/envs/tools.py", "import ray\n", "tools, tool-call parsers and the sandbox"),
        (
            "polyrl/rollout/_violation.py",
            "from polyrl.backends.base import LossContext\n",
            "rollout/ serves any backend's weights",
        ),
        (
            "polyrl/_violation.py",
            "def f():\n    from polyrl.backends.jax_pjit import bridge\n",
            "the core never imports a backend package",
        ),
        (
            "polyrl/observe/_violation.py",
            "def f():\n    from polyrl.loop import trainer\n",
            "polyrl's floors",
        ),
        (
            "polyrl/backends/torch_fsdp/_violation.py",
            "from polyrl.cluster import roles\n",
            "backends import nothing of the controller",
        ),
        (
            "polyrl/backends/_violation.py",
            "def f():\n    from polyrl.weight_sync import WeightSyncer\n",
            "backends import nothing of the controller",
        ),
        # cluster <-> validate once ran in a circle (now both import polyrl.errors)
        ("polyrl/errors.py", "from polyrl import cluster\n", "no import circles"),
    ],
)
def test_contract_fails_when_violated(tmp_path, where, source, contract):
    staged = _stage(tmp_path)
    (staged / where).write_text(source)
    result = _lint(staged)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and contract in result.stdout, result.stdout


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by statements that run at import time (not inside a
    function or an ``if TYPE_CHECKING:`` block)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def test_core_imports_no_framework_at_module_level():
    # rollout/ hosts vLLM (a torch program) and may import both at module level.
    offenders = {}
    for path in sorted((ROOT / "polyrl").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("polyrl", "rollout"):
            continue
        bad = _module_level_imports(path) & FRAMEWORKS
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert not offenders, f"module-level framework imports in polyrl core: {offenders}"


def test_module_level_check_sees_violations(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "import os\nif True:\n    import torch\ndef f():\n    import jax\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import flax\n"
    )
    assert _module_level_imports(sample) & FRAMEWORKS == {"torch"}


def test_gin_dir_has_no_init():
    # gin/__init__.py would shadow the gin-config package for anything run from the root.
    assert not (ROOT / "gin" / "__init__.py").exists()


def test_only_the_launcher_imports_gin():
    """Library code never imports gin (docs/design.md "Configuration"): bindings are resolved
    in polyrl/configure/launch.py into dataclasses, which are what workers receive."""
    importers = []
    for path in sorted(
        [
            *ROOT.joinpath("polyrl").rglob("*.py"),
            *ROOT.joinpath("backends").rglob("*.py"),
            *ROOT.joinpath("algos").rglob("*.py"),
        ]
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            if any(n.split(".")[0] == "gin" for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["polyrl/configure/bindings.py", "polyrl/configure/launch.py"]


def _names_in_code(path: Path, names: set[str]) -> list[str]:
    """``line: 'name'`` for each string literal of the code at ``path`` that is one of
    ``names`` (docstrings and comments hold none: they are never exactly a name)."""
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}: "
        f"{node.value!r}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def test_the_core_never_names_a_backend():
    """docs/design.md "Placement": the core asks the backend registry (polyrl.backends.base
    ENGINES: engine class, process model, hooks) and never branches on a backend's name.
    Only RunConfig's default names one."""
    from polyrl.backends.base import ENGINES

    found = [
        hit
        for path in sorted((ROOT / "polyrl").rglob("*.py"))
        if path.relative_to(ROOT) != Path("polyrl/config.py")
        for hit in _names_in_code(path, set(ENGINES))
    ]
    assert not found, f"backend names in the core (ask polyrl.backends.base instead): {found}"


def test_name_check_sees_a_backend_branch(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text('"""Runs on jax_pjit."""\ndef f(b):\n    return b == "jax_pjit"\n')
    assert [hit.rsplit(":", 2)[1:] for hit in _names_in_code(sample, {"jax_pjit"})] == [
        ["3", " 'jax_pjit'"]
    ]


def _branches_on(path: Path, field: str, names: set[str]) -> list[str]:
    """``file:line`` of each comparison in ``path`` with ``<x>.<field>`` or a string
    literal of ``names`` on one side."""
    return [
        f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(
            (isinstance(side, ast.Attribute) and side.attr == field)
            or (isinstance(side, ast.Constant) and side.value in names)
            for side in (node.left, *node.comparators)
        )
    ]


def test_only_the_transport_registry_interprets_weight_transport():
    """docs/design.md: polyrl/weight_sync/registry.py is the one place that interprets
    RunConfig.weight_transport: other modules hand the name to its functions and never
    compare it, or anything, with a transport's name."""
    from polyrl.weight_sync.registry import TRANSPORTS

    found = [
        hit
        for p in sorted((ROOT / "polyrl").rglob("*.py"))
        if p.relative_to(ROOT).parts[:2] != ("polyrl", "weight_sync")
        for hit in _branches_on(p, "weight_transport", set(TRANSPORTS))
    ]
    assert not found, f"branches on a weight transport outside polyrl/weight_sync: {found}"


def test_branch_check_sees_transport_branches(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "def f(cfg, t):\n    a = cfg.weight_transport != 'x'\n    b = 'nccl' == t\n"
        "    return 'nccl' if a else t\n"
    )
    assert [h.rsplit(":", 1)[1] for h in _branches_on(sample, "weight_transport", {"nccl"})] == [
        "2",
        "3",
    ]
