"""The TrainEngine contract (backends/base.py), run once per entry of ``ENGINES``.

Every promise of the protocol is checked on each registered backend, on the tiny model:
init/frozen roles, temperature and entropy, padding, value heads, export, save/load,
offload/reload, the non-finite skip, the speed-and-memory knobs that must not change the
update (micro-batching, the mesh, sequence packing, recompute) and the process model. All
in process, except torch's world size above one, which needs a process per rank. A new
backend joins by adding its in-process constructor to ``BUILD``, its meshes to ``MESHES``
and its process model to ``PROCESS`` (the first test fails until it does), so two backends
cannot drift apart silently.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from polyrl import faults  # noqa: E402
from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.backends.base import ENGINES, GroupSlot, TrainEngine, engine_on_one_device  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.checkpoints import CheckpointMismatch  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

# In-process constructor per backend: a world of one torch rank / one JAX device.
BUILD = {
    "torch_fsdp": lambda cls: cls(),
    "jax_pjit": lambda cls: cls(devices=jax.devices()[:1]),
}
BACKENDS = sorted(ENGINES)
ACTOR_LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.0)
CRITIC_LOSS = get_algorithm("ppo").make_critic_loss()
# eps=1e-4: Adam's first update lr * g / (|g| + eps) turns fp32 summation-order noise of
# near-zero gradient entries into up to lr-sized weight differences with eps=1e-8; 1e-4
# bounds it at ~1e-7 so padded and unpadded batches can be compared (torch_fsdp_helpers).
OPTIM = OptimConfig(lr=1e-3, eps=1e-4)
VOCAB = 58  # real tokens of the tiny tokenizer


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/backends/torch_fsdp/conftest.py
    yield
    torch.set_num_threads(before)


def engine(backend, path, role="actor", optim=OPTIM, micro=4, model=None, **parallel):
    """``model``: other ModelConfig fields; ``parallel``: other ParallelConfig fields."""
    eng = BUILD[backend](get_engine(backend))
    eng.init(
        ModelConfig(str(path), role=role, **(model or {})),
        optim,
        ParallelConfig(micro_batch_size=micro, **parallel),
    )
    return eng


def rl_batch(n=6, seed=0):
    """Ragged prompts/responses with fixed widths (one compiled shape for JAX)."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, VOCAB, rng.integers(1, 7))) for _ in range(n)]
    resps = [list(rng.integers(3, VOCAB, rng.integers(1, 6))) for _ in range(n)]
    b = from_token_lists(prompts, resps, pad_id=0, prompt_len=8, response_len=8)
    shape, mask = b["responses"].shape, b["response_mask"]
    cols = {
        "old_log_probs": (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32),
        "ref_log_probs": (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32),
        "advantages": (np.repeat(rng.normal(0, 1, (n, 1)), shape[1], 1) * mask).astype(np.float32),
        "values": (rng.normal(0, 0.1, shape) * mask).astype(np.float32),
        "returns": (rng.normal(1, 0.5, shape) * mask).astype(np.float32),
    }
    return b.with_columns(cols)


def weights(eng) -> dict[str, np.ndarray]:
    return {
        k: np.array(v.detach().float().cpu() if isinstance(v, torch.Tensor) else v)
        for bucket in eng.export_weights(1 << 16)
        for k, v in bucket
    }


