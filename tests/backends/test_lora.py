"""LoRA (``ModelConfig.lora``) on both backends: same adapters in, same update out; base
weights untouched; only adapters in the optimizer and in checkpoints; merged export
``W + scale * B @ A`` checked by hand in numpy; resume exact; the reference (adapters off)
is the base model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import peft  # noqa: E402, F401 (pinned in requirements/cpu.lock: missing must fail, not skip)

from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

LOSS = get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)
# eps 1e-4, not 1e-8: A's first gradient (step 2) has elements at rounding level, whose
# sign Adam's normalisation would turn into +-0.74 lr either way; with eps well above
# that level the update is Lipschitz in the gradient and the backends can be compared.
OPTIM = OptimConfig(lr=1e-2, eps=1e-4, weight_decay=0.1, grad_clip=0.5, total_steps=10)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
TEMPERATURE = 0.8
# fp32 in both frameworks; matmul/softmax/reduction order differs (XLA vs ATen): O(1)
# log-probs and losses agree to a few ulps per layer (as tests/backends/test_backend_parity).
TOL = 2e-5
# Gradients agree to ~1e-5 relative (see TOL); through Adam with the eps above an update
# moves by at most lr * |dg| / eps per element: 1% of lr per step bounds that.
TOL_ADAPTERS = 2e-2 * OPTIM.lr
# The merge is one fp32 addmm (torch) / matmul + add (XLA) against numpy's float64:
# rounding of O(0.1) products summed over rank 4.
TOL_MERGE = 1e-6


def _batch():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 58, rng.integers(1, 9))) for _ in range(6)]
    resps = [list(rng.integers(3, 58, rng.integers(1, 11))) for _ in range(6)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    ref = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (6, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": ref, "advantages": adv})


def _engine(backend, path, lora=LORA):
    eng = get_engine(backend)(**({"devices": jax.devices()[:1]} if backend == "jax_pjit" else {}))
    eng.init(ModelConfig(str(path), lora=lora), OPTIM, ParallelConfig(micro_batch_size=4))
    return eng


def _adapters(eng) -> dict[str, np.ndarray]:
    """The engine's adapters under one name scheme (PEFT's without its adapter name)."""
    if hasattr(eng, "frozen"):
        return {k: np.asarray(v) for k, v in eng.params.items()}
    return {
        n.replace(".default", ""): p.full_tensor().detach().numpy().copy()
        for n, p in eng.model.named_parameters()
        if p.requires_grad
    }


def _base(eng) -> dict[str, np.ndarray]:
    if hasattr(eng, "frozen"):
        return {k: np.asarray(v).copy() for k, v in eng.frozen.items()}
    return {
        n: p.full_tensor().detach().numpy().copy()
        for n, p in eng.model.named_parameters()
        if not p.requires_grad
    }


def _steps(eng, batch, n=2):
    return [eng.train_step(batch, LOSS, temperature=TEMPERATURE, entropy=True) for _ in range(n)]


def _expected_adapter_count(path) -> int:
    """r x (in + out) per target per layer, from the model's config.json."""
    c = json.loads(Path(path, "config.json").read_text())
    e, m, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    dims = {"q_proj": (e, q), "v_proj": (e, kv), "o_proj": (q, e), "down_proj": (m, e)}
    per_layer = sum(LORA.rank * (i + o) for i, o in (dims[t] for t in LORA.target_modules))
    return per_layer * c["num_hidden_layers"]


