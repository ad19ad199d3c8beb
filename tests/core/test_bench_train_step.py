"""experiments/bench/train_step.py's hand-written limit (``hf_torch``) does what its flags
say: with --grad-ckpt each decoder layer runs again in the backward pass. Module forwards
are counted: the recompute stops once it has what backward needs, so a layer's own
forward hook does not fire again, its first modules' do. With --ckpt-policy selective
the recompute runs no matmul: executed matmuls are counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
from train_step import hf_torch_step, make_batch, parse_args  # noqa: E402


def _step(argv: list[str], model_dir: Path):
    args = parse_args(argv)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return hf_torch_step(args, model_dir, make_batch(args.batch, 4, 6, vocab, 0))


def _module_forwards(argv: list[str], model_dir: Path) -> int:
    """Module forwards in one step of the hand loop (recomputes included)."""
    step = _step(argv, model_dir)
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


class _CountMatmuls(TorchDispatchMode):
    """Matmuls executed (a selective checkpoint's cached results never reach this mode)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def _matmuls(argv: list[str], model_dir: Path) -> int:
    step = _step(argv, model_dir)
    with _CountMatmuls() as count:
        step()
    return count.n


@pytest.mark.parametrize(("policy", "recomputes"), [("full", True), ("selective", False)])
def test_hand_loop_selective_checkpointing_recomputes_no_matmul(tiny_model_dir, policy, recomputes):
    base = ["--batch", "2", "--micro-batch", "2", "--model", str(tiny_model_dir)]
    plain = _matmuls(base, tiny_model_dir)
    ckpt = _matmuls([*base, "--grad-ckpt", "--ckpt-policy", policy], tiny_model_dir)
    assert (ckpt > plain) == recomputes and ckpt >= plain, (plain, ckpt)


def test_model_flops_count_no_weight_gradients_for_a_frozen_base():
    """MFU's FLOPs, by hand for one layer of hidden 4 (2 heads, 1 KV head), MLP 8, vocab
    10, two sequences of 3 and 5 tokens: matmul weights 4*4*2 + 4*2*2 + 3*4*8 = 144 per
    layer + 40 for the head = 184; full fine-tuning 6 x 184 x 8 tokens, LoRA 4 x (the
    frozen weights get no gradient matmul); attention 12 x 1 x 4 x (9 + 25) either way."""
    import numpy as np
    from train_step import train_flops

    cfg = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8,
           "vocab_size": 10, "num_key_value_heads": 1, "num_attention_heads": 2}  # fmt: skip
    lengths = np.array([3, 5])
    assert train_flops(cfg, lengths) == 6 * 184 * 8 + 12 * 4 * 34
    assert train_flops(cfg, lengths, frozen_base=True) == 4 * 184 * 8 + 12 * 4 * 34
