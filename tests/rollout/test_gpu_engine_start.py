"""A rollout server starts beside another process that releases GPU memory while vLLM
profiles it (issue: a GRPO run on one H100 died at start with vLLM's "Error in memory
profiling ... release GPU memory while vLLM is profiling").

This test process holds 4 GiB on the GPU and releases it the moment the server's vLLM
says it loaded the weights ("Model loading took ..."): after vLLM's snapshot of free
memory, before its profile run ends, the window where a release fails the start. The
server runs as a script in a process of its own (engine_start_race.py). Without retries
the start fails with vLLM's error (the overlap is reproduced); a server, either engine,
retries once, says so in one line, and generates.

Run on a GPU host with the GPU vLLM build: ``pytest -m gpu tests/rollout/test_gpu_engine_start.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).with_name("engine_start_race.py")
LOADED = "Model loading took"  # vLLM's line once its worker holds the weights
RELEASE = 4 * 2**30


def start_beside_a_release(model_dir: Path, engine: str, retries: str) -> str:
    """The script's output, its exit code last; RELEASE bytes of this process's GPU
    memory are freed when the first LOADED line comes."""
    held = torch.empty(RELEASE, dtype=torch.uint8, device="cuda")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(model_dir), engine, retries],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            sys.stderr.write(line)  # with -s the server's start shows as it happens
            if held is not None and LOADED in line:
                held = None
                torch.cuda.empty_cache()
                lines.append(f"[test] released {RELEASE / 2**30:.0f} GiB\n")
        lines.append(f"exit code {proc.wait(timeout=60)}\n")
    finally:
        if proc.poll() is None:
            proc.kill()
        held = None
        torch.cuda.empty_cache()
    return "".join(lines)


def test_without_retries_the_release_fails_the_start(tiny_model_dir):
    out = start_beside_a_release(tiny_model_dir, "sync", "0")
    assert "[test] released 4 GiB" in out, out[-4000:]
    assert "release GPU memory while vLLM is profiling" in out, out[-4000:]
    assert "race server: its engine failed to start 1 times" in out, out[-4000:]
    assert "exit code 0" not in out


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_a_server_starts_and_generates_beside_the_release(tiny_model_dir, engine):
    out = start_beside_a_release(tiny_model_dir, engine, "server")
    assert "[test] released 4 GiB" in out, out[-4000:]
    # the release hit vLLM's profiling (else this test saw no overlap) and was retried
    assert "rollout server 0: the engine failed to start while another process" in out, out[-4000:]
    assert "retrying (1/2)" in out
    assert "generated 4 tokens" in out and out.endswith("exit code 0\n"), out[-4000:]
