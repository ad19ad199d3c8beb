"""A checkpoint of one backend resumes on the other (polyrl.backends.exchange): two updates on
backend A, save, convert (the real child process), load on backend B, one more update;
its loss, gradient norm and weights must equal three uninterrupted updates on A within
the backends' parity tolerances. A lost Adam step count (bias correction of step 1
instead of 3) or lost moments moves the third update by ~30% of lr, far past them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from test_backend_parity import LOSS, TEMPERATURE, TOL, TOL_NORM, _batch, _weights  # noqa: E402

from polyrl.backends import exchange, get_engine  # noqa: E402
from polyrl.checkpoints import CheckpointMismatch  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, warmup_steps=4, total_steps=10)
# Three Adam updates: each step's rounding difference between the backends (parity's
# TOL_WEIGHTS per update) accumulates.
TOL_WEIGHTS = 3e-2 * OPTIM.lr


def _engine(backend: str, path, role: str = "actor"):
    eng = get_engine(backend)(**({"devices": jax.devices()[:1]} if backend == "jax_pjit" else {}))
    eng.init(ModelConfig(str(path), role=role), OPTIM, ParallelConfig(micro_batch_size=4))
    return eng


def _steps(engine, batch, n):
    return [engine.train_step(batch, LOSS, temperature=TEMPERATURE, entropy=True) for _ in range(n)]


@pytest.mark.parametrize("src,dst", [("torch_fsdp", "jax_pjit"), ("jax_pjit", "torch_fsdp")])
def test_resume_on_the_other_backend_continues_the_run(tiny_model_dir, tmp_path, src, dst):
    batch = _batch()
    whole = _engine(src, tiny_model_dir)
    start = _weights(whole)
    straight = _steps(whole, batch, 3)[-1]
    first = _engine(src, tiny_model_dir)
    _steps(first, batch, 2)
    first.save(str(tmp_path / "ckpt"))
    exchange.convert(src, tmp_path / "ckpt", tmp_path / "exchange")
    info = exchange.read_info(tmp_path / "exchange")
    assert (info["step"], info["adam_step"], info["source_backend"]) == (2, 2, src)
    resumed = _engine(dst, tiny_model_dir)
    resumed.load(str(tmp_path / "exchange"))
    assert resumed.step == 2
    third = _steps(resumed, batch, 1)[0]
    assert third["lr"] == straight["lr"] == OPTIM.lr_at(2)
    assert third["loss"] == pytest.approx(straight["loss"], abs=TOL)
    assert third["grad_norm"] == pytest.approx(straight["grad_norm"], rel=TOL_NORM)
    want, got = _weights(whole), _weights(resumed)
    assert set(got) == set(want)
    moved = max(float(np.abs(want[k] - start[k]).max()) for k in want)
    assert moved > 10 * TOL_WEIGHTS  # three updates moved the weights past the tolerance
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, atol=TOL_WEIGHTS, err_msg=name)


def test_exchange_of_another_role_is_refused(tiny_model_dir, tmp_path):
    actor = _engine("torch_fsdp", tiny_model_dir)
    actor.save(str(tmp_path / "ckpt"))
    from polyrl.backends.torch_fsdp.checkpoint import export_exchange  # in process: faster

    exchange.write(tmp_path / "exchange", export_exchange(str(tmp_path / "ckpt")))
    with pytest.raises(CheckpointMismatch, match="role: checkpoint 'actor', this run 'critic'"):
        _engine("jax_pjit", tiny_model_dir, role="critic").load(str(tmp_path / "exchange"))
