"""The LM head fused with log-probs and entropy, computed in chunks of tokens.

A causal LM's ``lm_head`` maps hidden states [B, T, E] to logits [B, T, V]. For RL only
the log-probability of one token per position (and the entropy) is needed; with a 150k
vocabulary the fp32 logits of a micro-batch (16 x 512 x 151,936 x 4 bytes = 5 GB) are the
largest tensor of the step. :class:`ChunkedLMHead` replaces the model's ``lm_head`` (the
same ``weight`` Parameter, so the name, the tie to the embedding and the FSDP sharding are
unchanged) and, inside :meth:`ChunkedLMHead.scoring`, returns per-token scores instead of
logits, computed ``chunk_tokens`` tokens at a time. In training each chunk runs under
``torch.utils.checkpoint``: its logits are recomputed in the backward pass, so at most one
chunk's logits (and their gradient) exist at any time.

It stays inside the model's own forward (HF's ``*ForCausalLM.forward`` calls ``lm_head``),
so FSDP2 gathers and reduces its weight exactly as before. Outside ``scoring`` it is a
plain linear layer (generation, ``save_hf`` and tests see an ordinary model).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from polyrl.backends.torch_fsdp import compiling
from polyrl.tensor import log_probs_and_entropy

__all__ = ["ChunkedLMHead", "install"]


@dataclasses.dataclass(frozen=True)
class _Target:
    ids: torch.Tensor  # [B, T] the token each position is scored at
    temperature: float
    entropy: bool
    vocab: int | None


def _score_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, target: _Target
) -> torch.Tensor:
    """hidden [C, E], ids [C] -> [C, 1 or 2]: log-prob (and entropy) of
    ``softmax(hidden @ weight[:vocab].T / temperature)`` in fp32."""
    logits = F.linear(hidden, weight[: target.vocab]).float()
    if target.temperature != 1.0:  # (a pass over [C, V] fp32 each way, and x / 1 == x)
        logits = logits / target.temperature
    log_probs, entropy = log_probs_and_entropy(logits, ids, target.entropy)
    return torch.stack([log_probs] + ([entropy] if target.entropy else []), dim=-1)


class ChunkedLMHead(nn.Module):
    """``lm_head`` that scores target tokens chunk by chunk (see module docstring).

    ``weight``: the head's [V, E] Parameter (shared with the embedding when tied);
    ``chunk_tokens``: tokens per chunk (``ParallelConfig.logits_chunk_tokens``);
    ``compile``: score each chunk with ``torch.compile`` (``ModelConfig.compile``): the
    fp32 cast, log-softmax, gather and entropy fuse into a few passes over the logits.
    """

    def __init__(self, head: nn.Linear, chunk_tokens: int, compile: bool = False):
        super().__init__()
        if head.bias is not None:
            raise ValueError("ChunkedLMHead: an LM head with a bias is not supported")
        self.weight = head.weight
        self.chunk_tokens = chunk_tokens
        self._score = compiling.compiled(_score_chunk) if compile else _score_chunk
        self._compiled = compile
        self._target: _Target | None = None

    @contextlib.contextmanager
    def scoring(
        self, ids: torch.Tensor, temperature: float, entropy: bool, vocab: int | None
    ) -> Iterator[None]:
        """Within the block, a forward on hidden states [B, T + 1, E] returns [B, T, k]:
        ``[..., 0]`` = log p(``ids[:, t]``) from position ``t`` (the last position predicts
        nothing and is dropped) and, with ``entropy``, ``[..., 1]`` = the entropy there;
        over ids ``< vocab`` at ``temperature``."""
        self._target = _Target(ids, temperature, entropy, vocab)
        try:
            yield
        finally:
            self._target = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        target = self._target
        if target is None:
            return F.linear(hidden, self.weight)
        b, t = target.ids.shape
        flat = hidden[:, :-1].reshape(b * t, hidden.shape[-1])
        ids = target.ids.reshape(b * t)
        train = torch.is_grad_enabled() and (flat.requires_grad or self.weight.requires_grad)
        chunks = []
        for start in range(0, b * t, self.chunk_tokens):
            part = slice(start, start + self.chunk_tokens)
            hidden_part, ids_part = flat[part], ids[part]
            if self._compiled:
                # Copies, not views (a chunk's hidden states: E / V of its logits, 1% at
                # a 150k vocabulary): dynamo guards a view's size against its base's, so
                # a micro-batch of one chunk and one of several compiled a graph each.
                hidden_part, ids_part = hidden_part.clone(), ids_part.clone()
            if train:
                chunks.append(
                    checkpoint(
                        self._score,
                        hidden_part,
                        self.weight,
                        ids_part,
                        target,
                        use_reentrant=False,
                    )
                )
            else:
                chunks.append(self._score(hidden_part, self.weight, ids_part, target))
        # A copy, not a view: FSDP2 warns that in-place ops on a returned view would skip
        # its pre-backward hook ([B, T, 2] floats: negligible).
        return torch.cat(chunks).reshape(b, t, -1).clone()


def install(model: nn.Module, chunk_tokens: int, compile: bool = False) -> ChunkedLMHead:
    """Replace ``model``'s output layer by a :class:`ChunkedLMHead` sharing its weight."""
    head = ChunkedLMHead(model.get_output_embeddings(), chunk_tokens, compile)
    model.set_output_embeddings(head)
    return head
