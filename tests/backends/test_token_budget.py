"""Micro-batches sized by tokens (ParallelConfig.max_tokens_per_micro_batch): the plan and
trimming by hand, and on both backends the same forward outputs and the same update as
fixed micro-batches (the loss divides by global counts, so grouping must not matter)."""

from __future__ import annotations

import numpy as np
import pytest

from polyrl import micro_batch
from polyrl.algos.registry import get_algorithm
from polyrl.backends import get_engine
from polyrl.batch import from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
# fp32; grouping changes matmul shapes and summation order only (~1e-7 observed).
TOL = 1e-5
# Adam (eps 1e-4) turns rounding noise of near-zero gradient entries into at most ~1e-7.
TOL_WEIGHTS = 1e-6


def _hand_batch():
    # (prompt, response) lengths: (2, 1) (5, 3) (1, 1) (3, 4) -> totals 3, 8, 2, 7
    lens = [(2, 1), (5, 3), (1, 1), (3, 4)]
    prompts = [list(range(10, 10 + p)) for p, _ in lens]
    resps = [list(range(30, 30 + r)) for _, r in lens]
    return from_token_lists(prompts, resps, pad_id=0)


def test_plan_by_hand():
    batch = _hand_batch()
    fixed = micro_batch.plan(batch, micro_batch_size=3)
    assert [g.tolist() for g in fixed] == [[0, 1, 2], [3]]
    # longest first: row 1 (5+3=8) alone would be 8; + row 3 -> 2 x (5 + 4) = 18 > 16
    # -> row 3 starts a group (7); + row 0 -> 2 x (3 + 4) = 14 <= 16; + row 2 -> 3 x 7 > 16
    plan = micro_batch.plan(batch, micro_batch_size=3, max_tokens=16)
    assert [g.tolist() for g in plan] == [[1], [3, 0], [2]]
    # a row longer than the budget still gets a micro-batch of its own
    assert [g.tolist() for g in micro_batch.plan(batch, 3, max_tokens=4)] == [[1], [3], [0], [2]]
    # packed: real tokens; 8 + 7 = 15 <= 16, + 3 -> 18 > 16; 3 + 2 = 5
    packed = micro_batch.plan(batch, 3, max_tokens=16, cost=micro_batch.real_tokens)
    assert [g.tolist() for g in packed] == [[1, 3], [0, 2]]


def test_jax_budget_counts_its_padded_shapes():
    from polyrl.backends.jax_pjit.shapes import padded_cost

    batch = _hand_batch()  # (prompt, response): row 1 (5, 3), 3 (3, 4), 0 (2, 1), 2 (1, 1)
    # lengths to powers of two >= 4: row 1 -> 8 + 4 = 12; + row 3 -> 2 x (8 + 4) = 24 > 20;
    # row 3 -> 4 + 4; + row 0 -> 2 x (4 + 4) = 16; + row 2 -> 3 x 8 = 24 > 20
    cost = padded_cost(shards=1, min_len=4, packed=False)
    plan = micro_batch.plan(batch, 3, max_tokens=20, cost=cost)
    assert [g.tolist() for g in plan] == [[1], [3, 0], [2]]
    # unpadded the first two fit: 2 x (5 + 4) = 18 <= 20
    assert micro_batch.plan(batch, 3, max_tokens=20)[0].tolist() == [1, 3]
    # packed on 2 shards: each shard a row of its rows' real tokens, up to a power of two.
    # [1, 3]: shards of 8 and 7 tokens -> 2 x 8 = 16; + row 0: 4 rows, shards [8 + 7, 3 + 0]
    # -> 2 x 16 = 32 > 16; [0, 2]: shards of 3 and 2 -> 2 x 4 = 8
    cost = padded_cost(shards=2, min_len=4, packed=True)
    packed = micro_batch.plan(batch, 3, max_tokens=16, cost=cost)
    assert [g.tolist() for g in packed] == [[1, 3], [0, 2]]


def test_split_to_matches_the_busiest_rank():
    groups = [np.array([4, 1, 2]), np.array([0])]
    split = micro_batch.split_to(groups, 4)
    assert [g.tolist() for g in split] == [[4], [1], [2], [0]]
    with pytest.raises(ValueError, match="cannot make 5 micro-batches from 4 rows"):
        micro_batch.split_to(groups, 5)


