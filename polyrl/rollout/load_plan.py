"""Planned weight loads: vLLM's ``model.load_weights`` learned once per bucket layout,
then replayed as a few fused copies.

``load_weights`` runs a Python weight loader per tensor (stacked q/k/v and gate/up
merges, tensor-parallel narrowing), which costs far more than the bytes it moves. For
plain unquantized layers every loader ends in ``param[...].copy_(incoming[...])``: where
each incoming tensor's bytes go is a fixed function of the bucket's layout. So
:class:`LoadPlanner` does, per worker:

1. **Learn** — the first time a bucket layout (names, dtypes, shapes, offsets in the
   flat buffer) arrives, run the real ``load_weights`` once under a
   ``TorchDispatchMode`` that records every ``aten.copy_`` into a parameter's storage
   as (destination view: storage offset, size, stride) <- (source view of one incoming
   tensor: its narrowing). Each TP rank records its own narrowing.
2. **Decide** — an incoming tensor is *planned* only when all it does is plain copies
   into parameters. It goes to the *fallback* (``load_weights`` for that tensor, every
   time) when it is read by any op other than a view or a copy (a dtype cast, a loader
   that does math, a quantizer), copied into something other than a parameter, or
   copies into a parameter that is also written any other way (from computed data, by
   another in-place op, or by overlapping copies).
3. **Verify** — the parameters' fingerprints (data pointer, sum of the bytes) before and after
   the learning load must show no write the recorder did not see (a loader that
   rebinds ``param.data`` or writes outside aten); then the planned regions are
   overwritten with a sentinel, the plan replays the same bucket, and every planned
   parameter must equal, byte for byte, what ``load_weights`` left. Any failure drops the
   plan for that layout (everything goes through ``load_weights``) and logs why once.
4. **Apply** — later buckets with that layout: contiguous copies become byte ranges,
   merged where consecutive ones are adjacent in both the flat bucket and the parameter
   (e.g. ``gate_proj`` + ``up_proj`` into ``gate_up_proj``: one copy); ranges of 1 MiB
   and more are one device copy each, the rest one ``torch._foreach_copy_`` — no
   weight-loader Python per parameter. When the bucket arrives in a buffer that stays
   (the CUDA IPC receive buffer), those copies are captured once into a CUDA graph and
   replayed: one launch per bucket. Before each apply the plan checks its parameters
   still live at the recorded addresses (else it relearns).

A new layout learns a new plan (plans are kept per layout key); a changed parameter
address drops every plan. vLLM-CPU repacks its linear weights into oneDNN handles, so
its workers keep the layer-wise reload path (``worker_ext``); the planner itself is
device-agnostic and tested on CPU against vLLM's own models and weight loaders.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["BucketPlan", "LoadPlanner", "bare_vllm_model", "layout_key", "vllm_parallel"]

log = logging.getLogger(__name__)
_aten = torch.ops.aten
_BIG = 1 << 20  # byte ranges from this size are copied one by one, smaller ones fused

Weights = Sequence[tuple[str, torch.Tensor]]
Load = Callable[[Weights], None]


def layout_key(weights: Weights, metas: Sequence[Sequence[Any]] | None = None) -> Hashable:
    """What a plan depends on: the flat buffer's metadata when there is one (names, dtypes,
    shapes, offsets), else each tensor's name, dtype and shape."""
    if metas is not None:
        return ("flat", _frozen(metas))
    return ("list", tuple((n, t.dtype, tuple(t.shape)) for n, t in weights))


