"""Checkpoints written by the real engines (torch DCP, JAX orbax) carry checksums of every
file (polyrl/checkpoints.py): a truncated or altered file is found before any worker
starts, named, and the previous intact checkpoint is used; it then loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from polyrl import checkpoints  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

MANIFEST = {"format": 1, "backend": "", "algorithm": "grpo", "trained_roles": ["actor"]}


def _engine(backend: str, path: Path):
    eng = get_engine(backend)(**({"devices": jax.devices()[:1]} if backend == "jax_pjit" else {}))
    eng.init(ModelConfig(str(path), role="actor"), OptimConfig(), ParallelConfig())
    return eng


def _largest(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_damaged_engine_checkpoint_falls_back_then_refuses(
    tiny_model_dir, tmp_path, backend, capsys
):
    engine = _engine(backend, tiny_model_dir)
    manifest = {**MANIFEST, "backend": backend}
    for step in (2, 4):
        checkpoints.save(tmp_path, step, {"actor": engine.save}, {}, manifest, keep=2)
    root = tmp_path / "checkpoints"
    data = _largest(root / "step_4" / "actor")  # a .distcp shard / an orbax array file
    written = data.stat().st_size
    os.truncate(data, written // 2)  # what a full disk or an interrupted copy leaves
    assert checkpoints.resume_point(tmp_path) == root / "step_2"
    line = [x for x in capsys.readouterr().out.splitlines() if " is damaged " in x]
    assert len(line) == 1 and str(data.relative_to(root / "step_4")) in line[0], line
    assert f"{written // 2} bytes, {written} were written" in line[0]
    fresh = _engine(backend, tiny_model_dir)
    checkpoints.restore(root / "step_2", {"actor": fresh.load}, manifest)  # loads

    data = _largest(root / "step_2" / "actor")
    with data.open("r+b") as f:  # one byte flipped, the size unchanged
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(checkpoints.CheckpointDamaged, match=str(data.relative_to(root / "step_2"))):
        checkpoints.resume_point(tmp_path)