def test_trim_drops_all_padding_columns():
    batch = _hand_batch().take([0, 2])  # prompts 2 and 1 tokens, responses 1 and 1
    trimmed = micro_batch.trim(batch)
    assert batch["input_ids"].shape == (2, 5 + 4)
    assert trimmed["input_ids"].shape == (2, 2 + 1)
    assert trimmed["responses"].shape == trimmed["response_mask"].shape == (2, 1)
    assert trimmed["input_ids"].tolist() == [[10, 11, 30], [0, 10, 30]]
    assert trimmed["position_ids"][0].tolist() == [0, 1, 2]


def _batch():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 58, rng.integers(1, 12))) for _ in range(10)]
    resps = [list(rng.integers(3, 58, rng.integers(1, 14))) for _ in range(10)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    ref = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (10, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": ref, "advantages": adv})


def _engine(backend, path, **parallel):
    kw = {"devices": __import__("jax").devices()[:1]} if backend == "jax_pjit" else {}
    eng = get_engine(backend)(**kw)
    eng.init(ModelConfig(str(path)), OptimConfig(lr=1e-3, eps=1e-4), ParallelConfig(**parallel))
    return eng


def _weights(engine):
    return {
        k: np.array(v.detach().float().cpu() if hasattr(v, "detach") else v)
        for bucket in engine.export_weights(1 << 22)
        for k, v in bucket
    }


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_jax_micro_batches_stay_within_the_budget(tiny_model_dir, pack):
    """The JAX engine pads each micro-batch's lengths to powers of two (at least 16): a
    budget of 40 tokens holds one padded row of these lengths (16 + 16), or packed, rows
    whose real tokens add up to at most 32. Counted unpadded, rows 3 and 0 (10 + 10 tokens
    each) would share a micro-batch of 2 x 32 = 64 padded tokens."""
    pytest.importorskip("jax")
    batch = _batch()
    assert [3, 0] in [g.tolist() for g in micro_batch.plan(batch, 4, 40)]
    engine = _engine(
        "jax_pjit",
        tiny_model_dir,
        micro_batch_size=4,
        max_tokens_per_micro_batch=40,
        pack_sequences=pack,
    )
    parts = engine._micro_batches(batch)
    assert sorted(i for idx, _ in parts for i in idx.tolist()) == list(range(len(batch)))
    sizes = [arrays["packed_ids" if pack else "input_ids"].size for _, arrays in parts]
    assert max(sizes) <= 40, sizes
    rows = [len(idx) for idx, _ in parts]
    assert max(rows) == (2 if pack else 1), rows  # packing fits more rows in the budget


def test_torch_packed_micro_batches_count_real_tokens(tiny_model_dir):
    """Packed, a torch micro-batch computes its rows' real tokens only, so the budget
    counts those: more rows fit than padded to the longest would."""
    batch = _batch()
    engine = _engine(
        "torch_fsdp",
        tiny_model_dir,
        micro_batch_size=4,
        max_tokens_per_micro_batch=40,
        pack_sequences=True,
    )
    prompt, response = micro_batch.lengths(batch)
    groups = [idx for idx, _ in engine._micro_batches(batch)]
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(batch)))
    assert max(int((prompt[g] + response[g]).sum()) for g in groups) <= 40
    padded = [len(g) * int(prompt[g].max() + response[g].max()) for g in groups]
    assert max(padded) > 40, padded  # counted padded, these rows could not share


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_token_budget_gives_the_fixed_update(tiny_model_dir, backend):
    if backend == "jax_pjit":
        pytest.importorskip("jax")
    batch = _batch()
    fixed = _engine(backend, tiny_model_dir, micro_batch_size=4)
    budget = _engine(backend, tiny_model_dir, micro_batch_size=4, max_tokens_per_micro_batch=40)
    groups = micro_batch.plan(batch, 4, 40)
    assert len(groups) > 3 and len({len(g) for g in groups}) > 1  # really regrouped
    out_f = fixed.forward(batch, temperature=0.8, entropy=True)
    out_b = budget.forward(batch, temperature=0.8, entropy=True)
    for key in ("log_probs", "entropy"):
        np.testing.assert_allclose(out_b[key], out_f[key], atol=TOL)
    assert not out_b["log_probs"][batch["response_mask"] == 0].any()
    m_f = fixed.train_step(batch, LOSS, temperature=0.8, entropy=True)
    m_b = budget.train_step(batch, LOSS, temperature=0.8, entropy=True)
    for key in ("loss", "grad_norm", "global_tokens"):
        np.testing.assert_allclose(m_b[key], m_f[key], rtol=TOL, atol=TOL)
    w_f, w_b = _weights(fixed), _weights(budget)
    for name in w_f:
        np.testing.assert_allclose(w_b[name], w_f[name], atol=TOL_WEIGHTS, err_msg=name)
