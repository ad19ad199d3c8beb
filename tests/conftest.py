"""Shared fixtures: the tiny model (built locally, no network) and process-wide settings."""

from __future__ import annotations

import os

# JAX reads this once, at import: every test process gets 4 host devices so mesh tests
# (data/fsdp/tensor) run on CPU. Set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No test may reach a hub: models and tokenizers are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# No test's `polyrl train` attaches to a warm session the user started (docs/sessions.md):
# the tests' session directory is their own (tests/trainer/test_sessions.py sets one each).
os.environ.setdefault("POLYRL_SESSION_DIR", f"/tmp/polyrl-tests-{os.getpid()}/session")

import pytest  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny random Qwen2 model + tokenizer (HF directory, fp32)."""
    from polyrl.data.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ray_session():
    """A private local Ray for a module's tests: 2 logical CPUs (this machine; roles and
    servers ask for fractions), and ``address="local"`` so that it never joins a cluster
    some ``ray start`` left on the machine. Shut down after the module if it started it."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    if started:
        ray.shutdown()
