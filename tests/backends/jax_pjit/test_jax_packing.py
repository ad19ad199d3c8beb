"""JAX attention within segments (backends/jax_pjit/attention.py) and sequence packing
(ParallelConfig.pack_sequences, shapes.pack_rows): layouts by hand, the attention
against a dense softmax written here, packed engine = padded engine. The gpu test
checks cuDNN's packed-layout flash attention against XLA on CUDA and that it is the
kernel in the compiled program."""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends.jax_pjit import attention  # noqa: E402
from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.backends.jax_pjit.shapes import pack_rows, pad_batch  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
OPTIM = OptimConfig(lr=1e-2, grad_clip=0.5)
# fp32: packing changes matmul shapes and which rows share a softmax call only
TOL = 2e-5
TOL_WEIGHTS = 1e-2 * OPTIM.lr  # Adam's per-element normalisation (test_jax_engine.py)


def dense(q, k, v, seg):
    """The old einsum attention, written out: softmax over keys with the same non-zero
    segment id at or before the query, GQA by repeating key/value heads; 0 at padding."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    ok = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0) & np.tri(t, dtype=bool)
    scores = np.where(ok[:, None], scores, -np.inf)
    top = np.max(scores, -1, keepdims=True)
    probs = np.exp(scores - np.where(np.isfinite(top), top, 0))
    with np.errstate(invalid="ignore"):  # padded queries: 0 / 0, zeroed below
        probs = np.nan_to_num(probs / probs.sum(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", probs, v) * (seg != 0)[:, :, None, None]


SEGMENTS = np.array(
    [
        [0, 0, 1, 1, 1, 1, 0, 0],  # a padded row: left and right padding
        [1, 1, 1, 2, 2, 3, 3, 0],  # a packed row of three sequences
    ]
)


def test_segment_bounds_by_hand():
    starts, lengths = attention.segment_bounds(jnp.asarray(SEGMENTS), 3)
    assert starts.tolist() == [[2, -1, -1, -1], [0, 3, 5, -1]]
    assert lengths.tolist() == [[4, -1, -1], [3, 2, 2]]


def test_xla_attention_equals_dense_softmax():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 8, 4, 16)).astype(np.float32)
    k, v = (rng.normal(size=(2, 8, 2, 16)).astype(np.float32) for _ in range(2))
    got = attention.attend(q, k, v, jnp.asarray(SEGMENTS), scale=0.25, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), dense(q, k, v, SEGMENTS), atol=1e-6)


@pytest.mark.parametrize("padded", [False, True], ids=["segments", "padding-block"])
def test_xla_blocks_equal_dense_softmax_and_xla_gradients(padded):
    """Query blocks of 3 (the last one short) over 8 positions, each against the keys up
    to its last query; with ``padded`` a 9th column and two more columns of padding in
    both rows, so that positions 6-8 are a block of padding in every row (skipped). The
    dense softmax's outputs, and XLA's gradients with respect to q, k and v."""
    segments = (
        np.pad(SEGMENTS, ((0, 0), (0, 1)))[:, [0, 1, 2, 3, 4, 5, 8, 8, 8]] if padded else SEGMENTS
    )
    rng = np.random.default_rng(1)
    t = segments.shape[1]
    q = rng.normal(size=(2, t, 4, 16)).astype(np.float32)
    k, v = (rng.normal(size=(2, t, 2, 16)).astype(np.float32) for _ in range(2))
    seg = jnp.asarray(segments)
    blocks = partial(attention.attend, scale=0.25, implementation="xla_blocks", block=3)
    np.testing.assert_allclose(
        np.asarray(blocks(q, k, v, seg)), dense(q, k, v, segments), atol=1e-6
    )
    w = rng.normal(size=q.shape).astype(np.float32)  # a loss that weighs every output

    def grads(implementation):
        fn = partial(attention.attend, scale=0.25, implementation=implementation, block=3)
        return jax.grad(lambda *x: (fn(*x, seg) * w).sum(), (0, 1, 2))(q, k, v)

    for got, want in zip(grads("xla_blocks"), grads("xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_cudnn_refusal_while_tracing_falls_back_or_names_the_field():
    """Without cuDNN (this CPU) the kernel refuses while the step is traced: ``auto`` runs
    XLA and records why, a forced ``cudnn`` is an error naming the setting."""
    if jax.devices()[0].platform == "gpu":
        pytest.skip("cuDNN may run here; test_cudnn_attention_matches_xla_on_gpu covers it")
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(2, 8, 4, 16)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.bfloat16) for _ in range(2))
    seg = jnp.asarray(SEGMENTS)
    before = sum(attention.fallbacks.values())
    auto = attention.attend(q, k, v, seg, scale=0.25, implementation="auto", slots=3)
    xla = attention.attend(q, k, v, seg, scale=0.25, implementation="xla")
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(xla, np.float32))
    assert sum(attention.fallbacks.values()) == before + 1
    with pytest.raises(ValueError, match="attn_implementation='cudnn': cuDNN cannot run"):
        attention.attend(q, k, v, seg, scale=0.25, implementation="cudnn", slots=3)


def test_pack_rows_by_hand():
    b = from_token_lists([[5, 6], [7], [8, 9, 4]], [[10], [11, 12, 13], [14, 15]], pad_id=0)
    b = b.with_columns({"advantages": np.ones(b["responses"].shape, np.float32)})
    padded = pad_batch(b, 4, 1).arrays  # 4 rows (one empty), P = 4, R = 4
    packed = pack_rows(padded, shards=2, min_len=1)
    # shard 0: samples 0, 1 = (5 6 10) (7 11 12 13); shard 1: sample 2 (8 9 4 14 15), row 3 empty
    assert packed["packed_ids"].tolist() == [
        [5, 6, 10, 7, 11, 12, 13, 0],
        [8, 9, 4, 14, 15] + [0] * 3,
    ]
    assert packed["packed_positions"].tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0],
        [0, 1, 2, 3, 4, 0, 0, 0],
    ]
    assert packed["packed_segments"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 0], [1] * 5 + [0] * 3]
    # response t of sample 0 is predicted at 1 (+ t); sample 1 at 3, 4, 5; sample 2 at 2, 3;
    # columns past a response repeat a real position of its sample (masked later); the
    # empty row points at its shard's padding (5)
    assert packed["packed_index"].tolist() == [[1, 2, 2, 2], [3, 4, 5, 6], [2, 3, 4, 4], [5] * 4]
    assert packed["packed_last"].tolist() == [2, 6, 4, 5]
    assert set(packed) >= {"responses", "response_mask", "advantages"}
    assert not set(packed) & {"input_ids", "attention_mask", "position_ids"}


def test_cudnn_forced_off_gpu_is_a_named_error_and_auto_falls_back(caplog):
    with pytest.raises(ValueError, match="attn_implementation='cudnn': platform is 'cpu'"):
        attention.resolve("cudnn", "cpu", jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        assert attention.resolve("auto", "gpu", jnp.float32) == "xla"
    assert attention.fallbacks["compute dtype is float32, cuDNN attention needs bfloat16/float16"]
    assert attention.resolve("auto", "gpu", jnp.bfloat16) == "auto"
    assert attention.resolve("xla", "gpu", jnp.bfloat16) == "xla"
    # the default means cuDNN where it applies; the torch backend's other names mean XLA
    assert attention.resolve("sdpa", "gpu", jnp.bfloat16) == "auto"
    # on CPU XLA runs in query blocks
    assert attention.resolve("sdpa", "cpu", jnp.bfloat16) == "xla_blocks"
    assert attention.resolve("xla", "cpu", jnp.float32) == "xla_blocks"
    for name in ("polyrl_varlen", "flash_attention_2"):
        assert attention.resolve(name, "gpu", jnp.bfloat16) == "xla"
    # a probe that fails (here: no cuDNN on this CPU) turns auto into XLA, cudnn into an error
    probe = (jax.devices()[0], 4, 2, 16)
    if jax.devices()[0].platform != "gpu":
        assert attention.probe_cudnn(*probe, dtype=jnp.bfloat16).startswith("cuDNN probe failed")
        assert attention.resolve("auto", "gpu", jnp.bfloat16, probe=probe) == "xla"
        with pytest.raises(ValueError, match="attn_implementation='cudnn': cuDNN probe failed"):
            attention.resolve("cudnn", "gpu", jnp.bfloat16, probe=probe)


def test_cudnn_wrapper_drops_what_the_kernel_leaves_at_padding(monkeypatch):
    """cuDNN's packed kernel writes nothing outside the sequences: neither the output nor
    dq/dk/dv there. Stand in for it with XLA attention whose output and input gradients
    are NaN at those positions (what unwritten memory can hold): the wrapper's output and
    gradients must still equal plain XLA attention's (a left-padded row and a packed one)."""
    from jax._src.cudnn import fused_attention_stablehlo as kernel

    seg = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    outside = (seg == 0)[:, :, None, None]

    def poison(x):
        return jnp.where(outside, jnp.nan, x)

    @jax.custom_vjp
    def fake(q, k, v):
        return poison(attention.attend(q, k, v, seg, scale=0.5, implementation="xla"))

    def fwd(q, k, v):
        return fake(q, k, v), (q, k, v)

    def bwd(res, g):
        _, vjp = jax.vjp(
            lambda *a: attention.attend(*a, seg, scale=0.5, implementation="xla"), *res
        )
        return tuple(poison(x) for x in vjp(g))

    fake.defvjp(fwd, bwd)
    monkeypatch.setattr(kernel, "dot_product_attention", lambda q, k, v, **_: fake(q, k, v))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 8, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 8, 4, 8)), jnp.float32) for _ in range(2))

    def loss(impl, q, k, v):
        out = attention.attend(q, k, v, seg, scale=0.5, implementation=impl, slots=2)
        return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum()

    want = jax.value_and_grad(partial(loss, "xla"), (0, 1, 2))(q, k, v)
    got = jax.value_and_grad(partial(loss, "cudnn"), (0, 1, 2))(q, k, v)
    assert np.isfinite(float(got[0])) and all(np.isfinite(np.asarray(g)).all() for g in got[1])
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


