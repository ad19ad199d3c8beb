"""docs/tinker.md as written: its start command in a shell, then its client block against
the service that command started (the environment from its export lines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tinker.md"


def blocks(section: str) -> list[str]:
    """The fenced blocks of ``## section`` in docs/tinker.md."""
    text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def test_the_documented_command_and_block_parse():
    """The fast half (the slow test below runs them): the command is `polyrl
    serve-tinker` on the default gin file at the port the export lines name, and the
    client block compiles and reads the service's address from the environment."""
    import shlex

    from polyrl.cli import build_parser
    from polyrl.service import DEFAULT_GIN

    args = build_parser().parse_args(shlex.split(blocks("Start")[0].strip())[1:])
    exports, code = blocks("Connect")[:2]
    url = dict(re.findall(r"export (\w+)=(\S+)", exports))["TINKER_BASE_URL"]
    assert args.command == "serve-tinker" and not args.gin_file
    assert url == f"http://{args.host}:{args.port}" and (ROOT / DEFAULT_GIN).exists()
    compile(code, "docs/tinker.md", "exec")
    assert "base_url" not in code and "ServiceClient()" in code


@pytest.mark.slow  # ~1 min: the service's start in a process of its own, the block's steps
def test_the_documented_command_serves_the_documented_client_block(tmp_path):
    command = blocks("Start")[0].strip()
    exports, code = blocks("Connect")[:2]
    env = {**os.environ, "RAY_ADDRESS": "local"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the polyrl CLI
    client_env = dict(re.findall(r"export (\w+)=(\S+)", exports))
    assert command.startswith("polyrl serve-tinker") and set(client_env) == {
        "TINKER_BASE_URL",
        "TINKER_API_KEY",
    }
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command,
            shell=True,
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()
            try:
                if httpx.get(client_env["TINKER_BASE_URL"] + "/api/v1/healthz").is_success:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        printed = blocks("Start")[1].strip().split(" serving ")[0]
        assert printed in log.read_text()
        run = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**env, **client_env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        losses = [float(x) for x in re.findall(r"^loss ([\d.e+-]+)", run.stdout, re.M)]
        assert len(losses) == 3 and losses[-1] < losses[0], run.stdout
    finally:
        os.killpg(server.pid, 15)  # the shell and the service in its session
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def test_a_bad_max_training_clients_is_refused_by_name():
    from polyrl.configure.launch import parse_config
    from polyrl.errors import ConfigError
    from polyrl.service import DEFAULT_GIN

    with pytest.raises(ConfigError, match="max_training_clients=0 must be >= 1"):
        parse_config([DEFAULT_GIN], ["polyrl.TinkerConfig.max_training_clients = 0"])


def test_the_documented_gpu_lines_bind():
    """docs/tinker.md "On GPUs": each block's lines are bindings the default gin file
    takes (every one used), with the settings the text says."""
    from polyrl.configure.launch import parse_config
    from polyrl.service import DEFAULT_GIN

    shared, own = blocks("On GPUs")
    cfg, _ = parse_config([DEFAULT_GIN], shared.strip().splitlines())
    assert cfg.tinker.max_training_clients == 2 and cfg.pools == {"shared": {"CPU": 8, "GPU": 1}}
    cfg, _ = parse_config([DEFAULT_GIN], own.strip().splitlines())
    assert cfg.actor.pool == "train" and cfg.rollout.pool == "gen"
