"""What the Tinker service tests share: datums, a training step, forward log-probs."""

from __future__ import annotations

import random

import numpy as np
from tinker import types

from polyrl.data.prompts import encode_prompt


def datum(tok, text: str) -> types.Datum:
    """A cross-entropy datum on every next token of ``text``."""
    ids = tok.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def step(tc, data: list, lr: float) -> tuple[float, np.ndarray]:
    """forward_backward (cross_entropy) and optim_step, both sent before either is awaited,
    as the hosted service's loops do; the loss and the log-probs of every datum."""
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    out = fb.result()
    opt.result()
    lps = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
    return out.metrics["loss:sum"], lps


def sft_steps(tc, data: list, steps: int, lr: float) -> list[float]:
    return [step(tc, data, lr)[0] for _ in range(steps)]


def forward_log_probs(tc, tokens: list[int]) -> np.ndarray:
    """The training model's log-probs of ``tokens[1:]``, each given the ones before it."""
    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)},
    )
    return tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def copy_prompts(tok, n: int, seed: int = 0) -> list[tuple[list[int], str]]:
    """``n`` copy-task prompts (polyrl/copy: "copy 471" -> "471") through the chat
    template, with their answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        answer = "".join(rng.choice("0123456789") for _ in range(3))
        ids = encode_prompt(tok, [{"role": "user", "content": f"copy {answer}"}])
        out.append((list(ids), answer))
    return out
