"""ruff (config: ruff.toml) is a gate: the tree must be lint-clean and in ruff's format."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], capture_output=True, text=True, cwd=cwd)


def test_ruff_is_clean():
    result = _ruff("check", "--no-cache", str(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr


def test_tree_is_formatted():
    result = _ruff("format", "--check", "--no-cache", str(ROOT))
    assert result.returncode == 0, (
        "files not in ruff's format (run `.venv/bin/ruff format .`):\n"
        + result.stdout
        + result.stderr
    )


@pytest.mark.parametrize("source", ["x = {  'a':1 }\n"])
def test_format_check_fails_on_unformatted_file(tmp_path, source):
    """The gate above can fail: an unformatted file under the same config is refused."""
    (tmp_path / "ruff.toml").write_text((ROOT / "ruff.toml").read_text())
    (tmp_path / "bad.py").write_text(source)
    assert _ruff("format", "--check", "--no-cache", str(tmp_path), cwd=tmp_path).returncode == 1
