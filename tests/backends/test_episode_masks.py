"""Multi-turn masks on both backends: an update on episodes whose observation tokens are
masked equals the update on the same turns with the observations taken out of the
response (each sampled turn its own row, everything before it the prompt).

The two batches hold the same sampled tokens in the same contexts, so every sampled
token's log-prob, the token-mean loss (same global token count) and the gradient are the
same; the masked batch also carries garbage (advantages 100, old/ref log-probs +5) on its
observation tokens, which must change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.batch import Batch, from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

# token-mean: the split batch makes each turn a sequence of its own, so a per-sequence
# mean (GRPO's default, over a whole episode in a multi-turn batch) is not comparable.
LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01, agg="token-mean")
OPTIM = OptimConfig(lr=1e-3, grad_clip=1e9)
TEMPERATURE = 0.9
# fp32, one backend, the same tokens in the same context: only the padded layout of the
# rows differs (other widths, so other reduction orders in attention and matmuls).
TOL = 1e-5
# Adam's first step moves each weight by lr * g / (|g| + eps): an element whose gradient is
# at rounding level (|g| ~ eps) may move by anything up to 2 lr, so the weights are held
# to 1% of lr except for at most 0.1% of the elements (a mask that let the garbage in
# would move most elements differently), and to 2 lr everywhere.
TOL_WEIGHTS = 1e-2 * OPTIM.lr


def _episodes(seed: int = 0):
    """Random episodes: a prompt, then turns alternating sampled / observation segments
    (every episode ends with a sampled turn). Returns per episode the prompt and a list
    of (kind, ids) segments."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        prompt = list(rng.integers(3, 58, rng.integers(2, 7)))
        segs = []
        for t in range(int(rng.integers(1, 4))):
            if t:
                segs.append(("obs", list(rng.integers(3, 58, rng.integers(1, 5)))))
            segs.append(("sampled", list(rng.integers(3, 58, rng.integers(1, 5)))))
        out.append((prompt, segs))
    return out


def _masked_batch(episodes, rng) -> tuple[Batch, list[np.ndarray]]:
    """One row per episode; per-turn values drawn for each sampled token."""
    prompts = [p for p, _ in episodes]
    resps = [[t for _, ids in segs for t in ids] for _, segs in episodes]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape = b["responses"].shape
    mask = np.zeros(shape, np.float32)
    adv = np.full(shape, 100.0, np.float32)  # garbage where masked
    old = np.full(shape, 5.0, np.float32)
    ref = np.full(shape, 5.0, np.float32)
    values = []  # per sampled segment: (adv, old, ref) arrays, for the split batch
    for row, (_, segs) in enumerate(episodes):
        pos = 0
        for kind, ids in segs:
            n = len(ids)
            if kind == "sampled":
                a, o, r = rng.normal(0, 1), rng.normal(-4, 0.3, n), rng.normal(-4, 0.3, n)
                mask[row, pos : pos + n] = 1
                adv[row, pos : pos + n], old[row, pos : pos + n], ref[row, pos : pos + n] = a, o, r
                values.append((np.full(n, a), o, r))
            pos += n
    adv[(mask == 0) & (b["attention_mask"][:, -shape[1] :] == 0)] = 0.0  # padding
    cols = {"response_mask": mask, "advantages": adv, "old_log_probs": old, "ref_log_probs": ref}
    return b.with_columns(cols), values


def _split_batch(episodes, values) -> Batch:
    """Each sampled turn its own row: the prompt is everything before it."""
    prompts, resps = [], []
    for prompt, segs in episodes:
        before = list(prompt)
        for kind, ids in segs:
            if kind == "sampled":
                prompts.append(list(before))
                resps.append(list(ids))
            before += ids
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]

    def column(k):
        out = np.zeros(shape, np.float32)
        for row, v in enumerate(values):
            out[row, : len(v[k])] = v[k]
        return out * mask

    return b.with_columns(
        {"advantages": column(0), "old_log_probs": column(1), "ref_log_probs": column(2)}
    )


def _engine(backend: str, path):
    if backend == "jax_pjit":
        eng = get_engine("jax_pjit")(devices=jax.devices()[:1])
    else:
        eng = get_engine("torch_fsdp")()
    eng.init(ModelConfig(str(path)), OPTIM, ParallelConfig(micro_batch_size=4))
    return eng


def _weights(engine):
    return {
        k: np.array(v.detach().float().cpu() if isinstance(v, torch.Tensor) else v)
        for bucket in engine.export_weights(1 << 22)
        for k, v in bucket
    }


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_masked_observations_equal_removed_observations(backend, tiny_model_dir):
    episodes = _episodes()
    masked, values = _masked_batch(episodes, np.random.default_rng(1))
    split = _split_batch(episodes, values)
    a, b = _engine(backend, tiny_model_dir), _engine(backend, tiny_model_dir)

    lp_masked = a.forward(masked, temperature=TEMPERATURE, entropy=True)
    lp_split = b.forward(split, temperature=TEMPERATURE, entropy=True)
    mask = masked["response_mask"] > 0
    # every observation token's log-prob and entropy are 0; the sampled ones equal the split's
    assert not lp_masked["log_probs"][~mask].any() and not lp_masked["entropy"][~mask].any()
    got = lp_masked["log_probs"][mask]
    want = lp_split["log_probs"][split["response_mask"] > 0]
    np.testing.assert_allclose(got, want, atol=TOL)

    m_masked = a.train_step(masked, LOSS, temperature=TEMPERATURE, entropy=True)
    m_split = b.train_step(split, LOSS, temperature=TEMPERATURE, entropy=True)
    assert m_masked["global_tokens"] == m_split["global_tokens"] == mask.sum()
    for key in ("loss", "pg_loss", "kl_loss", "entropy"):
        assert m_masked[key] == pytest.approx(m_split[key], abs=TOL), key
    assert m_masked["grad_norm"] == pytest.approx(m_split["grad_norm"], rel=1e-4)
    w_masked, w_split = _weights(a), _weights(b)
    diff = np.concatenate([np.abs(w_masked[k] - w).ravel() for k, w in w_split.items()])
    assert np.mean(diff > TOL_WEIGHTS) < 1e-3 and diff.max() <= 2 * OPTIM.lr
