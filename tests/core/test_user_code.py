"""--import / RunConfig.imports: an own task and reward module (the worked example of
docs/rewards.md) loads in the validators from the user's directory; mistakes are one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.cluster.user_code import IMPORTS_ENV, UserCodeError, import_modules, runtime_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "experiments" / "own_task" / "min_digit.py"
GRPO = "gin/experiments/tiny_grpo.gin"


def polyrl(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "polyrl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A directory outside the repository holding the user's module and a dataset of its task."""
    shutil.copy(EXAMPLE, tmp_path / "min_digit.py")
    (tmp_path / "data.jsonl").write_text(
        '{"prompt": [{"role": "user", "content": "min 374"}], "ground_truth": "3", '
        '"data_source": "my/min_digit"}\n'
    )
    return tmp_path


def test_validate_dataset_needs_the_import_for_an_own_reward(user_dir):
    bad = polyrl("validate-dataset", "data.jsonl", cwd=user_dir)
    assert bad.returncode == 1 and "data_source='my/min_digit' has no reward function" in bad.stderr
    ok = polyrl("validate-dataset", "data.jsonl", "--import", "min_digit", cwd=user_dir)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK data.jsonl")


def test_validate_config_imports_from_the_flag_and_from_gin(user_dir):
    common = ["--gin_file", GRPO, "--gin_param", f"polyrl.RunConfig.run_dir = {str(user_dir)!r}"]
    task = ["--gin_param", 'polyrl.RunConfig.task = "min"']
    flag = polyrl("validate-config", "--import", "min_digit", *common, *task, cwd=user_dir)
    assert flag.returncode == 0 and flag.stdout.startswith("OK "), flag.stderr
    gin = ["--gin_param", 'polyrl.RunConfig.imports = ["min_digit"]']
    assert polyrl("validate-config", *common, *task, *gin, cwd=user_dir).returncode == 0


def test_a_missing_module_is_one_line_naming_it_and_the_fix(user_dir):
    out = polyrl("validate-config", "--import", "no_such_rewards", "--gin_file", GRPO, cwd=user_dir)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--import 'no_such_rewards'" in out.stderr and str(user_dir) in out.stderr
    out = polyrl("validate-dataset", "data.jsonl", "--import", "min_digit.py", cwd=user_dir)
    assert out.returncode == 2 and "--import 'min_digit'" in out.stderr


def test_the_module_s_own_import_error_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ModuleNotFoundError) as e:
        import_modules(["broken_rewards"])
    assert not isinstance(e.value, UserCodeError) and e.value.name == "not_installed_dependency_xyz"


def test_workers_get_the_cwd_and_the_module_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    env = runtime_env(["a.b", "c"])
    assert str(tmp_path) in env["env_vars"]["PYTHONPATH"].split(os.pathsep)
    assert env["env_vars"][IMPORTS_ENV] == "a.b,c"
    assert env["worker_process_setup_hook"] == "polyrl.cluster.user_code.setup_worker"


def test_the_documented_example_is_the_tested_file():
    block = (ROOT / "docs" / "rewards.md").read_text().split("```python\n")[2].split("```")[0]
    source = EXAMPLE.read_text().splitlines()
    missing = [line for line in block.splitlines() if line.strip() and line not in source]
    assert not missing, missing
