"""docs/tinker.md as written: its start command in a shell, then its client block against
the service that command started (the environment from its export lines)."""

from __future__ import annotations

import contextlib
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


def test_the_documented_cookbook_commands_parse():
    """The fast half of the cookbook test below: the start command is `polyrl
    serve-tinker` on a gin file that exists; the recipe's two commands are its CLIConfig's
    arguments (chz parses them; model_name is the shell's expansion, left out here), the
    second the first resumed to more steps."""
    import shlex

    import chz
    from tinker_cookbook.recipes.multiplayer_rl.guess_number.train import CLIConfig

    from polyrl.cli import build_parser

    start, *recipes = (b.strip() for b in blocks("tinker-cookbook recipes"))
    args = build_parser().parse_args(shlex.split(start)[1:])
    assert args.command == "serve-tinker" and (ROOT / args.gin_file[0]).exists()
    expansion = r"model_name=\$\(echo \$PWD/runs/tinker_cookbook/models/tiny-qwen2-\*\) "
    configs = []
    for recipe in recipes:
        assert re.search(expansion, recipe), recipe
        argv = shlex.split(re.sub(expansion, "", recipe))
        module = "tinker_cookbook.recipes.multiplayer_rl.guess_number.train"
        assert argv[:3] == ["python", "-m", module]
        configs.append(chz.Blueprint(CLIConfig).make_from_argv(argv[3:]))
    first, resumed = configs
    assert first.renderer_name == "qwen3_instruct" and first.behavior_if_log_dir_exists == "delete"
    assert resumed.behavior_if_log_dir_exists == "resume" and resumed.log_path == first.log_path
    assert resumed.max_steps > first.max_steps


@contextlib.contextmanager
def serving(command: str, cwd: Path, env: dict, url: str):
    """``command`` (a documented ``polyrl serve-tinker``) in a shell of its own session
    until it has printed its start line and answers at ``url``; yields its log file; ends
    the session after, and waits until nothing answers at ``url`` (the next test's service
    takes the same port: an answer from this one would pass for it)."""

    log = cwd / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            command,
            shell=True,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()
            if " serving " in log.read_text() and answers(url):
                break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        yield log
    finally:
        os.killpg(server.pid, 15)  # the shell and the service in its session
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
        deadline = time.monotonic() + 60
        while answers(url) and time.monotonic() < deadline:
            time.sleep(1)


def answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/api/v1/healthz").is_success
    except httpx.HTTPError:
        return False


def documented_env() -> tuple[dict, dict]:
    """The test's environment with this venv's ``polyrl``/``python`` first on PATH, and
    the Connect section's exports."""
    env = {**os.environ, "RAY_ADDRESS": "local"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    client_env = dict(re.findall(r"export (\w+)=(\S+)", blocks("Connect")[0]))
    assert set(client_env) == {"TINKER_BASE_URL", "TINKER_API_KEY"}
    return env, client_env


@pytest.mark.slow  # ~1 min: the service's start in a process of its own, the block's steps
def test_the_documented_command_serves_the_documented_client_block(tmp_path):
    command = blocks("Start")[0].strip()
    code = blocks("Connect")[1]
    env, client_env = documented_env()
    assert command.startswith("polyrl serve-tinker")
    with serving(command, tmp_path, env, client_env["TINKER_BASE_URL"]) as log:
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


def run_recipe(command: str, cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    run = subprocess.run(
        command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "Training completed successfully" in run.stdout + run.stderr
    return run, time.monotonic() - began


@pytest.mark.slow  # ~1.5 min: the service's start, then the recipe's 3 steps and 1 more
def test_the_documented_cookbook_recipe_runs_against_the_service(tmp_path):
    """docs/tinker.md "tinker-cookbook recipes": its start command, then the recipe's two
    commands in a shell, as written. The recipe ends its steps; each step's row has finite
    rewards and the sampler's log-probs agree with the trainer's (kl_sample_train ~0: the
    recipe's own check); every state it saved is a directory of this service's; the
    second command resumes from the last save, its run's renderer name read back."""
    import json
    import math

    start, recipe, resume = (b.strip() for b in blocks("tinker-cookbook recipes"))
    env, client_env = documented_env()
    env = {**env, **client_env}
    steps, more = (int(re.search(r"\bmax_steps=(\d+)", c).group(1)) for c in (recipe, resume))
    log_path = tmp_path / re.search(r"\blog_path=(\S+)", recipe).group(1)
    assert start.startswith("polyrl serve-tinker") and "tinker_cookbook.recipes." in recipe
    with serving(start, tmp_path, env, client_env["TINKER_BASE_URL"]):
        _, wall = run_recipe(recipe, tmp_path, env)
        lines = lambda name: (log_path / name).read_text().splitlines()  # noqa: E731
        saves = [json.loads(line) for line in lines("checkpoints.jsonl")]
        again, _ = run_recipe(resume, tmp_path, env)
    rows = [json.loads(line) for line in lines("metrics.jsonl")]
    trained = [r for r in rows if "env/all/reward/total" in r]
    assert [r["step"] for r in trained] == list(range(more)), rows
    for row in trained:
        assert math.isfinite(row["env/all/reward/total"]), row
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row
        assert row["tokens/trained"] > 0, row
    assert saves[-1]["batch"] == steps and any(s["batch"] < steps for s in saves), saves
    for save in saves:
        model_id, kind, name = save["state_path"].removeprefix("tinker://").split("/")
        state = tmp_path / "runs" / "tinker_cookbook" / model_id.replace(":", "_") / kind / name
        assert (state.parent / f"{name}.lora.json").exists(), save
    said = again.stdout + again.stderr
    assert f"Resumed training from {saves[-1]['state_path']}" in said, said[-4000:]
    assert "Could not fetch renderer metadata" not in said, said[-4000:]
    times = [round(r["time/total"], 2) for r in trained[:steps]]
    print(f"guess_number: {steps} steps in {wall:.1f} s (recipe start included), per step {times}")


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
