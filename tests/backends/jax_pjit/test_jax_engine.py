"""JaxPjitEngine: resume, export, compile bound, offload, errors, and (slow) more meshes.

Equivalence classes: 1 device = (4,1,1) = (1,4,1) meshes (slow; the default tier's mesh
and micro-batch invariance is the contract suite's, tests/backends/test_contract.py),
resume = no resume, exported weights = what transformers computes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

from torch_fsdp_helpers import assert_same_calls  # noqa: E402

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends.hf_dir import write_hf  # noqa: E402
from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.backends.jax_pjit.weights import export_buckets  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from polyrl.weight_sync import to_torch  # noqa: E402

# GRPO's actor loss (PPO clip + k3 KL) with an entropy bonus: the loss a run would use.
LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
OPTIM = OptimConfig(
    lr=1e-2, weight_decay=0.1, grad_clip=0.5, warmup_steps=2, total_steps=10, schedule="cosine"
)
# fp32; different meshes/micro-batchings reorder the reductions (all-reduce trees, gradient
# sums over micro-batches), so results agree to a few ulps of the O(1) values involved.
TOL_MESH = 2e-5
# Adam divides each gradient element by its own magnitude, so an element whose gradient
# is tiny turns the rounding noise above into a relative error of its update (at most
# lr): weights after one step agree to 1% of the learning rate.
TOL_WEIGHTS = 1e-2 * OPTIM.lr


def _engine(path, mesh=None, mbs=8, role="actor", optim=OPTIM):
    parallel = ParallelConfig(
        mesh=mesh or {"data": 1, "fsdp": 1, "tensor": 1}, micro_batch_size=mbs
    )
    eng = JaxPjitEngine(devices=jax.devices()[: parallel.world_size])
    eng.init(ModelConfig(str(path), role=role), optim, parallel)
    return eng


def _rl_batch(seed=0, n=8, max_prompt=9, max_resp=12):
    """A rollout-like batch: ragged prompts/responses plus the columns GRPO's loss reads."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 58, rng.integers(1, max_prompt + 1))) for _ in range(n)]
    resps = [list(rng.integers(3, 58, rng.integers(1, max_resp + 1))) for _ in range(n)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    # old/ref log-probs near a plausible value so ratios span the clip range
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    ref = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (n, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": ref, "advantages": adv})


@contextlib.contextmanager
def _compilations():
    """The durations of the XLA compilations JAX reports inside the block."""
    compiled = []

    def listen(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _flat_weights(eng):
    return {k: np.asarray(v) for bucket in eng.export_weights(1 << 20) for k, v in bucket}


def _step(eng, batch):
    m = eng.train_step(batch, LOSS, entropy=True)
    return m, _flat_weights(eng)


def _check_invariance(tiny_model_dir, cases):
    batch = _rl_batch()
    ref_metrics, ref_weights = _step(_engine(tiny_model_dir, mbs=8), batch)
    assert ref_metrics["loss"] != 0 and ref_metrics["grad_norm"] > OPTIM.grad_clip  # clip active
    for mesh, mbs in cases:
        metrics, weights = _step(_engine(tiny_model_dir, mesh=mesh, mbs=mbs), batch)
        for key in ("loss", "grad_norm", "pg_loss", "kl_loss", "entropy", "clipfrac"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=TOL_MESH), (mesh, mbs, key)
        for name, w in ref_weights.items():
            np.testing.assert_allclose(
                weights[name], w, atol=TOL_WEIGHTS, err_msg=f"{mesh} {mbs} {name}"
            )


@pytest.mark.slow
def test_mesh_and_micro_batch_invariance_all_meshes(tiny_model_dir):
    _check_invariance(tiny_model_dir, [({"data": 4}, 2), ({"fsdp": 4}, 1), (None, 1)])


def test_resume_is_exact(tiny_model_dir, tmp_path):
    b1, b2, b3 = (_rl_batch(seed=s) for s in (1, 2, 3))
    # saved from a (1, 2, 2) mesh, resumed on one device: the checkpoint reshards
    run = _engine(tiny_model_dir, mesh={"fsdp": 2, "tensor": 2}, mbs=2)
    run.train_step(b1, LOSS, entropy=True)
    run.save(str(tmp_path / "ckpt"))
    want = [run.train_step(b, LOSS, entropy=True) for b in (b2, b3)]
    # resume into a fresh engine: everything must come from the checkpoint
    resumed = _engine(tiny_model_dir, mbs=8)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    got = [resumed.train_step(b, LOSS, entropy=True) for b in (b2, b3)]
    for w, g in zip(want, got):
        assert g["lr"] == w["lr"] and g["loss"] == pytest.approx(w["loss"], abs=TOL_MESH)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], abs=TOL_MESH)
    for name, w in run.params.items():  # the next steps' weights equal the uninterrupted run's
        np.testing.assert_allclose(
            np.asarray(resumed.params[name]), np.asarray(w), atol=TOL_WEIGHTS
        )


def test_checkpoint_with_the_old_kernel_layout_is_refused_naming_it(tiny_model_dir, tmp_path):
    """A checkpoint from before linear weights were kept [out, in] (``.kernel`` [in, out])
    is refused with the reason, not a key mismatch from inside orbax."""
    from polyrl.backends.jax_pjit import checkpoint

    eng = _engine(tiny_model_dir, role="reference", optim=None)
    linear = lambda k: k.endswith("_proj.weight")  # noqa: E731
    params = {k: v for k, v in eng.params.items() if not linear(k)}
    params |= {k.removesuffix("weight") + "kernel": v.T for k, v in eng.params.items() if linear(k)}
    info = {"step": 0, "mesh": dict(eng.parallel.mesh), **eng._identity()}
    checkpoint.save_state(tmp_path / "old", {**eng._state(), "params": params}, info)
    with pytest.raises(ValueError, match=r"stores linear layers as \[in, out\] `\.kernel`"):
        eng.load(str(tmp_path / "old"))


def test_export_loads_in_transformers_with_the_same_log_probs(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    eng = _engine(tiny_model_dir)
    eng.train_step(_rl_batch(), LOSS, entropy=True)
    buckets = list(eng.export_weights(bucket_bytes=64 * 1024))
    assert len(buckets) > 1  # ~1.7 MB of weights in 64 KiB buckets
    with safe_open(str(tiny_model_dir / "model.safetensors"), "np") as f:
        hf_keys = set(f.keys())
    assert {k for b in buckets for k, _ in b} == hf_keys  # the keys save_pretrained writes
    out = write_hf(buckets, tiny_model_dir, tmp_path / "exported")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = _rl_batch(seed=5)
    with torch.no_grad():
        logits = hf(
            input_ids=torch.as_tensor(batch["input_ids"]).long(),
            attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
            position_ids=torch.as_tensor(batch["position_ids"]).long(),
        ).logits
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    want = (
        torch.log_softmax(logits[:, p - 1 : p - 1 + r], -1)
        .gather(-1, torch.as_tensor(batch["responses"]).long()[..., None])[..., 0]
        .numpy()
    )
    # fp32 forward in two frameworks (see test_jax_models.TOL_TINY)
    np.testing.assert_allclose(
        eng.forward(batch)["log_probs"], want * batch["response_mask"], atol=2e-5
    )


def test_packed_export_equals_packing_the_exported_arrays(tiny_model_dir):
    """CUDA IPC / NCCL pack a JAX export bucket from its source arrays in one program
    (casts and bytes at once); the flat buffer and its metadata equal packing the
    bucket's exported (name, array) pairs, byte for byte in every tensor's place, in bf16
    (a cast) and fp32, where each tensor is the parameter as stored (HF's layout: nothing
    transposed)."""
    from polyrl.weight_sync import pack_flat, unpack_flat

    eng = _engine(tiny_model_dir)
    eng.train_step(_rl_batch(), LOSS, entropy=True)
    for dtype in ("bfloat16", None):
        for bucket in export_buckets(eng.params, 64 * 1024, dtype=dtype):
            fused, metas = pack_flat(bucket)
            plain, plain_metas = pack_flat(list(bucket))
            assert metas == plain_metas
            # each tensor's bytes; the alignment padding between them is left unwritten
            # (both packers write into torch.empty), so it holds whatever the memory held
            for *_, offset, nbytes in metas:
                assert torch.equal(fused[offset : offset + nbytes], plain[offset : offset + nbytes])
            for (name, x), (got, t) in zip(bucket, unpack_flat(fused, metas)):
                assert got == name and tuple(t.shape) == x.shape
                assert str(t.dtype).endswith(str(x.dtype))
                if dtype is None:
                    np.testing.assert_array_equal(t.numpy(), np.asarray(eng.params[name]))


def test_to_torch_is_zero_copy_on_cpu(tiny_model_dir):
    eng = _engine(tiny_model_dir, role="reference", optim=None)
    bucket = next(eng.export_weights(1 << 30))
    for name, x in bucket:
        t = to_torch(x)
        assert tuple(t.shape) == x.shape, name
        assert t.data_ptr() == x.unsafe_buffer_pointer()  # same memory: no host round-trip
        np.testing.assert_array_equal(t.numpy(), np.asarray(x))


def test_compile_count_is_bounded_over_varied_lengths(tiny_model_dir):
    eng = _engine(tiny_model_dir, mbs=8)
    eng.train_step(_rl_batch(seed=0, max_prompt=16, max_resp=16), LOSS, entropy=True)
    after_first = eng.compile_count
    # zero_grads, grad step, apply step, optimizer init
    assert after_first <= 4
    for seed in range(1, 5):  # new lengths (all <= 16, the first bucket), 6-9 samples
        eng.train_step(
            _rl_batch(seed=seed, n=5 + seed, max_prompt=16, max_resp=16), LOSS, entropy=True
        )
    assert eng.compile_count == after_first
    eng.train_step(
        _rl_batch(seed=9, max_prompt=16, max_resp=30), LOSS, entropy=True
    )  # R -> bucket 32
    assert eng.compile_count == after_first + 1  # only the grad step sees a new shape


def test_forward_backward_pads_each_micro_batch_to_its_own_rows(tiny_model_dir):
    """forward_backward (the Tinker service's call) pads each micro-batch of
    micro_batch_size rows to its own rows' lengths (powers of two >= 16): four 1-token
    prompts with 10-token responses, then four with 40-token ones, run as [4, 16 + 16]
    and [4, 16 + 64] (before: both [4, 16 + 64]). train_step and forward keep the whole
    batch's shape (one program, which a run's warm-up compiles). Its log-probs equal
    each half's alone."""
    from polyrl.algos.tinker_losses import tinker_loss

    prompts = [[5]] * 8
    resps = [list(range(3, 13))] * 4 + [list(range(3, 43))] * 4
    batch = from_token_lists(prompts, resps, pad_id=0)
    eng = _engine(tiny_model_dir, mbs=4)
    for trim, want in ((True, [(32, 16), (80, 64)]), (False, [(80, 64), (80, 64)])):
        parts = eng._micro_batches(batch, trim=trim)
        assert [idx.tolist() for idx, _ in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        shapes = [(a["input_ids"].shape, a["responses"].shape) for _, a in parts]
        assert shapes == [((4, t), (4, r)) for t, r in want], trim
    weighted = batch.with_columns({"weights": batch["response_mask"].astype(np.float32)})
    traced = eng.compile_count
    whole = eng.forward_backward(weighted, tinker_loss("cross_entropy"))["log_probs"]
    assert eng.compile_count == traced + 3  # zeroed gradients, a grad step for each shape
    short = eng.forward(from_token_lists(prompts[:4], resps[:4], pad_id=0))["log_probs"]
    long = eng.forward(from_token_lists(prompts[4:], resps[4:], pad_id=0))["log_probs"]
    np.testing.assert_allclose(whole[:4, :10], short, atol=1e-6)
    np.testing.assert_allclose(whole[4:], long, atol=1e-6)
    assert not whole[:4, 10:].any()


def test_forward_backward_with_an_equal_loss_compiles_once(tiny_model_dir):
    """The Tinker service builds a new loss object per request (and Ray sends a copy):
    an equal one finds the same jitted step, so a second forward_backward + optim_step of
    the same shapes compiles nothing (counted by JAX's compile events, not timed)."""
    from polyrl.algos.tinker_losses import tinker_loss

    eng = _engine(tiny_model_dir, mbs=4)
    batch = _rl_batch(n=4).with_columns({"sampling_logprobs": _rl_batch(n=4)["old_log_probs"]})
    optim = OptimConfig(lr=1e-3)
    eng.forward_backward(batch, tinker_loss("ppo", {"clip_low_threshold": 0.7}))
    eng.optim_step(optim)
    traced = eng.compile_count
    with _compilations() as compiled:
        eng.forward_backward(batch, tinker_loss("ppo", {"clip_low_threshold": 0.7}))
        eng.optim_step(optim)
    assert eng.compile_count == traced and not compiled


def test_offload_reload_round_trip(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    batch = _rl_batch()
    before = eng.forward(batch)["log_probs"]
    eng.offload()
    assert eng.params is None
    with pytest.raises(RuntimeError, match="offloaded; call reload"):
        eng.train_step(batch, LOSS, entropy=True)
    eng.reload()
    np.testing.assert_array_equal(eng.forward(batch)["log_probs"], before)
    assert np.isfinite(eng.train_step(batch, LOSS, entropy=True)["loss"])


def test_frozen_reference_cannot_train(tiny_model_dir):
    eng = _engine(tiny_model_dir, role="reference", optim=None)
    with pytest.raises(RuntimeError, match="frozen 'reference' role.*optim=None"):
        eng.train_step(_rl_batch(), LOSS, entropy=True)


def test_role_and_optimizer_must_agree(tiny_model_dir):
    with pytest.raises(ValueError, match="role 'reference' got optim=.*need optim=None"):
        _engine(tiny_model_dir, role="reference", optim=OPTIM)


def test_mesh_not_matching_devices_shows_the_arithmetic(tiny_model_dir):
    eng = JaxPjitEngine()  # all 4 devices
    with pytest.raises(
        ValueError, match=r"data=2 x fsdp=1 x tensor=1 = 2 devices, but 4 are available"
    ):
        eng.init(ModelConfig(str(tiny_model_dir)), OPTIM, ParallelConfig(mesh={"data": 2}))


def test_column_of_unknown_length_is_named(tiny_model_dir):
    """train_step pads every column for its loss; a forward reads the model's alone."""
    eng = _engine(tiny_model_dir)
    batch = _rl_batch()
    bad = batch.with_columns({"weird": np.zeros((len(batch), 3), np.float32)})
    with pytest.raises(ValueError, match=r"column 'weird' has shape \(8, 3\)"):
        eng.train_step(bad, LOSS, entropy=True)
    np.testing.assert_array_equal(eng.forward(bad)["log_probs"], eng.forward(batch)["log_probs"])


def test_a_warm_up_compiles_ahead_and_changes_nothing(tiny_model_dir):
    """``warm_up`` (RunConfig.warm_up) lowers and compiles every program of the first
    forward and train step without running them: the calls that follow trace and
    compile nothing (JAX reports no compilation), and the step equals one without it."""
    batch = _rl_batch(n=12)  # 2 micro-batches of 8 rows (the second padded)
    kwargs = {"temperature": 0.7, "entropy": True}
    warm = _engine(tiny_model_dir)
    before, traced = _flat_weights(warm), warm.compile_count
    warm.warm_up("forward", batch, **kwargs)
    warm.warm_up("train_step", batch, LOSS, **kwargs)
    assert warm.compile_count > traced, "the warm-up compiled nothing"
    assert warm.step == 0
    after = _flat_weights(warm)
    assert all(np.array_equal(after[k], before[k]) for k in before)
    traced = warm.compile_count
    with _compilations() as compiled:
        out = warm.forward(batch, **kwargs), warm.train_step(batch, LOSS, **kwargs)
    assert warm.compile_count == traced and not compiled, "the first calls compiled more"
    cold = _engine(tiny_model_dir)
    expected = cold.forward(batch, **kwargs), cold.train_step(batch, LOSS, **kwargs)
    assert_same_calls(out, expected, _flat_weights(warm), _flat_weights(cold))