def _frozen(value: Any) -> Any:
    """``value`` with every list or tuple in it a tuple: hashable. The metadata reaches an
    engine core in another process (vLLM's async engine) through msgpack, which turns
    each tuple, a shape too, into a list."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass
class _Copy:
    """One recorded ``dst.copy_(src)`` (src: a view of incoming tensor ``source``), or
    ``dst.fill_(value)`` (``source`` -1)."""

    source: int
    src_offset: int  # elements from the source tensor's first element
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    param: str
    dst_offset: int  # storage offset (elements) in the parameter's storage
    dst_stride: tuple[int, ...]
    dst_dtype: torch.dtype
    value: Any = None

    def dst_view(self, param: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(param.detach(), self.src_size, self.dst_stride, self.dst_offset)

    def dst_bytes(self) -> tuple[int, int]:
        """[first, last+1) byte of the destination in its storage."""
        size = self.dst_dtype.itemsize
        span = sum((n - 1) * s for n, s in zip(self.src_size, self.dst_stride)) + 1
        return self.dst_offset * size, (self.dst_offset + span) * size


def _contiguous(size: Sequence[int], stride: Sequence[int]) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


class _Recorder(TorchDispatchMode):
    """Records, during one ``load_weights``, every copy into a parameter and every other
    use of the incoming tensors or writes to the parameters (see the module docstring)."""

    def __init__(self, sources: Sequence[torch.Tensor], params: dict[str, torch.Tensor]):
        super().__init__()
        self.sources = list(sources)
        self.starts = sorted((t.data_ptr(), i) for i, t in enumerate(self.sources) if t.numel())
        self.param_of = {}
        for name, p in params.items():
            self.param_of.setdefault((p.device, p.untyped_storage().data_ptr()), name)
        self.copies: list[_Copy] = []
        self.bad_sources: dict[int, str] = {}
        self.bad_params: dict[str, str] = {}

    def _source(self, t: Any) -> int | None:
        """Index of the incoming tensor that ``t`` is a view of, if any."""
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or not self.starts:
            return None
        ptr = t.data_ptr()
        k = bisect.bisect_right(self.starts, (ptr, math.inf)) - 1
        if k < 0:
            return None
        i = self.starts[k][1]
        src = self.sources[i]
        if src.device != t.device or ptr >= src.data_ptr() + src.numel() * src.element_size():
            return None
        return i

    def _param(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        return self.param_of.get((t.device, t.untyped_storage().data_ptr()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            self._copy(args[0], args[1])
        elif func in (_aten.fill_.Scalar, _aten.zero_.default) and self._param(args[0]) is not None:
            value = args[1] if func is _aten.fill_.Scalar else 0
            self._record(-1, None, args[0], value=value)  # e.g. zeroing vocab padding
        else:
            self._other(func, args, kwargs)
        return func(*args, **kwargs)

    def _copy(self, dst: torch.Tensor, src: Any) -> None:
        param, i = self._param(dst), self._source(src)
        if param is None:
            if i is not None:
                self.bad_sources.setdefault(i, "copied into a tensor that is not a parameter")
            return
        if i is None:
            self.bad_params.setdefault(param, "written from data that is no incoming tensor")
            return
        source = self.sources[i]
        offset, rem = divmod(src.data_ptr() - source.data_ptr(), source.element_size())
        if src.dtype != source.dtype or rem or tuple(src.shape) != tuple(dst.shape):
            self.bad_params.setdefault(param, "written from a reinterpreted or broadcast view")
            return
        span = sum((n - 1) * s for n, s in zip(src.shape, src.stride())) + 1
        if src.numel() and offset + span > source.numel():
            self.bad_params.setdefault(param, "written from a view spanning incoming tensors")
            return
        self._record(i, src, dst)

    def _record(self, i: int, src: torch.Tensor | None, dst: torch.Tensor, value: Any = None):
        source = self.sources[i] if src is not None else None
        self.copies.append(
            _Copy(
                source=i,
                src_offset=(src.data_ptr() - source.data_ptr()) // source.element_size()
                if src is not None
                else 0,
                src_size=tuple(dst.shape),
                src_stride=tuple(src.stride()) if src is not None else (),
                param=self._param(dst),
                dst_offset=dst.storage_offset(),
                dst_stride=tuple(dst.stride()),
                dst_dtype=dst.dtype,
                value=value,
            )
        )

    def _other(self, func, args, kwargs) -> None:
        schema = func._schema
        for k, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            for t in tree_leaves(value):
                param = self._param(t)
                if param is not None:
                    self.bad_params.setdefault(param, f"written by {func}")
                i = self._source(t)
                if i is not None:
                    self.bad_sources.setdefault(i, f"written by {func}")
        if func.is_view:
            return
        for t in tree_leaves((args, kwargs)):
            i = self._source(t)
            if i is not None:
                self.bad_sources.setdefault(i, f"read by {func} (the loader computes)")


@dataclasses.dataclass
class BucketPlan:
    """The copies that reproduce ``load_weights`` for one bucket layout.

    ``dsts`` are parameter views, fed in order by ``byte_src`` (source index or -1 for
    the flat buffer, first byte, last byte + 1: a uint8 range) and then ``typed_src``
    (source index, element offset, size, stride: a TP narrowing along an inner
    dimension, a dtype-converting copy); ``fills`` are constant writes (vocab padding);
    ``fallback``: indices of the incoming tensors that still go through ``load_weights``.
    """

    byte_src: list[tuple[int, int, int]]
    typed_src: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]
    dsts: list[torch.Tensor]
    fills: list[tuple[torch.Tensor, Any]]  # (parameter view, value), e.g. vocab padding
    big: int  # the first ``big`` byte ranges are >= _BIG bytes: copied one by one
    fallback: list[int]
    params: list[tuple[torch.Tensor, int]]  # (parameter, its data pointer when learned)
    reasons: dict[str, str]
    # copy(graph=True): flat buffer's address -> (the buffer, CUDA graph of the copies from
    # it); None: capture failed here, copy eagerly
    graphs: dict[int, tuple[torch.Tensor, Any]] | None = dataclasses.field(default_factory=dict)

    @property
    def copies(self) -> int:
        return len(self.dsts)

    def sources(self, weights: Weights, flat: torch.Tensor | None) -> list[torch.Tensor]:
        srcs = [
            (flat if i < 0 else weights[i][1].reshape(-1).view(torch.uint8))[a:b]
            for i, a, b in self.byte_src
        ]
        for i, offset, size, stride in self.typed_src:
            t = weights[i][1]
            srcs.append(torch.as_strided(t, size, stride, t.storage_offset() + offset))
        return srcs

    def valid(self) -> bool:
        return all(p.data_ptr() == ptr for p, ptr in self.params)

    def copy(self, weights: Weights, flat: torch.Tensor | None, graph: bool = False) -> bool:
        """Write the bucket (``weights``, views of ``flat`` when given) into the parameters.

        ``graph``: ``flat`` is a persistent CUDA buffer that every bucket of this layout
        arrives in (the CUDA IPC receive buffer): the copies are captured into a CUDA graph
        per buffer the first time and replayed after that — one launch, none of the Python
        and the per-range launches of :meth:`_copy`. :meth:`valid` guards the parameters'
        side as for eager copies. Returns whether a graph ran."""
        if not (graph and flat is not None and flat.is_cuda and self.graphs is not None):
            self._copy(weights, flat)
            return False
        captured = self.graphs.get(flat.data_ptr())
        if captured is None or captured[0] is not flat:
            captured = self._capture(weights, flat)
            if captured is None:
                self.graphs = None
                self._copy(weights, flat)
                return False
            self.graphs[flat.data_ptr()] = captured
        captured[1].replay()
        return True

    def _capture(self, weights: Weights, flat: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                self._copy(weights, flat)
        except RuntimeError as e:  # e.g. a CUDA build or driver without graph capture
            log.warning("load plan: copies not captured into a CUDA graph, run eagerly: %s", e)
            return None
        return flat, g

    def _copy(self, weights: Weights, flat: torch.Tensor | None) -> None:
        for d, value in self.fills:
            d.fill_(value)
        if not self.dsts:
            return
        srcs = self.sources(weights, flat)
        if any(s.device != d.device for s, d in zip(srcs, self.dsts)):
            for d, s in zip(self.dsts, srcs):  # e.g. host buckets into device parameters
                d.copy_(s)
            return
        # Large byte ranges: one copy each (a plain device memcpy); the small ones, then the
        # typed ones, each as one fused multi-tensor copy (uniform lists keep its fast path).
        big, nbytes = self.big, len(self.byte_src)
        for d, s in zip(self.dsts[:big], srcs[:big]):
            d.copy_(s)
        for lo, hi in ((big, nbytes), (nbytes, len(self.dsts))):
            if hi > lo:
                torch._foreach_copy_(self.dsts[lo:hi], srcs[lo:hi])

    @classmethod
    def build(
        cls,
        rec: _Recorder,
        params: dict[str, torch.Tensor],
        offsets: Sequence[int] | None,
    ) -> BucketPlan:
        """The plan from one recorded load. ``offsets``: each incoming tensor's byte
        offset in the flat buffer (None: separate tensors, nothing merges across them)."""
        reasons = {f"param {k}": v for k, v in rec.bad_params.items()}
        reasons.update({f"tensor #{k}": v for k, v in rec.bad_sources.items()})
        bad_params = set(rec.bad_params) | _overlapping(rec.copies, reasons)
        bad = set(rec.bad_sources) | {c.source for c in rec.copies if c.param in bad_params}
        bad.discard(-1)
        kept = [c for c in rec.copies if c.source not in bad and c.param not in bad_params]
        copies = _last_of_duplicates(kept)
        fills = [(c.dst_view(params[c.param]), c.value) for c in copies if c.source < 0]
        typed: list[tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], torch.Tensor]] = []
        runs: list[list[Any]] = []  # [param, src key, src start, src end, dst start, dst end]
        for c in sorted(
            (c for c in copies if c.source >= 0), key=lambda c: (c.param, c.dst_offset)
        ):
            src = rec.sources[c.source]
            if (
                c.dst_dtype != src.dtype
                or c.dst_offset < params[c.param].storage_offset()
                or not _contiguous(c.src_size, c.src_stride)
                or not _contiguous(c.src_size, c.dst_stride)
            ):
                where = (c.source, c.src_offset, c.src_size, c.src_stride)
                typed.append((where, c.dst_view(params[c.param])))
                continue
            key, start = (-1, offsets[c.source]) if offsets is not None else (c.source, 0)
            a = start + c.src_offset * src.element_size()
            base = params[c.param].storage_offset() * c.dst_dtype.itemsize
            lo, hi = (x - base for x in c.dst_bytes())  # bytes from the parameter's start
            last = runs[-1] if runs else None
            if last and last[0] == c.param and last[1] == key and last[3] == a and last[5] == lo:
                last[3], last[5] = a + hi - lo, hi
            else:
                runs.append([c.param, key, a, a + hi - lo, lo, hi])
        runs.sort(key=lambda r: r[5] - r[4] < _BIG)  # the large ones first
        storages = {n: params[n].detach().reshape(-1).view(torch.uint8) for n, *_ in runs}
        plan = cls(
            byte_src=[(key, a, b) for _, key, a, b, _, _ in runs],
            typed_src=[where for where, _ in typed],
            dsts=[storages[n][lo:hi] for n, _, _, _, lo, hi in runs] + [d for _, d in typed],
            fills=fills,
            big=sum(r[5] - r[4] >= _BIG for r in runs),
            fallback=sorted(bad),
            params=[],
            reasons=reasons,
        )
        touched = {c.param for c in copies}
        plan.params = [(params[n], params[n].data_ptr()) for n in sorted(touched)]
        return plan


def _overlapping(copies: Sequence[_Copy], reasons: dict[str, str]) -> set[str]:
    """Parameters with copies whose destinations overlap without being the same view."""
    bad: set[str] = set()
    spans: dict[str, list[tuple[int, int, _Copy]]] = {}
    for c in copies:
        spans.setdefault(c.param, []).append((*c.dst_bytes(), c))
    for param, items in spans.items():
        items.sort(key=lambda x: x[:2])
        for (_, hi1, c1), (lo2, _, c2) in zip(items, items[1:]):
            same = (c1.dst_offset, c1.src_size, c1.dst_stride) == (
                c2.dst_offset,
                c2.src_size,
                c2.dst_stride,
            )
            if lo2 < hi1 and not same:
                bad.add(param)
                reasons.setdefault(f"param {param}", "copies into it overlap")
    return bad


def _last_of_duplicates(copies: Sequence[_Copy]) -> list[_Copy]:
    """Drop copies a later copy into the same destination view overwrites."""
    last = {(c.param, c.dst_offset, c.src_size, c.dst_stride): k for k, c in enumerate(copies)}
    return [
        c
        for k, c in enumerate(copies)
        if last[(c.param, c.dst_offset, c.src_size, c.dst_stride)] == k
    ]


def _fingerprints(params: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(address, checksum of the bytes) per parameter: any dtype, exact, NaN-free."""
    if not params:
        return []
    sums = [_checksum(p) for p in params.values()]
    return [(p.data_ptr(), int(s)) for p, s in zip(params.values(), sums)]


