"""TrainEngine: the only thing the controller knows about a training backend.

Both backends (``torch_fsdp``, ``jax_pjit``) implement this Protocol with the same
semantics, so that one algorithm (a loss function from ``polyrl.algos``) gives the
same update on either. Shapes: ``B`` samples, ``P`` prompt tokens, ``R`` response
tokens; the sequence columns are described in ``polyrl.batch``.

Loss-function contract (STYLE.md 2)
-----------------------------------
``loss_fn(outputs, batch, ctx) -> (loss, metrics)`` where

* ``outputs``: the model's per-token outputs for one micro-batch, as the backend's own
  arrays: ``"log_probs"`` [B, R] (log-softmax of logits / temperature, gathered at the
  response tokens), ``"entropy"`` [B, R] when ``entropy=True``, ``"values"`` [B, R] for
  a value-head role;
* ``batch``: the micro-batch's numeric columns as the backend's arrays;
* ``ctx``: :class:`LossContext`, the global token/sequence counts of the whole
  optimizer step (all micro-batches and all data-parallel ranks).

``loss`` is this micro-batch's *contribution*: already divided by the global counts,
so the engine sums it over micro-batches and data-parallel ranks and never divides
again. Each metric follows the same rule (a summable contribution), so metrics do not
depend on micro-batching or world size either.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from polyrl.batch import Batch
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

__all__ = ["LossContext", "LossFn", "TrainEngine", "ENGINES", "get_engine", "Bucket"]


@dataclasses.dataclass(frozen=True)
class LossContext:
    """Global normalisers of one optimizer step.

    global_tokens: number of valid response tokens (sum of ``response_mask``) in the
      whole mini-batch, over all micro-batches and data-parallel ranks.
    global_seqs: number of samples with at least one valid response token, likewise.
    temperature: the sampling temperature the log-probs were computed at.
    """

    global_tokens: float
    global_seqs: float
    temperature: float = 1.0


LossFn = Callable[
    [Mapping[str, Any], Mapping[str, Any], LossContext], tuple[Any, Mapping[str, Any]]
]

# One weight bucket: full (unsharded) tensors under Hugging Face parameter names, as
# the backend's arrays (torch.Tensor / jax.Array); weight_sync converts via DLPack.
Bucket = list[tuple[str, Any]]


@runtime_checkable
class TrainEngine(Protocol):
    """One role's model on one worker (torch: one rank; JAX: one host's devices)."""

    def init(self, model: ModelConfig, optim: OptimConfig | None, parallel: ParallelConfig) -> None:
        """Build or load the model, shard it, build the optimizer (None: frozen role)."""

    def forward(
        self, batch: Batch, *, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, Any]:
        """No-grad per-token outputs as numpy: ``log_probs`` [B, R] (``entropy``,
        ``values`` when asked for / a value-head role). Zero where ``response_mask`` is 0."""

    def train_step(
        self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0, entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step on ``batch`` (this worker's shard of one mini-batch).

        Splits into micro-batches of ``ParallelConfig.micro_batch_size``, accumulates
        gradients, clips by global norm, steps the optimizer and schedule. Returns
        ``loss``, ``grad_norm`` (before clipping), ``lr`` and ``loss_fn``'s metrics.
        """

    def export_weights(self, bucket_bytes: int) -> Iterator[Bucket]:
        """Full tensors under HF names in buckets of about ``bucket_bytes``; never more
        than one bucket of gathered weights alive at a time."""

    def save(self, path: str) -> None:
        """Checkpoint model, optimizer, schedule, RNG and step to directory ``path``."""

    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote; the next step equals the uninterrupted run's."""

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state to host memory."""

    def reload(self) -> None:
        """Undo :meth:`offload`."""


# Registered backends: name -> "module:Class". The core picks a backend by name and
# imports it lazily, so it never imports torch or jax itself.
ENGINES: dict[str, str] = {
    "torch_fsdp": "polyrl.backends.torch_fsdp.engine:TorchFSDPEngine",
    "jax_pjit": "polyrl.backends.jax_pjit.engine:JaxPjitEngine",
}


def get_engine(name: str) -> type:
    """The engine class registered as ``name`` (imports its framework)."""
    if name not in ENGINES:
        raise ValueError(f"unknown backend {name!r}; registered backends: {sorted(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)