def optimizer_leaves(eng) -> list[np.ndarray]:
    """Every array of the engine's optimizer state (the one backend-specific peek)."""
    if hasattr(eng, "opt_state"):
        return [np.array(x) for x in jax.tree.leaves(eng.opt_state)]
    local = [v for s in eng.optimizer.state.values() for v in s.values()]
    return [np.array((v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()) for v in local]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_every_registered_backend_is_covered():
    assert set(BUILD) == set(ENGINES), "add the new backend's in-process constructor to BUILD"
    assert set(MESHES) == set(ENGINES), "add the new backend's multi-device runs to MESHES"
    assert set(PROCESS) == set(ENGINES), "add the new backend's process model to PROCESS"


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_roles_and_frozen_reference(backend, tiny_model_dir):
    with pytest.raises(ValueError, match="optim"):
        engine(backend, tiny_model_dir, role="actor", optim=None)
    with pytest.raises(ValueError, match="optim"):
        engine(backend, tiny_model_dir, role="reference", optim=OPTIM)
    ref = engine(backend, tiny_model_dir, role="reference", optim=None)
    assert isinstance(ref, TrainEngine)
    actor = engine(backend, tiny_model_dir)
    batch = rl_batch()
    # Both start from the checkpoint: the same log-probs, zero outside the response mask.
    out = ref.forward(batch)
    assert out["log_probs"].shape == batch["responses"].shape
    assert np.all(out["log_probs"][batch["response_mask"] == 0] == 0)
    assert np.all(out["log_probs"][batch["response_mask"] == 1] < 0)
    np.testing.assert_allclose(actor.forward(batch)["log_probs"], out["log_probs"], atol=1e-6)
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_step(batch, ACTOR_LOSS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_divides_the_logits_of_log_probs_and_entropy(backend, tiny_model_dir):
    """log_probs(T) = log_softmax(logits / T) at the response tokens and entropy(T) =
    -sum p log p of p = softmax(logits / T), from transformers' logits (written out here,
    in float64, not the backends' helpers)."""
    from transformers import AutoModelForCausalLM

    batch = rl_batch()
    mask = batch["response_mask"]
    eng = engine(backend, tiny_model_dir, role="reference", optim=None)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(
            input_ids=torch.as_tensor(batch["input_ids"]).long(),
            attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
            position_ids=torch.as_tensor(batch["position_ids"]).long(),
        ).logits[:, 7:15, :VOCAB]  # position P-1+t predicts response token t (P = 8)
    resp = torch.as_tensor(batch["responses"]).long()[..., None]
    for temperature in (0.5, 1.0, 2.0):
        logp = torch.log_softmax(logits.double() / temperature, -1)
        ref_lp = logp.gather(-1, resp)[..., 0].numpy()
        ref_ent = -(logp.exp() * logp).sum(-1).numpy()
        got = eng.forward(batch, temperature=temperature, entropy=True)
        # fp32, two implementations of the same network: a few ulps per layer, on values
        # of O(1) (entropy <= log 58 = 4.1).
        np.testing.assert_allclose(got["log_probs"], ref_lp * mask, atol=2e-5)
        np.testing.assert_allclose(got["entropy"], ref_ent * mask, atol=2e-5)
    assert "entropy" not in eng.forward(batch)  # only when asked for
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            eng.forward(batch, temperature=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_and_all_padding_batches(backend, tiny_model_dir):
    """is_pad rows change nothing; a batch with no valid token is refused, not trained."""
    batch = rl_batch()
    plain, padded = engine(backend, tiny_model_dir), engine(backend, tiny_model_dir)
    a = plain.train_step(batch, ACTOR_LOSS)
    b = padded.train_step(batch.pad_to_multiple(4), ACTOR_LOSS)  # 6 rows + 2 pads
    for key in ("loss", "grad_norm", "global_tokens", "global_seqs"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    np.testing.assert_allclose(
        np.concatenate([w.ravel() for w in weights(padded).values()]),
        np.concatenate([w.ravel() for w in weights(plain).values()]),
        atol=1e-6,
    )
    empty = batch.with_columns({"response_mask": np.zeros_like(batch["response_mask"])})
    assert not np.any(plain.forward(empty)["log_probs"])
    before = weights(plain)
    with pytest.raises(ValueError, match="response_mask"):
        plain.train_step(empty, ACTOR_LOSS)
    assert same(weights(plain), before)


def flat(named: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([w.ravel() for w in named.values()])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_then_optim_step_is_a_train_step(backend, tiny_model_dir):
    """The Tinker API's split step (polyrl.service): forward_backward returns forward's
    log-probs and, with optim_step under the same OptimConfig after it, updates the
    weights as one train_step does. With a summed loss (algos/tinker_losses.py) two
    forward_backward calls on the halves of a batch add up to one on the whole, and
    optim_step takes the hyper-parameters it is given: a learning rate of 0 changes
    nothing. After reset_optimizer the next step is a first step again."""
    from polyrl.algos.tinker_losses import TinkerLoss

    batch = rl_batch()
    whole, split = engine(backend, tiny_model_dir), engine(backend, tiny_model_dir)
    before = split.forward(batch)["log_probs"]
    out = split.forward_backward(batch, ACTOR_LOSS)
    np.testing.assert_allclose(out["log_probs"], before, atol=2e-5)
    want = whole.train_step(batch, ACTOR_LOSS)
    assert out["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert split.optim_step(OPTIM)["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    np.testing.assert_allclose(flat(weights(split)), flat(weights(whole)), atol=1e-6)

    summed = batch.with_columns({"weights": batch["response_mask"] * 0.5})
    ce = TinkerLoss("cross_entropy")
    other = OptimConfig(lr=1e-2, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1, grad_clip=None)
    halves, once, still = (engine(backend, tiny_model_dir) for _ in range(3))
    initial = weights(still)
    losses = [halves.forward_backward(summed.take(r), ce)["loss"] for r in ([0, 1, 2], [3, 4, 5])]
    got = once.forward_backward(summed, ce)
    # the loss is -sum(log_probs * weights), by hand from forward's log-probs
    assert got["loss"] == pytest.approx(-(before * summed["weights"]).sum(), rel=1e-5)
    assert sum(losses) == pytest.approx(got["loss"], rel=1e-5)
    a, b = halves.optim_step(other), once.optim_step(other)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4) and b["lr"] == 1e-2
    # atol: lr x Adam's first step on summation-order noise (eps=1e-4, as OPTIM's)
    np.testing.assert_allclose(flat(weights(halves)), flat(weights(once)), atol=1e-5)
    assert not np.allclose(flat(weights(once)), flat(initial), atol=1e-4)
    still.forward_backward(summed, ce)
    still.optim_step(OptimConfig(lr=0.0))
    np.testing.assert_array_equal(flat(weights(still)), flat(initial))

    # reset_optimizer: the next step is a first step again (no moments, bias correction
    # from the start), as that of an engine whose weights were never stepped
    fresh = engine(backend, tiny_model_dir)
    fresh.set_weights(weights(once))
    once.reset_optimizer()
    for eng in (once, fresh):
        eng.forward_backward(summed, ce)
        eng.optim_step(other)
    np.testing.assert_allclose(flat(weights(once)), flat(weights(fresh)), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_heads(backend, tiny_model_dir):
    batch = rl_batch()
    critic = engine(backend, tiny_model_dir, role="critic")
    out = critic.forward(batch)
    assert set(out) == {"values", "scores"} and out["values"].shape == batch["responses"].shape
    assert out["scores"].shape == (len(batch),)  # a reward model in training reads these
    assert np.all(out["values"][batch["response_mask"] == 0] == 0)
    losses = [critic.train_step(batch, CRITIC_LOSS)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses  # the head fits the returns
    reward = engine(backend, tiny_model_dir, role="reward_model", optim=None)
    scores = reward.forward(batch)
    assert scores["scores"].shape == (len(batch),)


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_gives_the_checkpoint_under_hf_names(backend, tiny_model_dir):
    from safetensors.numpy import load_file

    hf = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    eng = engine(backend, tiny_model_dir)
    sizes = [
        sum(t.numel() * 4 if isinstance(t, torch.Tensor) else t.nbytes for _, t in b)
        for b in eng.export_weights(1 << 14)
    ]
    assert len(sizes) > 1  # several buckets: the size bound is exercised
    got = weights(eng)
    assert set(got) <= set(hf) and len(got) >= len(hf) - 1  # (a tied lm_head may be left out)
    for name, w in got.items():
        np.testing.assert_array_equal(w, hf[name], err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_resumes_exactly_and_checks_the_role(backend, tiny_model_dir, tmp_path):
    b1, b2 = rl_batch(seed=1), rl_batch(seed=2)
    first = engine(backend, tiny_model_dir)
    first.train_step(b1, ACTOR_LOSS)
    first.save(str(tmp_path / "ckpt"))
    want = first.train_step(b2, ACTOR_LOSS)
    resumed = engine(backend, tiny_model_dir)
    resumed.load(str(tmp_path / "ckpt"))
    got = resumed.train_step(b2, ACTOR_LOSS)
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == want[key], key
    assert same(weights(resumed), weights(first))
    critic = engine(backend, tiny_model_dir, role="critic")
    with pytest.raises(CheckpointMismatch, match="role: checkpoint 'actor', this run 'critic'"):
        critic.load(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_reload_round_trip(backend, tiny_model_dir):
    batch = rl_batch()
    eng = engine(backend, tiny_model_dir)
    eng.train_step(batch, ACTOR_LOSS)
    before, opt = eng.forward(batch)["log_probs"], optimizer_leaves(eng)
    eng.offload()
    with pytest.raises(RuntimeError, match="offloaded"):
        eng.forward(batch)
    eng.reload()
    np.testing.assert_array_equal(eng.forward(batch)["log_probs"], before)
    assert all(np.array_equal(a, b) for a, b in zip(optimizer_leaves(eng), opt))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", ["nan_loss", "nan_grad"])
def test_nonfinite_update_is_skipped_bit_identically(backend, fault, tiny_model_dir, monkeypatch):
    """Update 1 gets a NaN (fault hook): it is skipped and reported, weights and
    optimizer state stay bit-identical, and the next update equals that of an engine that
    never saw the bad one (so Adam's moments and count were untouched)."""
    b0, bad, b2 = rl_batch(seed=0), rl_batch(seed=1), rl_batch(seed=2)
    clean = engine(backend, tiny_model_dir)
    clean.train_step(b0, ACTOR_LOSS)
    clean_out = clean.train_step(b2, ACTOR_LOSS)

    monkeypatch.setenv(faults.ENV, f"{fault}@actor=1")
    eng = engine(backend, tiny_model_dir)
    assert eng.train_step(b0, ACTOR_LOSS)["nonfinite_skipped"] == 0.0
    w, opt = weights(eng), optimizer_leaves(eng)
    out = eng.train_step(bad, ACTOR_LOSS)
    assert out["nonfinite_skipped"] == 1.0
    assert not np.isfinite(out["grad_norm"])
    assert np.isfinite(out["loss"]) == (fault == "nan_grad")
    assert same(weights(eng), w)
    assert all(np.array_equal(a, b) for a, b in zip(optimizer_leaves(eng), opt))
    out = eng.train_step(b2, ACTOR_LOSS)
    assert out["nonfinite_skipped"] == 0.0
    assert out["loss"] == clean_out["loss"] and out["grad_norm"] == clean_out["grad_norm"]
    assert same(weights(eng), weights(clean))


def nll(outputs, batch, ctx):
    """Token-mean NLL by the loss contract: this micro-batch's share of
    ``-sum(log p * mask) / global_tokens``; ``tokens`` sums to the global count."""
    mask = batch["response_mask"]
    return -(outputs["log_probs"] * mask).sum() / ctx.global_tokens, {"tokens": mask.sum()}


# Same fp32 math in another summation order (gradients accumulated over micro-batches or
# all-reduced over ranks, other matmul shapes): loss and grad norm agree to ~1e-7
# relative, weights after one Adam step (eps 1e-4, see OPTIM) to ~3e-7 absolute.
RTOL, ATOL_W = 1e-5, 1e-6


def assert_same_update(got: tuple[dict, dict], want: tuple[dict, dict], keys, what: str):
    """(metrics, weights) of two engines after the same step agree (RTOL, ATOL_W)."""
    for key in keys:
        assert got[0][key] == pytest.approx(want[0][key], rel=RTOL), (what, key)
    assert got[1].keys() == want[1].keys(), what
    for name, w in want[1].items():
        np.testing.assert_allclose(got[1][name], w, rtol=0, atol=ATOL_W, err_msg=f"{what} {name}")


def step(eng, batch, loss_fn=ACTOR_LOSS, **kw) -> tuple[dict, dict]:
    return eng.train_step(batch, loss_fn, **kw), weights(eng)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batch_size_does_not_change_the_update(backend, tiny_model_dir):
    """6 rows as 6 x 1, 4 + 2 (uneven) and 1 x 6: the same loss, grad norm and weights,
    and the loss is the token mean over the whole batch (each micro-batch divides by the
    global count), not a mean of micro-batch means."""
    batch = rl_batch()
    mask = batch["response_mask"]
    probe = engine(backend, tiny_model_dir, role="reference", optim=None)
    token_mean = -float((probe.forward(batch)["log_probs"] * mask).sum() / mask.sum())
    runs = {
        micro: step(engine(backend, tiny_model_dir, micro=micro), batch, nll) for micro in (6, 4, 1)
    }
    for micro, (metrics, _) in runs.items():
        # fp32 log-probs summed over ~30 tokens, in another order than numpy's
        assert metrics["loss"] == pytest.approx(token_mean, rel=RTOL), micro
        assert metrics["tokens"] == metrics["global_tokens"] == mask.sum(), micro
        assert metrics["global_seqs"] == len(batch), micro
    for micro in (4, 1):
        assert_same_update(runs[micro], runs[6], ("loss", "grad_norm"), f"micro {micro}")


def _torch_two_ranks(path, request):
    """Two gloo ranks, each with its half of the batch (a rank per device); the run is
    shared with tests/backends/torch_fsdp/test_distributed.py (conftest)."""
    results, _ = request.getfixturevalue("torch_two_ranks")
    return {
        f"2 ranks, {name}": (r["metrics"], {k: t.numpy() for k, t in r["weights"].items()})
        for name, r in results.items()
    }


def _jax_meshes(path, request):
    """One process drives the host's devices (4 CPU devices, tests/conftest.py), each
    mesh with the whole batch."""
    runs = {}
    for mesh in ({"fsdp": 2, "tensor": 2}, {"data": 2}):
        parallel = ParallelConfig(mesh=mesh, micro_batch_size=2)
        eng = get_engine("jax_pjit")(devices=jax.devices()[: parallel.world_size])
        eng.init(ModelConfig(str(path)), OPTIM, parallel)
        runs[str(mesh)] = step(eng, mesh_batch(), nll)
    return runs


# Runs of one step of ``nll`` on ``mesh_batch()`` on meshes of more than one device,
# micro-batch 2 per data shard: {what: (metrics, weights)}.
MESHES = {"torch_fsdp": _torch_two_ranks, "jax_pjit": _jax_meshes}


def mesh_batch():
    """The batch the torch ranks split (torch_fsdp_helpers.two_rank_worker; the conftest
    puts tests/backends/torch_fsdp on the path)."""
    from torch_fsdp_helpers import random_batch

    return random_batch(8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mesh_and_world_size_do_not_change_the_update(backend, tiny_model_dir, request):
    """fsdp / hsdp (torch: 2 ranks), fsdp x tensor and data (JAX: 4 and 2 devices) give the
    single-device update; the global counts span all shards."""
    want = step(engine(backend, tiny_model_dir, micro=4), mesh_batch(), nll)
    runs = MESHES[backend](tiny_model_dir, request)
    assert len(runs) == 2
    for what, got in runs.items():
        keys = ("loss", "grad_norm", "tokens", "global_tokens", "global_seqs")
        assert_same_update(got, want, keys, what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_give_the_padded_outputs_and_update(backend, tiny_model_dir):
    """ParallelConfig.pack_sequences: each micro-batch as one row of its real tokens."""
    batch = rl_batch()
    padded, packed = (engine(backend, tiny_model_dir, pack_sequences=p) for p in (False, True))
    out_a = padded.forward(batch, temperature=0.7, entropy=True)
    out_b = packed.forward(batch, temperature=0.7, entropy=True)
    for key in ("log_probs", "entropy"):
        # fp32; packing changes matmul shapes and the attention mask's form only (~1e-7)
        np.testing.assert_allclose(out_b[key], out_a[key], rtol=0, atol=1e-5, err_msg=key)
    keys = ("loss", "grad_norm", "pg_loss", "kl_loss")
    assert_same_update(step(packed, batch), step(padded, batch), keys, "packed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_does_not_change_the_update(backend, tiny_model_dir):
    """ModelConfig.gradient_checkpointing, every checkpoint policy: memory, not results
    (what each policy keeps is backend-specific: the backends' test_recompute.py, which
    also checks torch's "budget": it needs compiled layers)."""
    batch = rl_batch()
    want = step(engine(backend, tiny_model_dir), batch)
    for policy in ("full", "selective") + (("budget",) if backend == "jax_pjit" else ()):
        model = {"gradient_checkpointing": True, "checkpoint_policy": policy}
        model |= {"activation_memory_budget": 0.5} if policy == "budget" else {}
        got = step(engine(backend, tiny_model_dir, model=model), batch)
        assert_same_update(got, want, ("loss", "grad_norm"), policy)


# By hand, per backend: (devices, hosts) of a role's mesh -> (workers, devices per worker)
# (torch runs a rank per device, JAX a process per host driving its devices), and the
# environment with which rank 1 of 2 (node 1, alone there) joins its group.
SLOT = GroupSlot(rank=1, world=2, node=1, local_rank=0, local_world=1, addr="10.0.0.1", port=29500)
PROCESS = {
    "torch_fsdp": (
        {(1, 1): (1, 1), (4, 1): (4, 1), (8, 2): (8, 1), (16, 4): (16, 1)},
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        },
    ),
    "jax_pjit": (
        {(1, 1): (1, 1), (4, 1): (1, 4), (8, 2): (2, 4), (16, 4): (4, 4)},
        {
            "POLYRL_JAX_COORDINATOR": "10.0.0.1:29500",
            "POLYRL_JAX_NUM_PROCESSES": "2",
            "POLYRL_JAX_PROCESS_ID": "1",
        },
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_process_model(backend):
    process = ENGINES[backend].process
    layouts, group_env = PROCESS[backend]
    for (devices, hosts), want in layouts.items():
        got = process.num_workers(devices, hosts), process.devices_per_worker(devices, hosts)
        assert got == want, (devices, hosts)
    assert process.group_env(SLOT) == group_env


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_on_one_device(backend, tiny_model_dir):
    # polyrl export / diagnose: a world of one device in this process, whatever the
    # process model (this session has 4 JAX host devices, which a plain JaxPjitEngine
    # would take as its mesh and refuse the default one-device ParallelConfig).
    eng = engine_on_one_device(backend)
    eng.init(ModelConfig(str(tiny_model_dir), role="actor"), OPTIM, ParallelConfig())
    assert weights(eng)
