"""Weight buckets as a backend exports them (``TrainEngine.export_weights``).

A bucket is a sequence of ``(hf_name, array)`` with full tensors under Hugging Face names,
about ``bucket_bytes`` large (:func:`iter_buckets`). A backend may hand out a bucket that
makes its pairs on first use (:class:`LazyPairs`) and one that packs itself into a
transport's flat buffer (:class:`OwnBucket`; the flat layout: :data:`TensorMeta`, every
offset :func:`aligned`). ``polyrl.weight_sync`` moves them; this module is what the
backends and the core share, so neither imports the other's side.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["TensorMeta", "aligned", "LazyPairs", "OwnBucket", "iter_buckets"]

# (hf_name, torch dtype name, shape, byte offset in the bucket's flat buffer, nbytes)
TensorMeta = tuple[str, str, tuple[int, ...], int, int]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 256: every tensor's offset in a flat buffer is a multiple
    of 256, so every view is aligned for any dtype."""
    return -(-nbytes // 256) * 256


class LazyPairs(Sequence):
    """``(name, array)`` pairs made on first use by :meth:`make`, their count known
    before (``__len__``): a consumer that never reads them (a planned load, a pack from
    the source arrays) never pays for them."""

    _pairs: list[tuple[str, Any]] | None = None

    @abc.abstractmethod
    def make(self) -> list[tuple[str, Any]]:
        """The pairs, made once."""

    @property
    def pairs(self) -> list[tuple[str, Any]]:
        if self._pairs is None:
            self._pairs = self.make()
        return self._pairs

    def __getitem__(self, i):
        return self.pairs[i]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs)


class OwnBucket(LazyPairs):
    """An engine's export bucket that packs itself: ``polyrl.weight_sync.pack_flat`` calls
    :meth:`pack` instead of making the pairs (the JAX engine's: one XLA program casts the
    arrays and writes their bytes), and a transport asks :attr:`torch_device` where it
    lives."""

    @abc.abstractmethod
    def pack(self, alloc: Any) -> tuple[Any, list[TensorMeta]]:
        """(flat uint8 torch tensor, metas) as ``pack_flat`` returns them, packed into
        ``alloc(nbytes, device)``."""

    @property
    @abc.abstractmethod
    def torch_device(self) -> Any:
        """The torch device the bucket's arrays sit on."""


def iter_buckets(
    named: Iterable[tuple[str, Any]], bucket_bytes: int
) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, array)`` pairs into buckets of about ``bucket_bytes`` (a tensor
    larger than that gets a bucket of its own). For sources other than an engine's
    ``export_weights``, e.g. a transformers ``state_dict().items()``."""
    if bucket_bytes <= 0:
        raise ValueError(f"iter_buckets: bucket_bytes={bucket_bytes} must be > 0")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, a in named:
        n = int(a.nbytes)  # torch, numpy and jax arrays all have it
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, a))
        size += n
    if bucket:
        yield bucket
