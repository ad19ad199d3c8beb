"""experiments/bench/train_step.py's hand-written limit (``hf_torch``) does what its flags
say: with --grad-ckpt each decoder layer runs again in the backward pass. Module forwards
are counted: the recompute stops once it has what backward needs, so a layer's own
forward hook does not fire again, its first modules' do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
from train_step import hf_torch_step, make_batch, parse_args  # noqa: E402


def _module_forwards(argv: list[str], model_dir: Path) -> int:
    """Module forwards in one step of the hand loop (recomputes included)."""
    args = parse_args(argv)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    step = hf_torch_step(args, model_dir, make_batch(args.batch, 4, 6, vocab, 0))
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: calls.append(module)
    )
    try:
        step()
    finally:
        handle.remove()
    return len(calls)


def test_hand_loop_checkpoints_only_when_asked(tiny_model_dir):
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    base = ["--batch", "2", "--micro-batch", "2", "--model", str(tiny_model_dir)]
    plain = _module_forwards(base, tiny_model_dir)
    recomputed = _module_forwards([*base, "--grad-ckpt"], tiny_model_dir) - plain
    assert plain > 0 and recomputed >= layers, (plain, recomputed)
