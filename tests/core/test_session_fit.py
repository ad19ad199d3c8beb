"""Which runs fit a warm session (polyrl.cluster.session.fingerprint / mismatch): what its
kept workers were built with must match, the rest is the run's own (docs/sessions.md
"What must match"). No Ray: the checks' config only."""

from __future__ import annotations

import pytest

from polyrl.cluster.session import fingerprint, mismatch
from polyrl.configure.launch import parse_config, prepare

GRPO = "gin/experiments/tiny_grpo.gin"


def _fp(tmp_path, name: str, *params: str, gin: str = GRPO) -> dict:
    run_dir = f"polyrl.RunConfig.run_dir = {str(tmp_path / name)!r}"
    cfg, spec = prepare(parse_config([gin], [run_dir, *params])[0])
    return fingerprint(cfg, spec)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """The session's fingerprint: the tiny GRPO, its tiny model built in its own dir."""
    return _fp(tmp_path_factory.mktemp("session"), "host")


def test_the_runs_own_settings_fit(session, tmp_path):
    # another run dir (its own copy of the same tiny model), seed, steps, sampling, lr
    run = _fp(
        tmp_path,
        "run",
        "polyrl.RunConfig.seed = 7",
        "polyrl.RunConfig.total_steps = 3",
        "polyrl.SamplingSpec.n = 4",
        "actor/polyrl.OptimConfig.lr = 1e-4",
    )
    assert mismatch(session, run) is None


def test_a_server_setting_is_named(session, tmp_path):
    run = _fp(tmp_path, "run", "polyrl.RolloutConfig.max_model_len = 128")
    assert mismatch(session, run) == "its rollout.max_model_len is 64, this run's 128"


def test_another_backend_is_named(session, tmp_path):
    run = _fp(tmp_path, "run", gin="gin/experiments/tiny_grpo_jax.gin")
    assert mismatch(session, run) == "its backend is 'torch_fsdp', this run's 'jax_pjit'"


def test_a_role_the_session_lacks_is_named(session, tmp_path):
    run = _fp(tmp_path, "run", gin="gin/experiments/tiny_ppo.gin")
    why = mismatch(session, run)
    assert why is not None and why.startswith("its roles.critic is None, this run's {")
