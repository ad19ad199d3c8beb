"""A stand-in for the rollout pool in episode tests that need no vLLM.

``TextPolicy.generate_ids`` samples random text of the tiny tokenizer's alphabet,
tokenized canonically, and ends each turn with <|im_end|> ("stop") or cuts it at the
request's budget ("length"), as vLLM's ``max_tokens`` would; it remembers each request so
a test can check that an episode holds exactly what was sampled.
"""

from __future__ import annotations

import random

import numpy as np

ALPHABET = "0123456789*+-=: acimnoprstuy"


class TextPolicy:
    """Stands in for RolloutPool: ``generate_ids`` returns canonical tokens of random text,
    ending with EOS ("stop") or cut at the request's budget ("length"); remembers each
    request so a test can check the trajectory holds exactly what was sampled."""

    pad_token_id, version = 0, 7

    def __init__(self, tokenizer, seed: int = 0, cut: float = 0.3):
        self.tok, self.rng, self.cut = tokenizer, random.Random(seed), cut
        self.sampled: dict[int, list[tuple[list[int], list[int]]]] = {}

    servers = [None]  # one server: RolloutPool.generate_on's index

    async def generate_on(self, server, requests, spec):
        return self.generate_ids(requests, spec)

    def generate_ids(self, requests, spec):
        out = []
        for index, prompt, budget in requests:
            text = "".join(self.rng.choice(ALPHABET) for _ in range(self.rng.randint(1, 6)))
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            cap = min(spec.max_tokens, budget)
            stop = self.rng.random() > self.cut and len(ids) < cap
            ids = (ids + [self.tok.eos_token_id]) if stop else ids[:cap]
            self.sampled.setdefault(index, []).append((list(prompt), ids))
            out.append(
                {
                    "token_ids": np.asarray(ids, np.int32),
                    "log_probs": -np.arange(1, len(ids) + 1, dtype=np.float32),
                    "finish_reason": "stop" if stop else "length",
                    "text": self.tok.decode(ids, skip_special_tokens=True),
                    "version": self.version,
                }
            )
        return out

    def sample_info(self, spec, dropped):
        return {"n": spec.n, "weight_version": self.version}
