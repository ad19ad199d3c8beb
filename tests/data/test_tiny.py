"""The tiny model and tokenizer: built offline, loadable by transformers and vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from polyrl.data.prompts import encode_prompt
from polyrl.data.tasks import TASKS, make_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tokenizer_round_trips_task_strings(tokenizer, task):
    for row in make_rows(task, 50, seed=3):
        for text in (row["prompt"][0]["content"], row["ground_truth"]):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer("4719", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    assert [tokenizer.decode([i]) for i in ids] == ["4", "7", "1", "9"]


def test_chat_template_and_special_tokens(tokenizer):
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "copy 123"}])
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user:copy 123<|im_end|><|im_start|>assistant:"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_model_loads_in_transformers_and_generates(tiny_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["vocab_size"] == len(tokenizer)  # no padded rows: every id decodes
    ids = torch.tensor([encode_prompt(tokenizer, [{"role": "user", "content": "12+34="}])])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) or out[0, -1].item() == tokenizer.eos_token_id


def test_rebuild_is_deterministic(tmp_path, tiny_model_dir):
    from safetensors.numpy import load_file

    from polyrl.data.tiny import build_tiny_model

    again = build_tiny_model(tmp_path / "again")
    a = load_file(tiny_model_dir / "model.safetensors")
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    path, prompt = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True))
    c = out[0].outputs[0]
    print("RESULT" + json.dumps({"ids": list(c.token_ids),
                                 "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]}))
    """
)


# slow: the default tier loads the tiny model in vLLM in every rollout test
# (test_pool.py::test_synced_weights_match_transformers compares it with transformers)
@pytest.mark.slow
def test_model_loads_in_vllm_and_matches_transformers(tiny_model_dir, tokenizer):
    """vLLM (CPU build, fp32, greedy) generates, and its log-probs of what it generated
    equal transformers' log-softmax at the same positions."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = encode_prompt(tokenizer, [{"role": "user", "content": "copy 4719"}])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(tiny_model_dir), json.dumps(prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[len("RESULT") :])
    assert len(got["ids"]) == 6

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seq = torch.tensor([prompt + got["ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
    steps = logp[len(prompt) - 1 : -1]
    ref = steps[torch.arange(6), torch.tensor(got["ids"])].numpy()
    # fp32 forward in two implementations (fused CPU kernels vs eager torch): agree to ~1e-5.
    np.testing.assert_allclose(got["logprobs"], ref, atol=1e-4)
    # Greedy: each chosen token is (up to fp32 noise) the argmax of transformers' logits.
    assert np.all(steps.max(dim=-1).values.numpy() - ref < 1e-4)


def test_building_the_tiny_model_prints_no_progress_bar(tmp_path, capfd):
    """Issue 34: validate-config and train printed transformers' "Writing model shards"
    tqdm bar when they built the tiny model; the bar stays on for other code."""
    from transformers.utils import logging as hf_logging

    from polyrl.data.tiny import ensure_tiny_model

    ensure_tiny_model(tmp_path)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and "it/s" not in err, err
    assert hf_logging.is_progress_bar_enabled()