def _checksum(p: torch.Tensor) -> Any:
    """Sum of the bytes read as int64 words (wrapping: exact in any order), or, for a size
    that is no multiple of 8, of the bytes in 4 MiB chunks (torch widens uint8 to int64
    whole before summing)."""
    b = _bytes(p)
    if b.numel() % 8 == 0:
        return b.view(torch.int64).sum()
    return sum(c.sum() for c in b.split(1 << 22))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes(a), _bytes(b))


class LoadPlanner:
    """Learns, verifies and applies :class:`BucketPlan` s for one model (one per vLLM
    worker: each TP rank plans its own shard). ``load`` is the model's real loader,
    ``load(weights)``; ``model`` gives the parameters."""

    def __init__(self, model: torch.nn.Module, load: Load):
        self.model = model
        self.load_weights = load
        self.plans: dict[Hashable, BucketPlan | None] = {}
        self.stats = {"learned": 0, "planned": 0, "graphed": 0, "fallback_tensors": 0, "refused": 0}

    def load(
        self,
        weights: Weights,
        flat: torch.Tensor | None = None,
        metas: Sequence[Sequence[Any]] | None = None,
        persistent: bool = False,
    ) -> None:
        """Load ``weights`` (views of ``flat`` at ``metas``' offsets when given).
        ``persistent``: ``flat`` is a buffer that later buckets of this layout arrive in
        again: planned copies from it are replayed as a CUDA graph (``BucketPlan.copy``)."""
        key = layout_key(weights, metas if flat is not None else None)
        plan = self.plans.get(key, False)
        if plan is not False and plan is not None and not plan.valid():
            self.plans.clear()  # the parameters moved: every plan's views are stale
            plan = False
        if plan is False:
            self.plans[key] = self._learn(weights, flat, metas)
            return
        if plan is None:
            self.load_weights(weights)
            return
        self.stats["graphed"] += plan.copy(weights, flat, graph=persistent)
        if plan.fallback:
            self.load_weights([weights[i] for i in plan.fallback])
        self.stats["planned"] += 1
        self.stats["fallback_tensors"] += len(plan.fallback)

    def release_graphs(self) -> None:
        """Drop every plan's CUDA graphs (and with them the flat buffers they read), e.g.
        when the sender replaced an IPC buffer; the next persistent load captures anew."""
        for plan in self.plans.values():
            if plan is not None and plan.graphs is not None:
                plan.graphs.clear()

    def _learn(self, weights: Weights, flat: torch.Tensor | None, metas: Any) -> BucketPlan | None:
        params = dict(self.model.named_parameters())
        before = _fingerprints(params)
        rec = _Recorder([t for _, t in weights], params)
        with rec:
            self.load_weights(weights)
        after = _fingerprints(params)
        self.stats["learned"] += 1
        seen = {c.param for c in rec.copies} | set(rec.bad_params)
        for name, (p0, s0), (p1, s1) in zip(params, before, after):
            if p0 != p1 or (name not in seen and s0 != s1):
                return self._refuse(weights, f"{name} changed by a write the recorder missed")
        offsets = [int(m[3]) for m in metas] if flat is not None else None
        plan = BucketPlan.build(rec, params, offsets)
        problem = self._verify(plan, weights, flat)
        if problem:
            return self._refuse(weights, problem)
        if plan.fallback:
            names = [weights[i][0] for i in plan.fallback]
            log.info(
                "load plan: %d tensors keep load_weights (%s): %s",
                len(names),
                names[:4],
                plan.reasons,
            )
        return plan

    def _verify(self, plan: BucketPlan, weights: Weights, flat: torch.Tensor | None) -> str | None:
        """Replay the plan over sentinel-filled regions; it must rebuild every planned
        parameter exactly as ``load_weights`` left it."""
        if not plan.params:
            return None
        want = [p.detach().clone() for p, _ in plan.params]
        for d in plan.dsts + [d for d, _ in plan.fills]:
            d.fill_(
                0xA5 if d.dtype == torch.uint8 else float("nan") if d.is_floating_point() else -1
            )
        plan.copy(weights, flat)
        for (p, _), w in zip(plan.params, want):
            if not _bytes_equal(p.detach(), w):
                for (q, _), v in zip(plan.params, want):
                    q.detach().copy_(v)
                return "replaying the plan did not reproduce load_weights"
        return None

    def _refuse(self, weights: Weights, why: str) -> None:
        self.stats["refused"] += 1
        log.warning(
            "load plan: bucket layout of %d tensors (first %s) keeps load_weights: %s",
            len(weights),
            weights[0][0] if weights else "-",
            why,
        )
        return None