NO_GPU = (
    "JAX sees no GPU (tests/conftest.py pins JAX_PLATFORMS=cpu unless set: JAX_PLATFORMS=cuda,cpu)"
)


def _batch(n=7, seed=2):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 58, rng.integers(1, 8))) for _ in range(n)]
    resps = [list(rng.integers(3, 58, rng.integers(1, 10))) for _ in range(n)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (n, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": old, "advantages": adv})


def _engine(path, pack: bool, mesh: dict, **parallel):
    parallel = ParallelConfig(mesh=mesh, micro_batch_size=4, pack_sequences=pack, **parallel)
    eng = JaxPjitEngine(devices=jax.devices()[: parallel.world_size])
    eng.init(ModelConfig(str(path)), OPTIM, parallel)
    return eng


def _run(eng, batch):
    fwd = eng.forward(batch, temperature=0.8, entropy=True)
    metrics = eng.train_step(batch, LOSS, temperature=0.8, entropy=True)
    return fwd, metrics, {k: np.asarray(v) for b in eng.export_weights(1 << 20) for k, v in b}


@pytest.mark.parametrize(
    "mesh,extra",
    [
        ({"data": 2}, {}),
        pytest.param({"data": 2}, {"max_tokens_per_micro_batch": 40}, marks=pytest.mark.slow),
    ],
    ids=["two-shards", "two-shards-token-budget"],  # one shard: the contract suite
)
def test_packed_equals_padded(tiny_model_dir, mesh, extra):
    batch = _batch()
    fwd_a, m_a, w_a = _run(_engine(tiny_model_dir, False, mesh, **extra), batch)
    fwd_b, m_b, w_b = _run(_engine(tiny_model_dir, True, mesh, **extra), batch)
    for key in ("log_probs", "entropy"):
        np.testing.assert_allclose(fwd_b[key], fwd_a[key], atol=TOL)
    for key in ("loss", "grad_norm", "pg_loss", "entropy"):
        assert m_b[key] == pytest.approx(m_a[key], abs=TOL), key
    assert m_a["grad_norm"] > OPTIM.grad_clip  # the clip is exercised
    for name, w in w_a.items():
        np.testing.assert_allclose(w_b[name], w, atol=TOL_WEIGHTS, err_msg=name)


def test_packed_reward_scores_equal_padded(tiny_model_dir):
    batch = _batch(5, seed=4)
    out = []
    for pack in (False, True):
        eng = JaxPjitEngine(devices=jax.devices()[:1])
        eng.init(
            ModelConfig(str(tiny_model_dir), role="reward_model"),
            None,
            ParallelConfig(micro_batch_size=4, pack_sequences=pack),
        )
        out.append(eng.forward(batch))
    for key in ("values", "scores"):
        np.testing.assert_allclose(out[1][key], out[0][key], atol=TOL)


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_on_gpu():
    if jax.devices()[0].platform != "gpu":
        pytest.skip(NO_GPU)
    rng = np.random.default_rng(1)
    t = 256
    seg = np.zeros((2, t), np.int32)
    seg[0, 40:200] = 1  # padded row (left and right padding)
    seg[1, :100], seg[1, 100:101], seg[1, 101:230] = 1, 2, 3  # packed row
    q = jnp.asarray(rng.normal(size=(2, t, 12, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 128)), jnp.bfloat16) for _ in range(2))

    def loss(impl, q, k, v):
        out = attention.attend(q, k, v, jnp.asarray(seg), scale=0.1, implementation=impl, slots=3)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    before = dict(attention.fallbacks)
    fast = jax.jit(jax.value_and_grad(lambda *a: loss("cudnn", *a), (0, 1, 2), has_aux=True))
    # cuDNN's fused attention is the kernel in the program (forward and backward)
    program = fast.lower(q, k, v).as_text()
    assert "__cudnn$fmhaSoftmax" in program and "__cudnn$fmhaSoftmaxBackward" in program
    assert dict(attention.fallbacks) == before
    (_, out_fast), grads_fast = fast(q, k, v)
    slow = jax.value_and_grad(lambda *a: loss("xla", *a), (0, 1, 2), has_aux=True)
    (_, out_ref), grads_ref = jax.jit(slow)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(out_fast, np.float32), np.asarray(out_ref, np.float32), atol=2e-2, rtol=2e-2
    )
    for g_fast, g_ref in zip(grads_fast, grads_ref):
        g_fast, g_ref = np.asarray(g_fast, np.float32), np.asarray(g_ref, np.float32)
        assert np.abs(g_fast - g_ref).max() <= 3e-2 * np.abs(g_ref).max()