def test_same_adapters_same_update_on_both_backends(tiny_model_dir):
    """torch (PEFT) and JAX (ours) start from the same adapters (LoraConfig.initial_a,
    seeded by name: equal bit for bit), take the same two updates (the first trains B
    only, B starting at zero; the second trains A too) and keep every base weight
    bit-identical."""
    batch = _batch()
    t, j = _engine("torch_fsdp", tiny_model_dir), _engine("jax_pjit", tiny_model_dir)
    start = _adapters(t)
    assert set(start) == set(_adapters(j))
    for name, a in _adapters(j).items():
        assert np.array_equal(a, start[name]), name
    t_base, j_base = _base(t), _base(j)
    t_metrics, j_metrics = _steps(t, batch), _steps(j, batch)
    for tm, jm in zip(t_metrics, j_metrics):
        for key in ("loss", "pg_loss", "kl_loss", "entropy"):
            assert jm[key] == pytest.approx(tm[key], abs=TOL), key
        assert jm["grad_norm"] == pytest.approx(tm["grad_norm"], rel=1e-4)
    t_after, j_after = _adapters(t), _adapters(j)
    for name in start:
        np.testing.assert_allclose(j_after[name], t_after[name], atol=TOL_ADAPTERS, err_msg=name)
    moved = [n for n in start if n.endswith("lora_B.weight")]
    assert all(np.abs(t_after[n]).max() > OPTIM.lr / 2 for n in moved)  # B really trained
    for before, eng in ((t_base, t), (j_base, j)):
        after = _base(eng)
        assert set(after) == set(before)
        for name, w in before.items():
            assert np.array_equal(after[name], w), name
    # The reference is the base: adapters off = the untouched model, adapters on moved.
    fresh = _engine("torch_fsdp", tiny_model_dir, lora=None)
    base_lp = fresh.forward(batch, temperature=TEMPERATURE)["log_probs"]
    for eng in (t, j):
        ref = eng.forward(batch, temperature=TEMPERATURE, adapters=False)["log_probs"]
        np.testing.assert_allclose(ref, base_lp, atol=TOL)
        lp = eng.forward(batch, temperature=TEMPERATURE)["log_probs"]
        assert np.abs(lp - base_lp).max() > 1e-3


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_only_adapters_train_and_export(backend, tiny_model_dir, tmp_path):
    """The optimizer holds exactly the adapters (count by hand from config.json); the
    exported weights are the HF names of the base, with W + scale * B @ A (numpy) for
    every target and W itself elsewhere, and ``trained_only`` the targets' and their
    fused siblings' alone; save_adapters writes a PEFT adapter directory
    on which peft.PeftModel (transformers base) scores as the engine does."""
    from safetensors.numpy import load_file

    eng = _engine(backend, tiny_model_dir)
    if backend == "torch_fsdp":
        trained = [p for g in eng.optimizer.param_groups for p in g["params"]]
    else:
        trained = list(eng.opt_state[0].mu.values())
    assert sum(int(np.prod(p.shape)) for p in trained) == _expected_adapter_count(tiny_model_dir)
    _steps(eng, _batch())
    adapters = _adapters(eng)
    exported = {
        k: np.array(v.detach().cpu() if isinstance(v, torch.Tensor) else v)
        for bucket in eng.export_weights(1 << 20)
        for k, v in bucket
    }
    base = load_file(str(Path(tiny_model_dir, "model.safetensors")))
    base.pop("lm_head.weight", None)  # tied: exported once, as the embedding
    assert set(exported) == set(base)
    merged = 0
    for name, w in base.items():
        a_name = name.removesuffix(".weight") + ".lora_A.weight"
        want = w.astype(np.float64)
        if a_name in adapters:
            b = adapters[a_name.replace("lora_A", "lora_B")].astype(np.float64)
            want = want + LORA.scale * b @ adapters[a_name].astype(np.float64)
            merged += 1
            assert np.abs(b).max() > 0  # a real merge, not W + 0
        np.testing.assert_allclose(exported[name], want, atol=TOL_MERGE, rtol=0, err_msg=name)
    assert merged == len(adapters) // 2
    # After the first sync only what training changes: the targets (q, v, o, down) and
    # k_proj, which vLLM loads with q and v as one layer (weights and biases).
    delta = {
        k: np.array(v.detach().cpu() if isinstance(v, torch.Tensor) else v)
        for bucket in eng.export_weights(1 << 20, trained_only=True)
        for k, v in bucket
    }
    moved = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    assert set(delta) == {n for n in base if any(m in n for m in moved)}
    for name, w in delta.items():
        np.testing.assert_array_equal(w, exported[name], err_msg=name)
    _check_peft_directory(eng, tiny_model_dir, tmp_path / "adapters")


def _check_peft_directory(eng, base_dir, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = _batch()
    eng.save_adapters(str(out))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    cols = {k: torch.as_tensor(v) for k, v in batch.tensors.items()}
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=cols["input_ids"].long(),
            attention_mask=cols["attention_mask"].long(),
            position_ids=cols["position_ids"].long(),
        ).logits[:, p - 1 : p - 1 + r]
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    want = logp.gather(-1, cols["responses"].long()[..., None])[..., 0] * cols["response_mask"]
    got = eng.forward(batch, temperature=TEMPERATURE)["log_probs"]
    np.testing.assert_allclose(got, want.numpy(), atol=TOL)  # fp32, other kernels: TOL


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_lora_resume_is_exact(backend, tiny_model_dir, tmp_path):
    """save after 2 steps -> a fresh engine loads -> its third step equals the
    uninterrupted run's bit for bit; the checkpoint holds the adapters (and their
    optimizer state), not the base weights. With dropout: a rerun takes the same steps."""
    batch = _batch()
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=LORA.target_modules)
    run = _engine(backend, tiny_model_dir, lora)
    first = _steps(run, batch)
    run.save(str(tmp_path / "ckpt"))
    torch.rand(13)  # another use of the process's RNG: dropout's masks follow the step alone
    assert _steps(_engine(backend, tiny_model_dir, lora), batch) == first
    (want,) = _steps(run, batch, 1)
    resumed = _engine(backend, tiny_model_dir, lora)
    resumed.load(str(tmp_path / "ckpt"))
    (got,) = _steps(resumed, batch, 1)
    assert got == want
    for name, w in _adapters(run).items():
        assert np.array_equal(_adapters(resumed)[name], w), name
    sizes = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    base_bytes = Path(tiny_model_dir, "model.safetensors").stat().st_size
    assert sizes < base_bytes / 4  # adapters + 2 Adam moments: ~4% of the tiny model