# ------------------------------------------- vLLM models outside an engine (tests, bench)
@contextlib.contextmanager
def vllm_parallel(world_size: int = 1, rank: int = 0, init_method: str | None = None):
    """vLLM's distributed state for ``world_size`` tensor-parallel ranks in this process
    (gloo on CPU, NCCL on GPU), torn down on exit: what :func:`bare_vllm_model` needs."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if init_method is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    init_distributed_environment(world_size, rank, init_method, rank, backend)
    try:
        with set_current_vllm_config(VllmConfig()):
            initialize_model_parallel(world_size, 1)
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def bare_vllm_model(
    model_dir: str, dtype: str, device: str = "cpu"
) -> tuple[torch.nn.Module, Load]:
    """vLLM's model class for ``model_dir`` with its real weight loaders, built without an
    engine (no weight packing, random parameters), and its ``load_weights`` as a
    ``load(weights)`` function. Needs :func:`vllm_parallel`."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config = ModelConfig(
        model=str(model_dir), dtype=dtype, max_model_len=128, skip_tokenizer_init=True
    )
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device))
    default = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)  # what vLLM's loader does around this
    try:
        with set_current_vllm_config(config), torch.device(device):
            model = initialize_model(vllm_config=config)
    finally:
        torch.set_default_dtype(default)

    def load(weights: Weights) -> None:
        with set_current_vllm_config(config):
            model.load_weights(iter(weights))

    return model, load
