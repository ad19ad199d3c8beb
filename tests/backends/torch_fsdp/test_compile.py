"""ModelConfig.compile: torch.compile per decoder layer and LM-head chunk gives the eager
engine's log-probs, entropy, loss, gradient norm and update (padded and packed), the
compiled code is what runs, each graph is traced once, and one compile serves every
sequence length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from torch_fsdp_helpers import (
    PARITY_EPS,
    assert_same_calls,
    full_weights,
    graphs_before_compiling,
    nll_loss,
    random_batch,
)

from polyrl.backends import get_engine
from polyrl.batch import from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

# fp32 on CPU: inductor reorders reductions (log-softmax, RMSNorm); ~1e-6 seen.
ATOL = 1e-5


def _engine(path, compile: bool, pack: bool, role: str = "actor", **parallel):
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(
            str(path),
            role=role,
            gradient_checkpointing=True,
            attn_implementation="polyrl_varlen" if pack else "sdpa",
            compile=compile,
        ),
        OptimConfig(lr=1e-3, eps=PARITY_EPS) if role == "actor" else None,
        # 8-token chunks: the head scores several chunks, of different lengths
        ParallelConfig(
            **{"micro_batch_size": 4, "pack_sequences": pack, "logits_chunk_tokens": 8} | parallel
        ),
    )
    return engine


@pytest.mark.parametrize(
    "pack",
    # packed: 62 s more on the 2-core machine; the default tier has the compiled padded case
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["padded", "packed"],
)
def test_compiled_engine_equals_eager(tiny_model_dir, pack):
    eager, compiled = _engine(tiny_model_dir, False, pack), _engine(tiny_model_dir, True, pack)
    # frozen roles in the same process: more variants of the same compiled code
    ref_e = _engine(tiny_model_dir, False, pack, role="reference")
    ref_c = _engine(tiny_model_dir, True, pack, role="reference")
    graphs, handed = graphs_before_compiling(), counters["aot_autograd"]["total"]
    # hitting the recompile limit would silently run eager code: make it an error
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for seed in range(3):  # batches of different lengths
            batch = random_batch(9, seed=seed)
            out_e = eager.forward(batch, temperature=0.7, entropy=True)
            out_c = compiled.forward(batch, temperature=0.7, entropy=True)
            for key in ("log_probs", "entropy"):
                np.testing.assert_allclose(out_c[key], out_e[key], atol=ATOL)
            np.testing.assert_allclose(
                ref_c.forward(batch, temperature=1.0, entropy=False)["log_probs"],
                ref_e.forward(batch, temperature=1.0, entropy=False)["log_probs"],
                atol=ATOL,
            )
            m_e, m_c = eager.train_step(batch, nll_loss), compiled.train_step(batch, nll_loss)
            for key in ("loss", "grad_norm"):
                np.testing.assert_allclose(m_c[key], m_e[key], rtol=ATOL)
    compiled_graphs = counters["stats"]["unique_graphs"] - graphs
    assert compiled_graphs > 0, "nothing was compiled"
    # every graph dynamo handed AOTAutograd is one that runs: no analysis was restarted
    # (issue 32: a restart traced each layer twice, in every process, warm cache or not)
    assert counters["aot_autograd"]["total"] - handed == compiled_graphs
    w_e, w_c = full_weights(eager), full_weights(compiled)
    for name in w_e:
        torch.testing.assert_close(w_c[name], w_e[name], atol=1e-6, rtol=0)


@pytest.mark.slow  # 94 s on the 2-core machine (the 4.3k-token micro-batch compiles);
# the default tier warms up JAX (tests/backends/jax_pjit/test_jax_engine.py, test_trainer.py)
def test_a_warm_up_compiles_the_first_calls_and_changes_nothing(tiny_model_dir):
    """``warm_up`` (RunConfig.warm_up) on a few rows compiles every graph the first
    forward and train step on the whole batch run, and leaves weights, optimizer, step and
    RNG as they were: the step after it equals a step without it, bit for bit. The
    micro-batches hold over 4096 tokens (inductor's C++ code guards its float sums on
    that size: a warm-up of two short rows left the step a graph to compile)."""
    rng = np.random.default_rng(3)
    batch = from_token_lists(  # ragged: padding, and a micro-batch of ~4.3k tokens
        [rng.integers(4, 50, rng.integers(20, 60)).tolist() for _ in range(8)],
        [rng.integers(4, 50, rng.integers(400, 500)).tolist() for _ in range(8)],
        pad_id=0,
    )
    kwargs = {"temperature": 0.7, "entropy": True}
    shape = {"micro_batch_size": 8, "logits_chunk_tokens": 1024}
    warm = _engine(tiny_model_dir, True, False, **shape)
    before, rng_state = full_weights(warm), torch.get_rng_state()
    graphs = graphs_before_compiling()
    warm.warm_up("forward", batch, **kwargs)
    warm.warm_up("train_step", batch, nll_loss, **kwargs)
    warmed = counters["stats"]["unique_graphs"] - graphs
    assert warmed > 0, "the warm-up compiled nothing"
    assert warm.step == 0 and torch.equal(torch.get_rng_state(), rng_state)
    assert all(p.grad is None for p in warm.model.parameters())
    after = full_weights(warm)
    assert all(torch.equal(after[n], before[n]) for n in before)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = warm.forward(batch, **kwargs), warm.train_step(batch, nll_loss, **kwargs)
    assert counters["stats"]["unique_graphs"] - graphs == warmed, "the first calls compiled more"
    # the same graphs (no reset) in an engine that never warmed up
    cold = _engine(tiny_model_dir, True, False, **shape)
    expected = cold.forward(batch, **kwargs), cold.train_step(batch, nll_loss, **kwargs)
    assert_same_calls(out, expected, full_weights(warm), full_weights(cold))


def test_an_eager_engine_has_nothing_to_warm_up(tiny_model_dir):
    engine = _engine(tiny_model_dir, False, False)
    graphs = graphs_before_compiling()
    engine.warm_up("train_step", random_batch(8), nll_loss)
    assert counters["stats"]["unique_graphs"] == graphs
