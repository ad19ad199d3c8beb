"""experiments/bench/grpo_step.py's update MFU: the actor update's FLOPs from the
``batch/tokens`` metric of the timed steps, 6 x parameters a token (4 x with LoRA: no
weight gradients for the frozen base) plus attention, over the update phase's seconds
and the GPU's dense bf16 peak times the actor's devices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
import grpo_step  # noqa: E402

# one layer of hidden 4 (2 heads, 1 KV head), MLP 8, vocab 10: matmul weights
# 4*4*2 + 4*2*2 + 3*4*8 = 144 in the layer + 40 in the head = 184
MODEL = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8,
         "vocab_size": 10, "num_key_value_heads": 1, "num_attention_heads": 2}  # fmt: skip


def _cfg(tmp_path, lora: bool, epochs: int = 1, devices: int = 1):
    """tiny_grpo.gin (tiny_grpo_lora.gin) at 1 prompt x n=2 rows a step."""
    from polyrl.configure.launch import parse_config

    gin = "gin/experiments/tiny_grpo_lora.gin" if lora else "gin/experiments/tiny_grpo.gin"
    cfg, _ = parse_config(
        [gin],
        [
            f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}",
            "polyrl.RunConfig.prompts_per_step = 1",
            "polyrl.RunConfig.mini_batch_prompts = 1",
            "polyrl.SamplingSpec.n = 2",
            f"polyrl.RunConfig.epochs = {epochs}",
            f"actor/polyrl.ParallelConfig.mesh = {{'fsdp': {devices}}}",
        ],
    )
    return cfg


@pytest.mark.parametrize("lora", [False, True])
def test_update_mfu_counts_each_epoch_and_lora_by_hand(tmp_path, monkeypatch, lora):
    """Two timed steps of 2 rows with 8 and 12 tokens in all (means: 10 tokens, rows of
    5): matmuls (4 or 6) x 184 x 10, attention 12 x 1 x 4 x (25 + 25); 2 epochs; 2 s of
    update on 2 GPUs of a 1 TFLOP/s peak."""
    monkeypatch.setattr(grpo_step, "gpu_peak", lambda: ("NVIDIA H100 80GB HBM3", 1.0))
    rows = [{"batch/tokens": 8.0}, {"batch/tokens": 12.0}]
    found = grpo_step.update_mfu(
        _cfg(tmp_path, lora, epochs=2, devices=2), MODEL, rows, update_s=2.0
    )
    flops = 2 * ((4 if lora else 6) * 184 * 10 + 12 * 4 * 50)
    assert found["tokens"] == 10.0 and found["flops"] == flops
    assert found["tflops_per_s"] == pytest.approx(flops / 2.0 / 1e12)
    assert found["mfu"] == pytest.approx(flops / 2.0 / (2 * 1e12))
    assert found["flops_per_token"] == ("4 x params (LoRA)" if lora else "6 x params")


def test_no_mfu_without_a_known_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(grpo_step, "gpu_peak", lambda: (None, None))
    found = grpo_step.update_mfu(
        _cfg(tmp_path, False), MODEL, [{"batch/tokens": 10.0}], update_s=1.0
    )
    assert found["mfu"] is None and found["flops"] == 6 * 184 * 10 + 12 * 4 * 50


def test_a_stopped_runs_finished_steps_are_read(tmp_path):
    """metrics.jsonl of a run stopped at --timeout mid-write: the step rows before its
    cut-off last line (a validation row has no time/step); none without the file."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 0, "val/reward/mean": 0.1}\n{"step": 1, "time/step": 2.0}\n'
        '{"step": 2, "time/step": 3.0}\n{"step": 3, "time/st'
    )
    assert [r["step"] for r in grpo_step.step_rows(metrics)] == [1, 2]
    assert grpo_step.step_rows(tmp_path / "missing.jsonl") == []


STUCK = """
import resource, threading, time
print("core limit", resource.getrlimit(resource.RLIMIT_CORE), flush=True)
def waits_for_a_batch_that_never_comes():
    threading.Event().wait()
threading.Thread(target=waits_for_a_batch_that_never_comes, daemon=True).start()
def main_thread_sleeps():
    time.sleep(600)
main_thread_sleeps()
"""


def test_a_run_past_its_timeout_leaves_every_threads_stack_in_its_log(tmp_path):
    """A run that hangs (a thread waiting forever, the main thread asleep) is stopped at
    the timeout, and its log ends with both threads' stacks, each naming the function it
    waits in; the run wrote no core file (its core limit is 0). A run that ends in time
    gives its return code."""
    import sys

    log = tmp_path / "train.log"
    assert grpo_step.run_logged([sys.executable, "-c", STUCK], log, timeout=5) == (None, True)
    text = log.read_text()
    assert "core limit (0, 0)" in text
    assert "waits_for_a_batch_that_never_comes" in text and "main_thread_sleeps" in text
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 2
    assert not list(tmp_path.glob("core*"))
    ends = [sys.executable, "-c", "print('done'); raise SystemExit(3)"]
    assert grpo_step.run_logged(ends, log, timeout=60) == (3, False)
    assert log.read_text() == "done\n"
