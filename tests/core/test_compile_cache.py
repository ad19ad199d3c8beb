"""RunConfig.cache_dir: each framework finds its cache under the directory.

The subprocess tests compile a small program with the variables of
``polyrl.compile_cache`` and look for the framework's entries on disk: a misspelled
variable leaves the directory empty (the framework falls back to its own default).
"""

import os
import subprocess
import sys

import pytest

from polyrl.compile_cache import CACHE_VARS, cache_env, use_cache


def test_cache_env_names_every_cache_under_the_directory(tmp_path, monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    env = cache_env(str(tmp_path))
    assert env == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
    }
    assert cache_env(None) == {} and cache_env("") == {}


def test_cache_env_expands_home_and_keeps_a_variable_already_set(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    env = use_cache("~/cache")
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "cache" / "jax")
    assert env["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == env["JAX_COMPILATION_CACHE_DIR"]


def _run(code: str, env: dict[str, str]) -> None:
    for var in CACHE_VARS:
        env.setdefault(var, "")  # only the test's own directories
    clean = {k: v for k, v in {**os.environ, **env}.items() if v}
    subprocess.run([sys.executable, "-c", code], env=clean, check=True, timeout=300)


def _files(path) -> list:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_jax_keeps_its_executables_under_the_cache_dir(tmp_path, monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    # JAX keeps only compiles over 1 s by default; this one is milliseconds.
    env = cache_env(str(tmp_path)) | {
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum())"
    _run(code, env)
    assert _files(tmp_path / "jax"), "JAX wrote nothing under JAX_COMPILATION_CACHE_DIR"


@pytest.mark.slow  # an Inductor C++ compile: 20-50 s on 2 cores
def test_torch_compile_keeps_its_graphs_under_the_cache_dir(tmp_path, monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: torch.relu(x) * 2 + 1)\n"
        "print(f(torch.ones(16)).sum())\n"
    )
    _run(code, cache_env(str(tmp_path)))
    assert _files(tmp_path / "torch" / "inductor"), "nothing under TORCHINDUCTOR_CACHE_DIR"