def test_lora_config_errors_name_the_binding():
    with pytest.raises(ValueError, match=r"LoraConfig.rank=0 must be >= 1"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match=r"LoraConfig.target_modules has 'q_porj'.*'q_proj'"):
        LoraConfig(target_modules=("q_porj",))
    with pytest.raises(ValueError, match=r"ModelConfig.lora is set for role 'critic'"):
        ModelConfig("x", role="critic", lora=LoraConfig())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_lora_composes_with_checkpointing_packing_and_compile(backend, tiny_model_dir):
    """Activation checkpointing (both policies), packed micro-batches and (torch)
    torch.compile around PEFT's layers give the eager LoRA run's two updates. Measured on
    CPU: checkpointing bit-identical on torch; packing/compile and JAX's policies differ
    in the 7th digit (other kernels / fusions)."""
    varlen = "polyrl_varlen" if backend == "torch_fsdp" else "xla"
    variants = [
        ({"gradient_checkpointing": True}, {}),
        ({"gradient_checkpointing": True, "checkpoint_policy": "selective"}, {}),
        ({"attn_implementation": varlen}, {"pack_sequences": True}),
        *([({"compile": True}, {})] if backend == "torch_fsdp" else []),
    ]

    def run(model_kw, parallel_kw):
        kw = {"devices": jax.devices()[:1]} if backend == "jax_pjit" else {}
        eng = get_engine(backend)(**kw)
        model = ModelConfig(str(tiny_model_dir), lora=LORA, **model_kw)
        eng.init(model, OPTIM, ParallelConfig(micro_batch_size=4, **parallel_kw))
        return [(m["loss"], m["grad_norm"]) for m in _steps(eng, _batch())]

    eager = run({}, {})
    for model_kw, parallel_kw in variants:
        # fp32; a different kernel order moves O(1) losses and norms by a few ulps.
        np.testing.assert_allclose(run(model_kw, parallel_kw), eager, rtol=1e-5, err_msg=model_kw)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_polyrl_export_of_a_lora_run(backend, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """``polyrl export`` of a LoRA run's checkpoint: merged weights by default, equal to
    the engine's own merged export (the weights the rollout servers get), and with
    ``--adapters-only`` a PEFT directory that scores like the engine; a run without
    LoRA refuses the flag, naming the binding. The run names its model by a relative
    path (as the gin files do): the adapters name their base by its absolute path, and
    every exported file is readable like any other the user writes (issue 47)."""
    from safetensors.numpy import load_file

    from polyrl import checkpoints
    from polyrl.cli import main
    from polyrl.configure.hf_export import read_run_config

    eng = _engine(backend, tiny_model_dir)
    _steps(eng, _batch())
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    model_path = os.path.relpath(tiny_model_dir)
    gin = (
        f"include 'gin/base.gin'\ninclude 'gin/backends/{backend}.gin'\n"
        "include 'gin/algos/grpo.gin'\n"
        f'polyrl.RunConfig.model_path = "{model_path}"\npolyrl.RunConfig.run_dir = "{run}"\n'
    )
    lora = (
        "polyrl.RunConfig.lora = @polyrl.LoraConfig()\npolyrl.LoraConfig.rank = 4\n"
        "polyrl.LoraConfig.alpha = 8.0\n"
        'polyrl.LoraConfig.target_modules = ("q_proj", "v_proj", "o_proj", "down_proj")\n'
    )
    (run / "operative_config.gin").write_text(gin + lora)
    manifest = checkpoints.run_manifest(read_run_config(run), get_algorithm("grpo"))
    checkpoints.save(run, 2, {"actor": eng.save}, {}, manifest, keep=2)

    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    exported = {k: v for f in files for k, v in load_file(f).items()}
    own = {k: np.asarray(v) for b in eng.export_weights(1 << 30) for k, v in b}
    assert exported.keys() == own.keys()
    for name, value in own.items():  # the same merge, read back in fp32
        np.testing.assert_allclose(exported[name], value, atol=TOL_MERGE, err_msg=name)

    out = tmp_path / "adapters"
    assert main(["export", str(run), "--adapters-only", "--out", str(out)]) == 0
    assert "LoRA adapters" in capsys.readouterr().out
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(Path(tiny_model_dir).resolve())  # found from any directory
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in [*files, *out.iterdir()]}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))  # safetensors' were 0600
    _check_peft_directory(eng, tiny_model_dir, out)

    (run / "operative_config.gin").write_text(gin)
    assert main(["export", str(run), "--adapters-only", "--out", str(tmp_path / "x")]) == 2
    assert "polyrl.RunConfig.lora is None" in capsys.readouterr().err