@pytest.mark.gpu
def test_cuda_engine_packed_cudnn_equals_padded_xla(tiny_model_dir):
    """The whole path on a GPU in bf16: packed rows through cuDNN give the padded XLA
    engine's log-probs and loss to bf16 precision."""
    if jax.devices()[0].platform != "gpu":
        pytest.skip(NO_GPU)
    batch = _batch(8, seed=6)

    def engine(attn, pack):
        eng = JaxPjitEngine(devices=jax.devices()[:1])
        eng.init(
            ModelConfig(str(tiny_model_dir), dtype="bfloat16", attn_implementation=attn),
            OPTIM,
            ParallelConfig(micro_batch_size=4, pack_sequences=pack),
        )
        return eng

    xla, fast = engine("xla", False), engine("cudnn", True)
    assert fast.attention == "cudnn"  # the start-up probe passed
    assert attention.probe_cudnn(jax.devices()[0], 4, 2, 32, jnp.bfloat16) is None
    fwd_a, m_a, _ = _run(xla, batch)
    fwd_b, m_b, _ = _run(fast, batch)
    # bf16 (attention kernels round differently); attending across sequences or to
    # padding would move log-probs by O(1)
    np.testing.assert_allclose(fwd_b["log_probs"], fwd_a["log_probs"], atol=0.1)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=5e-2, abs=5e-2)
